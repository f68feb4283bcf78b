"""Receive buffers recycled across frames (the pool lives in ``tensorswap._pool``, shared
with large arrays), and the heap trim that follows bursts once they stop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from tensorswap._pool import IDLE_SECONDS, ReceiveBuffers, receive_buffers, release_free_memory

__all__ = ["HeapTrimmer", "ReceiveBuffers", "receive_buffers", "release_free_memory"]


class HeapTrimmer:
    """``release_free_memory`` once bursts stop: call it with the bytes a burst moved, when it
    ends.

    Once ``after`` bytes have gone by since the last trim, a trim is scheduled on the running
    loop's default executor for when ``quiet`` seconds have passed since the latest burst
    ended (a burst ending meanwhile puts it off again), at most one per ``interval``
    seconds; ``busy()`` true when it is due (a new burst under way) puts it off until the
    next call. So a server that receives a round's uploads every few seconds keeps its
    freed memory for the next round instead of handing it to the OS and faulting it in
    again; one that stops receiving returns it ``quiet`` seconds later. A server hands it to
    its ``ByteBudget`` as ``on_idle``. Event loop only.
    """

    def __init__(
        self,
        busy: Callable[[], bool] = lambda: False,
        *,
        after: int = 64 << 20,
        interval: float = 1.0,
        quiet: float = IDLE_SECONDS,
    ) -> None:
        self.busy = busy
        self.after = after
        self.interval = interval
        self.quiet = quiet
        self.trims = 0
        """Trims started so far."""
        self._untrimmed = 0
        self._last = -interval
        self._ended = 0.0  # when the latest burst ended, by the loop's clock
        self._due = False

    def __call__(self, nbytes: int) -> None:
        self._untrimmed += nbytes
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # called outside a loop: nothing to schedule on
            return
        self._ended = loop.time()
        if self._untrimmed < self.after or self._due:
            return
        self._due = True
        loop.call_later(self._wait(loop.time()), self._trim)

    def _wait(self, now: float) -> float:
        return max(0.0, self._last + self.interval - now, self._ended + self.quiet - now)

    def _trim(self) -> None:
        if self.busy():
            self._due = False
            return
        loop = asyncio.get_running_loop()
        wait = self._wait(loop.time())
        if wait > 0:  # another burst ended since this trim was scheduled
            loop.call_later(wait, self._trim)
            return
        self._untrimmed = 0
        self._last = loop.time()
        self.trims += 1
        trimming = loop.run_in_executor(None, release_free_memory)
        trimming.add_done_callback(self._done)

    def _done(self, _: object) -> None:
        self._due = False
