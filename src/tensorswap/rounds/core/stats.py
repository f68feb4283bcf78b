"""The coordinator's counters (since it was built; not persisted)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["CoordinatorStats"]


@dataclass(frozen=True, slots=True)
class CoordinatorStats:
    """Counters since this coordinator was built (they are not persisted).

    ``contribution_bytes`` sums the accepted updates' block sizes (manifests and chunks),
    whether or not their blocks crossed a wire (the server counts wire bytes).
    """

    contributions: int = 0
    rejected: int = 0
    contribution_bytes: int = 0
    contributions_dropped: int = 0
    rounds_started: int = 0
    rounds_completed: int = 0
    rounds_failed: int = 0
    aggregation_seconds: float = 0.0
    last_aggregation_seconds: float = 0.0
    aggregation_retries: int = 0
    active_rounds: int = 0
    gc_runs: int = 0
    gc_rounds_removed: int = 0
    gc_blocks_removed: int = 0
    gc_bytes_removed: int = 0
    gc_failures: int = 0

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)
