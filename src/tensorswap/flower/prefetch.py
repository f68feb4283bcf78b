"""RoundPrefetch: a coordinator round's aggregate awaited and fetched in the background, so that
``BlockStrategy.aggregate_train`` finds it in the local store (``BlockLink.prefetch_round``)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import TYPE_CHECKING

from tensorswap.cid import Cid

if TYPE_CHECKING:
    from tensorswap.rounds.core import RoundId

__all__ = ["RoundPrefetch"]

CANCEL_WAIT = 10.0
"""Seconds ``cancel`` waits for the prefetch's task to end (its connection closed)."""


class RoundPrefetch:
    """One round's aggregate being awaited (on a connection of its own, so the link's other
    calls do not queue behind the wait) and then fetched into the link's store (through the
    link's own connection, one call at a time with the others, every block CID-checked).

    Made by ``BlockLink.prefetch_round``; its task runs on the link's event loop. ``take``
    waits for it and gives the aggregate's CID (its blocks then in the store), or None when
    it failed, was cancelled or is not done in time (``error`` says why): the caller then
    awaits and fetches the round as it would without a prefetch. ``cancel`` ends it and
    waits until its connection is closed. Nothing it does changes what the round's aggregate
    is; a fetch it leaves half done leaves CID-checked blocks no root lists, which the
    link's store collects like any other.
    """

    def __init__(self, round_id: RoundId, loop: asyncio.AbstractEventLoop) -> None:
        self.round_id = round_id
        self.error: str | None = None
        """Why it gave no aggregate (None while running or after it did)."""
        self.taken = False
        """Whether ``take`` handed its aggregate to a caller."""
        self._loop = loop
        self._task: asyncio.Task[Cid] | None = None
        self._cid: Cid | None = None
        self._finished = threading.Event()

    def started(self, task: asyncio.Task[Cid]) -> None:
        """Called on the loop with the task doing the work."""
        self._task = task
        task.add_done_callback(self._settle)

    def done(self) -> bool:
        """Whether its task has ended (the aggregate in the store, failed or cancelled)."""
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` s for its task to end; whether it has."""
        return self._finished.wait(timeout)

    def take(self, timeout: float | None = None) -> Cid | None:
        """The aggregate's CID once its blocks are in the link's store; None (``error``
        says why; the prefetch cancelled) when it failed or did not end in ``timeout`` s."""
        if not self._finished.wait(timeout):
            self.cancel()
            self.error = self.error or f"not done in {timeout} s"
            return None
        if self._cid is not None:
            self.taken = True
        return self._cid

    def cancel(self) -> None:
        """End it (a no-op once ended) and wait, ``CANCEL_WAIT`` s at most, until it has."""
        if self._finished.is_set():
            return
        try:
            self._loop.call_soon_threadsafe(self._cancel_on_loop)
        except RuntimeError:  # the loop is closed: nothing of it runs any more
            return
        self._finished.wait(CANCEL_WAIT)

    def _cancel_on_loop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def _settle(self, task: asyncio.Task[Cid]) -> None:
        if task.cancelled():
            self.error = "cancelled"
        elif (exc := task.exception()) is not None:
            self.error = f"{type(exc).__name__}: {exc}"
        else:
            with contextlib.suppress(Exception):
                self._cid = task.result()
        self._finished.set()
