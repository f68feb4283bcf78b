"""Receive buffers recycled across frames: fresh pages cost more than the copy into them."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import sys
import threading
import weakref
from collections import defaultdict
from collections.abc import Callable

import numpy as np

__all__ = ["HeapTrimmer", "ReceiveBuffers", "receive_buffers", "release_free_memory"]

_GRANULE = 1 << 20  # slab sizes are rounded up to this, so blocks of similar size share slabs


class ReceiveBuffers:
    """Hands out writable buffers for frame payloads and takes them back when unused.

    A payload of ``min_bytes`` or more gets a view of a recycled slab (or a new one); when
    the last reference to that view (or anything built on it: slices, read-only views, a
    store that adopted the block) goes away, the slab returns here, up to ``keep_bytes``
    held idle; beyond that it is freed. Reusing slabs saves the page faults of fresh memory,
    which on small VMs cost more than receiving the bytes. The default keeps 16 MiB (four
    default-size blocks): enough for a server that writes blocks out and receives the next
    ones into the same memory, little enough not to raise a process's peak much. Thread-safe.
    """

    def __init__(self, keep_bytes: int = 16 << 20, min_bytes: int = 256 << 10) -> None:
        self.keep_bytes = keep_bytes
        self.min_bytes = min_bytes
        self._idle: defaultdict[int, list[np.ndarray]] = defaultdict(list)
        self._idle_bytes = 0
        self._lock = threading.Lock()
        self.reused = 0
        self.allocated = 0

    def take(self, nbytes: int) -> memoryview:
        """A writable, uninitialised, flat byte buffer of exactly ``nbytes``.

        The caller must have bounded ``nbytes`` (it is allocated as asked).
        """
        if nbytes < self.min_bytes:
            return memoryview(np.empty(nbytes, np.uint8))  # type: ignore[arg-type]
        size = -(-nbytes // _GRANULE) * _GRANULE
        with self._lock:
            idle = self._idle.get(size)
            slab = idle.pop() if idle else None
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
            if self._idle_bytes + slab.nbytes <= self.keep_bytes:
                self._idle[slab.nbytes].append(slab)
                self._idle_bytes += slab.nbytes

    @property
    def idle_bytes(self) -> int:
        """Bytes held idle for reuse."""
        return self._idle_bytes

    def clear(self) -> None:
        """Free every idle slab."""
        with self._lock:
            self._idle.clear()
            self._idle_bytes = 0


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
    """``release_free_memory`` after bursts: call it with the bytes a burst moved, when it ends.

    Once ``after`` bytes have gone by since the last trim, the next call schedules one on the
    running loop's default executor, at most one per ``interval`` seconds; ``busy()`` true
    when it is due (a new burst began) puts it off until the next call. A server hands it to
    its ``ByteBudget`` as ``on_idle``. Event loop only.
    """

    def __init__(
        self,
        busy: Callable[[], bool] = lambda: False,
        *,
        after: int = 64 << 20,
        interval: float = 1.0,
    ) -> None:
        self.busy = busy
        self.after = after
        self.interval = interval
        self.trims = 0
        """Trims started so far."""
        self._untrimmed = 0
        self._last = -interval
        self._due = False

    def __call__(self, nbytes: int) -> None:
        self._untrimmed += nbytes
        if self._untrimmed < self.after or self._due:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # called outside a loop: nothing to schedule on
            return
        self._due = True
        loop.call_later(max(0.0, self._last + self.interval - loop.time()), self._trim)

    def _trim(self) -> None:
        if self.busy():
            self._due = False
            return
        loop = asyncio.get_running_loop()
        self._untrimmed = 0
        self._last = loop.time()
        self.trims += 1
        trimming = loop.run_in_executor(None, release_free_memory)
        trimming.add_done_callback(self._done)

    def _done(self, _: object) -> None:
        self._due = False
