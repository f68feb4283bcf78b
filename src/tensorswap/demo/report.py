"""What a demo run did: `RoundReport`, `DemoReport` (``summary.json``), from peers' reports."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["DemoReport", "RoundReport", "row_json", "summarise"]


@dataclass
class RoundReport:
    """One round as the driver saw it."""

    round: int
    expected: int
    reported: int = 0
    contributors: int = 0
    accuracy: float = 0.0
    min_accuracy: float = 0.0
    sent_bytes: int = 0
    dense_bytes: int = 0
    pulled_bytes: int = 0
    swarm_bytes: int = 0  # --swarm: bytes of aggregates the peers got from each other
    saved_bytes: int = 0
    seconds: float = 0.0
    ok: bool = True
    outcome: str = ""
    how: str = ""  # the outcome in a few words, for the table
    killed: str | None = None
    aggregate: str | None = None
    participants: list[str] = field(default_factory=list)


@dataclass
class DemoReport:
    """What a demo run did; also written to ``summary.json``."""

    config: dict[str, Any]
    initial_accuracy: float
    rounds: list[RoundReport] = field(default_factory=list)
    seconds: float = 0.0
    coordinator: dict[str, Any] | None = None
    plot: str = ""
    summary: str = ""
    versions: list[Any] = field(default_factory=list)
    """A federated run's versions (`demo.run_driver.VersionReport`); empty otherwise."""
    run: dict[str, Any] | None = None
    """A federated run: its name, spec and the peers' totals."""
    outer_steps: list[Any] = field(default_factory=list)
    """``--topology diloco``: one `demo.diloco.OuterStepReport` per outer step; else empty."""

    @property
    def final_accuracy(self) -> float:
        if self.versions:
            return float(self.versions[-1].accuracy)
        if self.outer_steps:
            return float(self.outer_steps[-1].accuracy)
        return self.rounds[-1].accuracy if self.rounds else self.initial_accuracy

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["final_accuracy"] = self.final_accuracy
        return data


def summarise(report: RoundReport, results: list[dict[str, Any]]) -> None:
    """Fill ``report``'s figures from the peers' ``round`` events (not ok when none came)."""
    if not results:
        report.ok = False
        report.outcome = report.how = "no peer reported"
        return
    accs = [float(e["accuracy"]) for e in results]
    report.reported = len(results)
    report.accuracy = sum(accs) / len(accs)
    report.min_accuracy = min(accs)
    report.sent_bytes = sum(int(e.get("sent_bytes", 0)) for e in results)
    report.dense_bytes = sum(int(e.get("dense_bytes", 0)) for e in results)
    report.pulled_bytes = sum(int(e.get("pulled_bytes", 0)) for e in results)
    report.swarm_bytes = sum(int(e.get("swarm_bytes", 0)) for e in results)
    report.saved_bytes = sum(
        int(e.get("saved_bytes", 0)) + int(e.get("pull_saved_bytes", 0)) for e in results
    )
    report.contributors = max(int(e.get("contributors", 0)) for e in results)


def row_json(row: Any) -> dict[str, Any]:
    """One of the coordinator's round rows (`server_status`) as JSON values."""
    return {
        "round": row.round,
        "initiator": row.initiator,
        "status": row.status.to_dict(),
        "received": row.received,
        "expected": row.expected,
        "quorum": row.quorum,
        "strategy": row.strategy,
        "nbytes": row.nbytes,
        "peers": list(row.peers),
    }
