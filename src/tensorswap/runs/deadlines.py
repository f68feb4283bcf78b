"""Adaptive round deadlines: the next deadline from the arrival times of earlier rounds.

``auto_deadline`` is a pure function of what the coordinator journaled (each round's
arrival delays ``submitted_at - created_at``, its expected peers and the deadline it ran
with), so the deadline a run chooses is recomputable after any restart.

The rule, for the round about to start with quorum ``q``:

1. Each earlier round (the newest ``window`` of them) gives one observation, the delay of
   its ``q``-th arrival:

   - it had ``q`` arrivals or more: that arrival's delay (exact);
   - fewer, and its deadline closed it before all its expected peers came (it timed out
     below ``q``): the ``q``-th arrival is unknown but at least the deadline the round ran
     with, and that deadline counts (*censored*);
   - fewer, because it expected fewer peers than ``q`` and all came: its last arrival counts
     (the best lower bound known);
   - no arrivals and no deadline: no observation.

2. With no observation the deadline is ``initial`` (None: ``cap``). Otherwise it is
   ``median + k x spread``, the median of the observations and ``spread`` their median
   absolute deviation, but at least ``MIN_SPREAD`` (a tenth) of the median, so a MAD of 0
   (identical arrivals, one round of history) still leaves a margin.

3. When the newest earlier round timed out below ``q`` the deadline is at least
   ``BACKOFF`` (2) x the deadline that round ran with: consecutive timeouts double it, so a
   run whose peers became slower never stays stuck below their arrival time.

4. The result is clamped to ``[floor, cap]``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tensorswap.rounds.core import RoundId

if TYPE_CHECKING:
    from tensorswap.rounds.engine import Coordinator
    from tensorswap.runs.journal import RunDatabase
    from tensorswap.runs.model import RunInfo

__all__ = [
    "BACKOFF",
    "MIN_SPREAD",
    "Deadline",
    "RoundArrivals",
    "auto_deadline",
    "journaled_deadline",
    "run_history",
]

MIN_SPREAD = 0.1
"""The spread is never below this fraction of the median (a margin when the MAD is 0)."""

BACKOFF = 2.0
"""After a round timed out below quorum, the next deadline is at least this times its own."""


@dataclass(frozen=True, slots=True)
class RoundArrivals:
    """What one earlier round tells: the delays (seconds after the round was created) of its
    contributions, how many peers it expected, and the deadline (seconds) it ran with."""

    delays: tuple[float, ...]
    expected: int
    deadline_s: float | None

    def __post_init__(self) -> None:
        if not all(math.isfinite(d) for d in self.delays):
            raise ValueError(f"arrival delays must be finite, got {self.delays!r}")
        # a peer's clock is not involved (coordinator times), but never count below 0
        delays = tuple(sorted(max(0.0, float(d)) for d in self.delays))
        object.__setattr__(self, "delays", delays)
        if self.expected < 1:
            raise ValueError(f"expected must be >= 1, got {self.expected}")
        if self.deadline_s is not None and not (
            math.isfinite(self.deadline_s) and self.deadline_s > 0
        ):
            raise ValueError(f"deadline_s must be > 0, got {self.deadline_s!r}")

    def observe(self, quorum: int) -> tuple[float, bool] | None:
        """The delay of the ``quorum``-th arrival and whether it is censored (the round's
        deadline passed first), or None when the round tells nothing."""
        if len(self.delays) >= quorum:
            return self.delays[quorum - 1], False
        if len(self.delays) < self.expected and self.deadline_s is not None:
            return self.deadline_s, True
        if self.delays:
            return self.delays[-1], False
        return None


@dataclass(frozen=True, slots=True)
class Deadline:
    """A chosen deadline in seconds and the one-line reason shown in ``status`` and the log."""

    seconds: float
    reason: str


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _s(value: float) -> str:
    return f"{value:.3g} s"


def auto_deadline(
    history: Sequence[RoundArrivals],
    quorum: int,
    *,
    k: float,
    floor: float,
    cap: float,
    initial: float | None = None,
) -> Deadline:
    """The deadline of the next round from ``history`` (oldest first; the caller passes the
    window it wants), by the rule in the module docstring. Deterministic; the result lies in
    ``[floor, cap]`` and does not decrease as ``k`` grows."""
    if quorum < 1:
        raise ValueError(f"quorum must be >= 1, got {quorum}")
    if not (math.isfinite(k) and k >= 0):
        raise ValueError(f"k must be >= 0, got {k!r}")
    if not (math.isfinite(floor) and math.isfinite(cap) and 0 < floor <= cap):
        raise ValueError(f"need 0 < floor <= cap, got floor {floor!r}, cap {cap!r}")
    bounds = f"(floor {_s(floor)}, cap {_s(cap)})"
    observed = [o for o in (r.observe(quorum) for r in history) if o is not None]
    if not observed:
        raw = cap if initial is None else initial
        seconds = min(cap, max(floor, raw))
        what = "the cap" if initial is None else f"initial {_s(initial)}"
        return Deadline(seconds, f"auto: no arrivals yet, {what} = {_s(seconds)} {bounds}")
    values = [value for value, _ in observed]
    median = statistics.median(values)
    mad = statistics.median(abs(v - median) for v in values)
    spread = max(mad, MIN_SPREAD * median)
    raw = median + k * spread
    censored = sum(1 for _, c in observed if c)
    spread_text = f"MAD {_s(mad)}" if spread == mad else f"{MIN_SPREAD:g} x median {_s(spread)}"
    reason = (
        f"auto: median {_s(median)} of the {_ordinal(quorum)} arrival over {len(values)}"
        f" round{'s' if len(values) != 1 else ''}"
        + (f" ({censored} timed out)" if censored else "")
        + f" + {k:g} x {spread_text} = {_s(raw)}"
    )
    last = history[-1].observe(quorum) if history else None
    if last is not None and last[1]:
        backoff = BACKOFF * last[0]
        if backoff > raw:
            raw = backoff
            reason += f", last round timed out: {BACKOFF:g} x {_s(last[0])} = {_s(raw)}"
    seconds = min(cap, max(floor, raw))
    return Deadline(seconds, f"{reason} {bounds}")


def run_history(coordinator: Coordinator, run: str, round: int, window: int) -> list[RoundArrivals]:
    """The arrivals of rounds ``round - window .. round - 1`` of ``run``, oldest first, from
    the coordinator's journaled rounds and contributions; rounds it no longer knows
    (retention) or that are still collecting are left out."""
    out = []
    for n in range(max(1, round - window), round):
        rid = RoundId(n, run)
        info = coordinator.info(rid)
        if info is None or not info.status.is_terminal:
            continue
        delays = tuple(c.submitted_at - info.created_at for c in coordinator.contributions(rid))
        used = None if info.deadline is None else info.deadline - info.created_at
        out.append(RoundArrivals(delays, info.spec.expected_peers, used if used else None))
    return out


def journaled_deadline(
    journal: RunDatabase, coordinator: Coordinator, info: RunInfo, quorum: int
) -> tuple[float, str]:
    """The deadline (seconds, reason) of round ``info.round`` of an auto run: the one
    journaled for it (a restart), else computed from the earlier rounds' arrivals and
    journaled first."""
    known = journal.deadline(info.name, info.round)
    if known is None:
        spec = info.spec
        history = run_history(coordinator, info.name, info.round, spec.deadline_window)
        chosen = auto_deadline(
            history,
            quorum,
            k=spec.deadline_k,
            floor=spec.deadline_floor_s,
            cap=spec.deadline_cap_s,
            initial=spec.deadline_initial_s,
        )
        known = (chosen.seconds, chosen.reason)
        journal.set_deadline(info.name, info.round, *known)
    return known
