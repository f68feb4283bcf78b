"""Transient storage failures while a round's aggregate is stored: which they are, and when to
try again (exponential backoff, bounded by the round's deadline and a retry window)."""

from __future__ import annotations

import errno
import logging
import math
import os
import threading
from dataclasses import dataclass

from tensorswap.rounds.core.state import RoundId
from tensorswap.rounds.journal import transient_journal_error

__all__ = ["TRANSIENT_ERRNOS", "RetryPolicy", "RetrySchedule", "transient_cause"]

TRANSIENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO})
"""OS errors a later attempt may not meet: a full disk or quota (space can be freed), an I/O
error on write (a flaky device, a network file system)."""

log = logging.getLogger(__name__)


def transient_cause(exc: BaseException) -> str | None:
    """A short description when ``exc`` (or what it was raised from) is a transient storage
    failure, else None. Follows ``__cause__`` / ``__context__`` a few levels deep."""
    seen: BaseException | None = exc
    for _ in range(16):
        if seen is None:
            return None
        if isinstance(seen, OSError) and seen.errno in TRANSIENT_ERRNOS:
            return f"{os.strerror(seen.errno)} (errno {errno.errorcode[seen.errno]})"
        if transient_journal_error(seen):
            return f"journal: {seen}"
        seen = seen.__cause__ or seen.__context__
    return None


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Backoff for a round whose aggregate could not be stored for a transient reason.

    Attempt ``k`` (from 1) waits ``min(cap, first * factor ** (k - 1))`` seconds. Retries go on
    until the round's deadline or ``window`` seconds after the first failure, whichever is
    later; then the round fails with the last reason. ``window=0`` and no deadline: no retry.
    """

    first: float = 0.5
    factor: float = 2.0
    cap: float = 30.0
    window: float = 300.0

    def __post_init__(self) -> None:
        for name in ("first", "factor", "cap", "window"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(f"RetryPolicy.{name} must be a finite number >= 0, got {value!r}")

    def delay(self, attempt: int) -> float:
        return float(min(self.cap, self.first * self.factor ** max(attempt - 1, 0)))


@dataclass(slots=True)
class _Pending:
    attempts: int
    first_failure: float
    give_up_at: float
    due: float | None


class RetrySchedule:
    """Rounds waiting for another attempt at storing their aggregate; thread-safe."""

    def __init__(self, policy: RetryPolicy | None = None) -> None:
        self.policy = policy or RetryPolicy()
        self._lock = threading.Lock()
        self._rounds: dict[RoundId, _Pending] = {}

    def failed(
        self, round_id: RoundId, now: float, deadline: float | None
    ) -> tuple[int, float] | None:
        """Record a transient failure: ``(attempt, due)`` of the next attempt, or None when
        the retries have run out (the round is forgotten here; the caller fails it)."""
        with self._lock:
            entry = self._rounds.get(round_id)
            if entry is None:
                limit = max(
                    deadline if deadline is not None else -math.inf, now + self.policy.window
                )
                entry = self._rounds[round_id] = _Pending(0, now, limit, None)
            entry.attempts += 1
            due = now + self.policy.delay(entry.attempts)
            if due > entry.give_up_at:
                del self._rounds[round_id]
                return None
            entry.due = due
            return entry.attempts, due

    def plan(
        self, round_id: RoundId, now: float, deadline: float | None, exc: BaseException
    ) -> str | None:
        """After ``exc``: the reason an Aggregating status shows while the next attempt waits,
        or None when ``exc`` is not transient or the retries ran out (fail the round)."""
        why = transient_cause(exc)
        if why is None:
            return None
        planned = self.failed(round_id, now, deadline)
        if planned is None:
            log.warning("round %s: giving up after transient failures: %s", round_id, exc)
            return None
        attempt, due = planned
        return (
            f"retrying in {max(due - now, 0.0):.1f} s after attempt {attempt} failed: {why}: {exc}"
        )

    def next_due(self) -> float | None:
        with self._lock:
            return min((e.due for e in self._rounds.values() if e.due is not None), default=None)

    def take_due(self, now: float) -> list[RoundId]:
        """Rounds whose next attempt is due at ``now``; each is returned once per failure."""
        with self._lock:
            due = [rid for rid, e in self._rounds.items() if e.due is not None and e.due <= now]
            for rid in due:
                self._rounds[rid].due = None
            return due

    def forget(self, round_id: RoundId) -> None:
        """The round stored its aggregate, or ended otherwise."""
        with self._lock:
            self._rounds.pop(round_id, None)
