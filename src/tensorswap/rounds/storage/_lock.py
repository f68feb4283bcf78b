"""A re-entrant shared/exclusive lock: submits and aggregations share it, a collection excludes."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["SharedLock"]


class SharedLock:
    """Many holders in shared mode (submits) or one in exclusive mode (a collection).

    A waiting exclusive holder keeps new shared holders out, so a collection is never starved;
    a thread that already holds it shared may take it shared again at once (a status
    listener that submits from inside a submit or an aggregation), and may not take it
    exclusive (that would wait for itself).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False
        self._waiting = 0
        self._held: dict[int, int] = {}  # thread id -> how many times it holds it shared

    # ── observability (tests of what runs while a collection waits or holds it) ──────
    @property
    def exclusive_held(self) -> bool:
        """Whether a holder (a collection) has the lock exclusive now."""
        with self._cond:
            return self._exclusive

    @property
    def waiting(self) -> int:
        """How many threads wait to take the lock exclusive now."""
        with self._cond:
            return self._waiting

    def wait_for_waiter(self, timeout: float | None = None) -> bool:
        """Block until a thread waits to take the lock exclusive; False after ``timeout``.
        Lets a test act at that moment (a submit while a collection waits) without sleeping."""
        with self._cond:
            return self._cond.wait_for(lambda: self._waiting > 0, timeout=timeout)

    @contextmanager
    def shared(self) -> Iterator[None]:
        me = threading.get_ident()
        with self._cond:
            if not self._held.get(me):
                self._cond.wait_for(lambda: not self._exclusive and not self._waiting)
            self._held[me] = self._held.get(me, 0) + 1
            self._shared += 1
        try:
            yield
        finally:
            with self._cond:
                self._shared -= 1
                self._held[me] -= 1
                if not self._held[me]:
                    del self._held[me]
                self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            if self._held.get(threading.get_ident()):
                raise RuntimeError(
                    "collect_garbage called from inside a submit or an aggregation "
                    "(a status listener?): it would wait for itself"
                )
            self._waiting += 1
            self._cond.notify_all()  # the state changed: whoever watches it re-checks
            try:
                self._cond.wait_for(lambda: not self._exclusive and not self._shared)
            finally:
                self._waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()
