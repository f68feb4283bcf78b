"""PrivacyLedger: a DP run's journal (per round: the sample rate and clipping norm; per
contribution: its norm and clip bit; per step: the noised aggregate and ε), in the runs
database beside the runs tables."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # runs.model imports runs.dp_params: no runs imports at import time
    from tensorswap.runs.journal import RunDatabase

__all__ = ["PrivacyLedger", "PrivacyRound", "PrivacyStep"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS run_dp_rounds (
    run         TEXT    NOT NULL,
    round       INTEGER NOT NULL,
    sampled     INTEGER NOT NULL,
    population  INTEGER NOT NULL,
    clip        REAL    NOT NULL,
    PRIMARY KEY (run, round),
    FOREIGN KEY (run) REFERENCES runs (name) ON DELETE CASCADE
);
CREATE TABLE IF NOT EXISTS run_dp_contributions (
    run         TEXT    NOT NULL,
    round       INTEGER NOT NULL,
    peer        TEXT    NOT NULL,
    update_cid  TEXT    NOT NULL,
    norm        REAL    NOT NULL,
    clipped     INTEGER NOT NULL,
    PRIMARY KEY (run, round, peer, update_cid),
    FOREIGN KEY (run) REFERENCES runs (name) ON DELETE CASCADE
);
CREATE TABLE IF NOT EXISTS run_dp_steps (
    run             TEXT    NOT NULL,
    round           INTEGER NOT NULL,
    noised_cid      TEXT    NOT NULL,
    clip            REAL    NOT NULL,
    noise_std       REAL    NOT NULL,
    contributors    INTEGER NOT NULL,
    clipped         INTEGER NOT NULL,
    noised_clipped  REAL    NOT NULL,
    next_clip       REAL    NOT NULL,
    rate            REAL    NOT NULL,
    epsilon         REAL    NOT NULL,
    PRIMARY KEY (run, round),
    FOREIGN KEY (run) REFERENCES runs (name) ON DELETE CASCADE
);
CREATE TABLE IF NOT EXISTS run_dp_stops (
    run     TEXT PRIMARY KEY,
    reason  TEXT NOT NULL,
    FOREIGN KEY (run) REFERENCES runs (name) ON DELETE CASCADE
);
"""


@dataclass(frozen=True, slots=True)
class PrivacyRound:
    """A DP round as started: ``sampled`` of ``population`` active peers (rate
    ``sampled / population``), updates clipped to ``clip``."""

    round: int
    sampled: int
    population: int
    clip: float

    @property
    def rate(self) -> float:
        return self.sampled / self.population


@dataclass(frozen=True, slots=True)
class PrivacyStep:
    """A DP round released: its noised aggregate (the mean clipped delta plus Gaussian noise
    of ``noise_std``), how many of the ``contributors`` were clipped (and that count noised),
    the clipping norm of the next round, and the run's ε after it."""

    round: int
    noised_cid: str
    clip: float
    noise_std: float
    contributors: int
    clipped: int
    noised_clipped: float
    next_clip: float
    rate: float
    epsilon: float


class PrivacyLedger:
    """The DP tables, written through the runs journal's connection (each write commits
    before it returns)."""

    def __init__(self, journal: RunDatabase) -> None:
        self.journal = journal.journal
        self.journal.register("privacy", _SCHEMA)

    def start_round(self, run: str, entry: PrivacyRound) -> None:
        """Record round ``entry.round`` as sampled (again, after a restart: replaced)."""
        with self.journal.transaction() as db:
            db.execute(
                "INSERT OR REPLACE INTO run_dp_rounds VALUES (?, ?, ?, ?, ?)",
                (run, entry.round, entry.sampled, entry.population, entry.clip),
            )

    def round(self, run: str, round: int) -> PrivacyRound | None:
        rows = self.journal.query(
            "SELECT round, sampled, population, clip FROM run_dp_rounds"
            " WHERE run = ? AND round = ?",
            (run, round),
        )
        if not rows:
            return None
        r, s, p, c = rows[0]
        return PrivacyRound(int(r), int(s), int(p), float(c))

    def note_contribution(
        self, run: str, round: int, peer: str, update_cid: str, norm: float, clipped: bool
    ) -> None:
        """Record a contribution's norm and clip bit before it is submitted (keyed by its
        CID: a refused submit leaves a row nothing reads)."""
        with self.journal.transaction() as db:
            db.execute(
                "INSERT OR REPLACE INTO run_dp_contributions VALUES (?, ?, ?, ?, ?, ?)",
                (run, round, peer, update_cid, norm, int(clipped)),
            )

    def clip_bits(self, run: str, round: int) -> dict[tuple[str, str], bool]:
        rows = self.journal.query(
            "SELECT peer, update_cid, clipped FROM run_dp_contributions"
            " WHERE run = ? AND round = ?",
            (run, round),
        )
        return {(str(p), str(c)): bool(b) for p, c, b in rows}

    def add_step(self, run: str, step: PrivacyStep) -> None:
        with self.journal.transaction() as db:
            db.execute(
                "INSERT INTO run_dp_steps VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    run,
                    step.round,
                    step.noised_cid,
                    step.clip,
                    step.noise_std,
                    step.contributors,
                    step.clipped,
                    step.noised_clipped,
                    step.next_clip,
                    step.rate,
                    step.epsilon,
                ),
            )

    def steps(self, run: str) -> list[PrivacyStep]:
        rows = self.journal.query(
            "SELECT round, noised_cid, clip, noise_std, contributors, clipped, noised_clipped,"
            " next_clip, rate, epsilon FROM run_dp_steps WHERE run = ? ORDER BY round",
            (run,),
        )
        return [
            PrivacyStep(
                int(r),
                str(cid),
                float(c),
                float(s),
                int(n),
                int(k),
                float(nk),
                float(nc),
                float(q),
                float(e),
            )
            for r, cid, c, s, n, k, nk, nc, q, e in rows
        ]

    def stop(self, run: str, reason: str) -> None:
        """Finish the run with ``reason``, in one transaction."""
        with self.journal.transaction() as db:
            db.execute("INSERT OR REPLACE INTO run_dp_stops VALUES (?, ?)", (run, reason))
            db.execute("UPDATE runs SET finished = 1 WHERE name = ?", (run,))

    def stop_reason(self, run: str) -> str:
        rows = self.journal.query("SELECT reason FROM run_dp_stops WHERE run = ?", (run,))
        return str(rows[0][0]) if rows else ""
