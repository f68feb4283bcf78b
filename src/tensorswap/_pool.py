"""Large buffers recycled within a process: fresh pages cost more than the bytes put in them.

The wire receives block payloads into these slabs, and ``tensorswap._alloc`` hands out large
arrays from the same pool (an aggregate's sums, a loaded tensor), so memory one stage gives
back is the next stage's, already faulted in."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Callable

import numpy as np

__all__ = ["IDLE_SECONDS", "ReceiveBuffers", "receive_buffers", "release_free_memory"]

_GRANULE = 1 << 20  # slab sizes are rounded up to this, so blocks of similar size share slabs


IDLE_SECONDS = 10.0
"""How long a recycled slab may sit unused before it goes back to the OS."""


_ALIGN = 4096  # every slab starts on a page: direct I/O (store._direct) and cache lines


def _physical_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


WORKING_SET_CAP = _physical_bytes() // 4
"""The most a pool keeps idle because its working set was that large (``keep_bytes`` aside)."""


class ReceiveBuffers:
    """Hands out writable buffers (frame payloads, large arrays) and takes them back unused.

    A buffer of ``min_bytes`` or more is a view of a recycled slab (or a new one); when
    the last reference to that view (or anything built on it: slices, read-only views, a
    store that adopted the block, an array over it) goes away, the slab returns here. Idle
    slabs are kept up to the larger of ``keep_bytes`` and the working set (the most bytes
    handed out at once since the pool was last idle for ``idle_seconds``, at most
    ``WORKING_SET_CAP``): a process that moves a round's worth of blocks, sums and results
    every few seconds keeps that much, and no more; a slab beyond it is freed. A slab idle
    for ``idle_seconds`` is freed too (``expire``, run by a timer thread while slabs are
    idle; then the C heap is trimmed), so memory goes back to the OS only once a process has
    stopped for a while, not after each burst. Reusing slabs saves the page faults of fresh
    memory, which on small VMs cost more than receiving the bytes, and far more on a VM that
    hands the memory its guest frees back to the host (free page reporting): touched again,
    each page is faulted in twice, by the guest and by the host. Because idle slabs are
    bounded by the working set, keeping them raises no peak: they were all in use at once.
    ``keep_bytes`` (64 MiB by default, raised by ``allow``) is kept even after a smaller
    burst. Thread-safe.
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
        self._in_use = 0  # bytes of slabs handed out and not yet back
        self._peak = 0  # the most in use at once since the pool last emptied by expiry
        # reentrant: a garbage collection run while the lock is held (an allocation inside) may
        # finalize a view, whose slab then comes back through _give_back on this very thread
        self._lock = threading.RLock()
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
            self._in_use += size
            self._peak = max(self._peak, self._in_use)
        if slab is None:
            slab = np.empty(size + _ALIGN, np.uint8)
        start = -slab.ctypes.data % _ALIGN
        view = slab[start : start + nbytes]
        weakref.finalize(view, self._give_back, slab)
        return memoryview(view)  # type: ignore[arg-type]

    def _give_back(self, slab: np.ndarray) -> None:
        size = slab.nbytes - _ALIGN
        with self._lock:
            self._in_use -= size
            limit = max(self.keep_bytes, min(self._peak, WORKING_SET_CAP))
            if self._idle_bytes + size > limit:
                return
            self._idle[size].append((slab, self.clock()))
            self._idle_bytes += size
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
            if not self._idle_bytes:
                self._peak = self._in_use  # a burst's working set is forgotten once idle
        return freed

    @property
    def idle_bytes(self) -> int:
        """Bytes held idle for reuse."""
        return self._idle_bytes

    @property
    def in_use_bytes(self) -> int:
        """Bytes of slabs handed out and not yet given back."""
        return self._in_use

    @property
    def working_set_bytes(self) -> int:
        """The most bytes in use at once since the pool was last idle (what it may keep)."""
        return self._peak

    def clear(self) -> None:
        """Free every idle slab (and stop the timer)."""
        with self._lock:
            self._idle.clear()
            self._idle_bytes = 0
            self._peak = self._in_use
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
