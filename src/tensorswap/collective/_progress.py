"""The no-progress rule: how long a reducer waits for a committed peer's push."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["STALL_FACTOR", "STALL_FLOOR", "Progress"]

STALL_FACTOR = 8.0
"""A push is given this many times the time the slowest measured throughput needs for it."""
STALL_FLOOR = 2.0
"""Seconds every push is given on top of that (dialling, a retry, a busy event loop)."""


@dataclass(slots=True)
class Progress:
    """One reducer's measure of the pushes of one call, and since when it waits for each.

    A push of ``values`` values from ``peer`` is overdue once this reducer has waited for it
    longer than ``STALL_FLOOR + STALL_FACTOR * values / rate``. The wait starts at the first
    view in which ``peer`` had committed and the slice was this reducer's; ``rate`` (values
    per second) is the slowest of every push that reached this reducer in this call (as its
    sender timed it: dialling, then sending its blocks) and of ``peer``'s last push to this
    reducer in an earlier call (``earlier``). With nothing measured, nothing is overdue:
    the rule never fires on a guess.
    """

    clock: Callable[[], float]
    earlier: dict[str, float]
    """Per peer, the rate of its last measured push to this reducer (kept across calls)."""
    rates: dict[tuple[int, str], float] = field(default_factory=dict)
    since: dict[tuple[int, str], float] = field(default_factory=dict)

    def arrived(self, j: int, peer: str, values: int, seconds: float) -> None:
        """``peer``'s push of slice ``j`` (``values`` values) is here; it took ``seconds``."""
        if (j, peer) in self.rates or values <= 0 or seconds <= 0:
            return
        rate = values / seconds
        self.rates[(j, peer)] = rate
        if len(self.earlier) < 1024 or peer in self.earlier:
            self.earlier[peer] = rate

    def slowest(self, peer: str) -> float | None:
        """The rate ``peer``'s pushes are judged by (values per second), None if unknown."""
        known = list(self.rates.values())
        if peer in self.earlier:
            known.append(self.earlier[peer])
        return min(known) if known else None

    def due(self, j: int, peer: str, values: int) -> float | None:
        """When (on ``clock``) ``peer``'s push of slice ``j`` becomes overdue; None while no
        push is measured. The first call starts the wait."""
        since = self.since.setdefault((j, peer), self.clock())
        rate = self.slowest(peer)
        if rate is None:
            return None
        return since + STALL_FLOOR + STALL_FACTOR * values / rate

    def explain(self, j: int, peer: str, values: int) -> str:
        """Why ``peer``'s push of slice ``j`` is overdue, for the accusation."""
        waited = self.clock() - self.since.get((j, peer), self.clock())
        rate = self.slowest(peer) or 0.0
        need = values / rate if rate else float("inf")
        return (
            f"its {values} values of slice {j} have not arrived {waited:.1f} s after its "
            f"commit was seen; the slowest push measured here ({rate:.0f} values/s) needs "
            f"{need:.3f} s for them (allowed: {STALL_FLOOR:g} s + {STALL_FACTOR:g}x that)"
        )
