"""Round deadlines: injectable clocks, the quorum rule at expiry, and a timer thread."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Protocol

from tensorswap.rounds.core.state import Aggregating, RoundInfo

__all__ = [
    "Clock",
    "DeadlineTimer",
    "FakeClock",
    "SystemClock",
    "due_rounds",
    "expiry_verdict",
    "next_deadline",
]

log = logging.getLogger(__name__)


class Clock(Protocol):
    """Wall-clock seconds (deadlines are stored as absolute times, so they survive restarts)."""

    def now(self) -> float: ...


class SystemClock:
    """``time.time()``."""

    def now(self) -> float:
        return time.time()


class FakeClock:
    """A clock that moves only when told to; ``advance`` wakes whoever subscribed.

    For tests: deadlines pass deterministically, without sleeping.
    """

    def __init__(self, start: float = 1_000_000.0) -> None:
        self._now = float(start)
        self._lock = threading.Lock()
        self._listeners: list[Callable[[], None]] = []

    def now(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> float:
        """Move forward by ``seconds`` (>= 0), notify subscribers, return the new time."""
        if seconds < 0:
            raise ValueError(f"a clock does not go back: advance({seconds})")
        with self._lock:
            self._now += seconds
            now = self._now
            listeners = list(self._listeners)
        for listener in listeners:
            listener()
        return now

    def subscribe(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` after every ``advance``."""
        with self._lock:
            self._listeners.append(listener)

    def unsubscribe(self, listener: Callable[[], None]) -> None:
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)


def expiry_verdict(received: int, expected: int, quorum: int) -> str | None:
    """What a passed deadline means: None to aggregate what is there, else the failure reason.

    A round aggregates when at least ``quorum`` peers (and at least one) submitted; otherwise
    it fails with ``"timeout: 3 of 8 peers (quorum 5)"``.
    """
    if received >= max(quorum, 1):
        return None
    return f"timeout: {received} of {expected} peers (quorum {quorum})"


def due_rounds(rounds: Iterable[RoundInfo], now: float) -> list[RoundInfo]:
    """Rounds still collecting (Pending or Collecting) whose deadline is at or before ``now``."""
    return [
        info
        for info in rounds
        if info.deadline is not None
        and info.deadline <= now
        and not info.status.is_terminal
        and not isinstance(info.status, Aggregating)
    ]


def next_deadline(rounds: Iterable[RoundInfo]) -> float | None:
    """The earliest deadline among rounds still collecting, or None."""
    pending = [
        info.deadline
        for info in rounds
        if info.deadline is not None
        and not info.status.is_terminal
        and not isinstance(info.status, Aggregating)
    ]
    return min(pending, default=None)


class DeadlineTimer:
    """A daemon thread that calls ``fire()`` whenever the earliest deadline may have passed.

    It sleeps until ``next_deadline()`` (re-read each time) or at most ``max_wait`` real
    seconds, and ``poke()`` wakes it early (new round, clock advanced). ``fire`` is called from
    the timer thread only, never concurrently with itself; if it raises, the error is logged
    and the timer waits ``max_wait`` before trying again. ``stop`` joins the thread.
    """

    def __init__(
        self,
        clock: Clock,
        next_deadline: Callable[[], float | None],
        fire: Callable[[], object],
        *,
        max_wait: float = 1.0,
        name: str = "tensorswap-deadlines",
    ) -> None:
        self._clock = clock
        self._next = next_deadline
        self._fire = fire
        self._max_wait = max_wait
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def poke(self) -> None:
        """Re-read the next deadline now."""
        self._wake.set()

    def stop(self) -> None:
        """Stop the thread and wait for it; idempotent."""
        self._stopped.set()
        self._wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while not self._stopped.is_set():
            self._wake.clear()
            wait = self._max_wait
            try:
                upcoming = self._next()
                if upcoming is not None and upcoming <= self._clock.now():
                    self._fire()
                    upcoming = self._next()
                if upcoming is not None:
                    # Still due after fire() means no progress was possible: wait, do not spin.
                    wait = min(wait, max(upcoming - self._clock.now(), 0.0)) or self._max_wait
            except Exception:
                log.exception("deadline handling failed; retrying in %.1f s", self._max_wait)
            self._wake.wait(max(wait, 0.0))
