"""The no-progress rule: how long a reducer waits for a committed peer's push."""

from __future__ import annotations

import math
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
    view in which ``peer`` had committed and the slice was this reducer's. ``rate`` (values
    per second) is the slowest measured in this call, on this peer's own clock: each push
    that reached it (its values over how long this peer waited for it; one that was here
    before the wait began counts as instant) and each of its own pushes (dialling and
    sending the blocks). With none yet, ``peer``'s last measured push here in an earlier
    call (``earlier``); with nothing measured at all, nothing is overdue: the rule never
    fires on a guess. No peer's claim enters the measure.
    """

    clock: Callable[[], float]
    earlier: dict[str, float]
    """Per peer, the rate of its last push measured here (kept across calls)."""
    rates: list[float] = field(default_factory=list)
    since: dict[tuple[int, str], float] = field(default_factory=dict)
    counted: set[tuple[int, str]] = field(default_factory=set)

    def arrived(self, j: int, peer: str, values: int, at: float) -> None:
        """``peer``'s push of slice ``j`` (``values`` values) reached this peer at ``at``."""
        if (j, peer) in self.counted or values <= 0:
            return
        self.counted.add((j, peer))
        waited = at - self.since.get((j, peer), at)
        rate = values / waited if waited > 0 else math.inf
        self.rates.append(rate)
        if len(self.earlier) < 1024 or peer in self.earlier:
            self.earlier[peer] = rate

    def pushed(self, values: int, seconds: float) -> None:
        """This peer pushed ``values`` values to a reducer in ``seconds``."""
        if values > 0:
            self.rates.append(values / seconds if seconds > 0 else math.inf)

    def slowest(self, peer: str) -> float | None:
        """The rate ``peer``'s pushes are judged by (values per second), None if unknown."""
        if self.rates:
            return min(self.rates)
        return self.earlier.get(peer)

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
        rate = self.slowest(peer) or math.inf
        return (
            f"its {values} values of slice {j} have not arrived {waited:.1f} s after its "
            f"commit was seen; the slowest push measured here ({rate:.0f} values/s) needs "
            f"{values / rate:.3f} s for them (allowed: {STALL_FLOOR:g} s + "
            f"{STALL_FACTOR:g}x that)"
        )
