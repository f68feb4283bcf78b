"""Receive buffers recycled across frames: fresh pages cost more than the copy into them."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import sys
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Callable

import numpy as np

__all__ = ["HeapTrimmer", "ReceiveBuffers", "receive_buffers", "release_free_memory"]

_GRANULE = 1 << 20  # slab sizes are rounded up to this, so blocks of similar size share slabs


IDLE_SECONDS = 10.0
"""How long a recycled slab may sit unused before it goes back to the OS."""


class ReceiveBuffers:
    """Hands out writable buffers for frame payloads and takes them back when unused.

    A payload of ``min_bytes`` or more gets a view of a recycled slab (or a new one); when
    the last reference to that view (or anything built on it: slices, read-only views, a
    store that adopted the block) goes away, the slab returns here, up to ``keep_bytes``
    held idle; beyond that it is freed. A slab idle for ``idle_seconds`` is freed too
    (``expire``, run by a timer thread while slabs are idle; then the C heap is trimmed), so
    memory goes back to the OS only once a process has stopped receiving for a while, not
    after each burst. Reusing slabs saves the page faults of fresh memory, which on small
    VMs cost more than receiving the bytes, and far more on a VM that hands the memory its
    guest frees back to the host (free page reporting): touched again, each page is faulted
    in twice, by the guest and by the host. ``keep_bytes`` defaults to 64 MiB (what four
    connections hold with their blocks queued to be stored); a ``BlockServer`` raises it to
    its ``max_inflight_bytes`` (``allow``): idle slabs are then never more than the bytes its
    connections may hold at once, which its budget already allows. Thread-safe.
    """

    def __init__(
        self,
        keep_bytes: int = 64 << 20,
        min_bytes: int = 256 << 10,
        *,
        idle_seconds: float | None = IDLE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.keep_bytes = keep_bytes
        self.min_bytes = min_bytes
        self.idle_seconds = idle_seconds
        """Seconds a slab may stay idle before ``expire`` frees it (None: never)."""
        self.clock = clock
        self._idle: defaultdict[int, list[tuple[np.ndarray, float]]] = defaultdict(list)
        self._idle_bytes = 0
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self.reused = 0
        self.allocated = 0
        self.expired = 0
        """Idle slabs freed by ``expire`` so far."""

    def allow(self, keep_bytes: int) -> None:
        """Keep up to ``keep_bytes`` idle (never lowers the bound: the largest ask holds)."""
        with self._lock:
            self.keep_bytes = max(self.keep_bytes, keep_bytes)

    def take(self, nbytes: int) -> memoryview:
        """A writable, uninitialised, flat byte buffer of exactly ``nbytes``.

        The caller must have bounded ``nbytes`` (it is allocated as asked).
        """
        if nbytes < self.min_bytes:
            return memoryview(np.empty(nbytes, np.uint8))  # type: ignore[arg-type]
        size = -(-nbytes // _GRANULE) * _GRANULE
        with self._lock:
            idle = self._idle.get(size)
            slab = idle.pop()[0] if idle else None
            if slab is not None:
                self._idle_bytes -= size
                self.reused += 1
            else:
                self.allocated += 1
        if slab is None:
            slab = np.empty(size, np.uint8)
        view = slab[:nbytes]
        weakref.finalize(view, self._give_back, slab)
        return memoryview(view)  # type: ignore[arg-type]

    def _give_back(self, slab: np.ndarray) -> None:
        with self._lock:
            if self._idle_bytes + slab.nbytes > self.keep_bytes:
                return
            self._idle[slab.nbytes].append((slab, self.clock()))
            self._idle_bytes += slab.nbytes
            if self._timer is None and self.idle_seconds is not None:
                self._arm(self.idle_seconds)

    def _arm(self, seconds: float) -> None:
        """Run ``expire`` in ``seconds`` on a daemon thread (lock held)."""
        timer = threading.Timer(seconds, self._expire_and_rearm)
        timer.daemon = True
        self._timer = timer
        timer.start()

    def _expire_and_rearm(self) -> None:
        if self.expire():
            release_free_memory()
        with self._lock:
            self._timer = None
            if self._idle_bytes and self.idle_seconds is not None:
                oldest = min(since for slabs in self._idle.values() for _, since in slabs)
                self._arm(max(0.0, oldest + self.idle_seconds - self.clock()))

    def expire(self) -> int:
        """Free the slabs idle for ``idle_seconds`` or longer (by ``clock``); their bytes."""
        if self.idle_seconds is None:
            return 0
        cutoff = self.clock() - self.idle_seconds
        freed = 0
        with self._lock:
            for size, slabs in self._idle.items():
                keep = [(slab, since) for slab, since in slabs if since > cutoff]
                freed += size * (len(slabs) - len(keep))
                self.expired += len(slabs) - len(keep)
                slabs[:] = keep
            self._idle_bytes -= freed
        return freed

    @property
    def idle_bytes(self) -> int:
        """Bytes held idle for reuse."""
        return self._idle_bytes

    def clear(self) -> None:
        """Free every idle slab (and stop the timer)."""
        with self._lock:
            self._idle.clear()
            self._idle_bytes = 0
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None


_SHARED = ReceiveBuffers()


def receive_buffers() -> ReceiveBuffers:
    """The process-wide pool the wire receives block payloads into."""
    return _SHARED


def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim: Callable[[int], int] = libc.malloc_trim  # glibc only (not musl)
    except (OSError, AttributeError):
        return None
    return trim


_TRIM = _malloc_trim()


def release_free_memory() -> bool:
    """Hand the C heap's free pages back to the OS (glibc ``malloc_trim``); True if it did.

    Large buffers are mapped and unmapped on their own, but a burst of blocks under glibc's
    mmap threshold (which grows to 32 MiB as large buffers are freed) stays in the heap once
    freed, counted in the process's resident memory; this returns it. It walks the heap
    (milliseconds for a large one): call it off the event loop, after a burst, not per block.
    """
    if _TRIM is None:
        return False
    return bool(_TRIM(0))


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
