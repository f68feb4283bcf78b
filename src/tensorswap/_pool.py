"""Large buffers recycled within a process: fresh pages cost more than the bytes put in them.

The wire receives block payloads into these slabs, and ``tensorswap._alloc`` hands out large
arrays from the same pool (an aggregate's sums, a loaded tensor), so memory one stage gives
back is the next stage's, already faulted in."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import sys
import threading
import time
import weakref
from collections import defaultdict, deque
from collections.abc import Callable, Iterator

import numpy as np

__all__ = ["IDLE_SECONDS", "ReceiveBuffers", "receive_buffers", "release_free_memory"]

_GRANULE = 64 << 10  # slab sizes are rounded up to this, so blocks of one size share slabs


IDLE_SECONDS = 10.0
"""How long a recycled slab may sit unused before it goes back to the OS."""


_ALIGN = 4096  # every slab starts on a page: direct I/O (store._direct) and cache lines


def _memory_bytes() -> int:
    """The machine's memory, or the cgroup's limit when it is lower (a container)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8 << 30
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                limit = f.read().strip()
        except OSError:
            continue
        if limit.isdigit():
            total = min(total, int(limit))
    return total


WORKING_SET_CAP = _memory_bytes() // 4
"""The most a pool keeps because its working set was that large (``keep_bytes`` aside)."""


class ReceiveBuffers:
    """Hands out writable buffers (frame payloads, large arrays) and takes them back unused.

    A buffer of ``min_bytes`` or more is a view of a recycled slab (or a new one); when
    the last reference to that view (or anything built on it: slices, read-only views, a
    store that adopted the block, an array over it) goes away, the slab returns here. Idle
    slabs are kept up to the larger of ``keep_bytes`` and the working set (the most bytes
    handed out at once since the pool was last idle, at most ``WORKING_SET_CAP``, a quarter
    of the machine's or the container's memory); a slab given back beyond that is freed. A
    process that moves a round's worth of blocks, sums and results every few seconds keeps
    that much. Slabs serve only requests of their own size class (64 KiB steps), so while a
    process's mix of sizes changes, idle slabs of one size and slabs in use of another can
    together reach twice the working set, for ``idle_seconds`` at most. (Freeing idle slabs
    to stay within one working set was tried: on the loopback round it freed the slabs the
    next round's uploads then faulted in afresh, 1.43-1.51 -> 2.16 CPU-seconds a round, for
    no lower peak: 224 and 222 MiB.) A slab idle for
    ``idle_seconds`` is freed too (``expire``, run by a timer thread while slabs are idle;
    then the C heap is trimmed), so memory goes back to the OS only once a process has
    stopped for a while, not after each burst. Reusing slabs saves the page faults of fresh
    memory, which on small VMs cost more than receiving the bytes, and far more on a VM that
    hands the memory its guest frees back to the host (free page reporting): touched again,
    each page is faulted in twice, by the guest and by the host. Thread-safe; a slab may come
    back from any thread, also from a garbage collection that runs while the pool's own
    lock is held (it waits in a queue, settled as soon as the lock is free).
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
        # slabs given back, waiting for the lock (deque.append takes none: a collection
        # that frees a view while this thread holds the lock must not wait for it)
        self._returned: deque[np.ndarray] = deque()
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self.reused = 0
        self.allocated = 0
        self.expired = 0
        """Idle slabs freed by ``expire`` so far."""

    def allow(self, keep_bytes: int) -> None:
        """Keep up to ``keep_bytes`` (never lowers the bound: the largest ask holds)."""
        with self._locked():
            self.keep_bytes = max(self.keep_bytes, keep_bytes)

    def take(self, nbytes: int) -> memoryview:
        """A writable, uninitialised, flat byte buffer of exactly ``nbytes``.

        The caller must have bounded ``nbytes`` (it is allocated as asked).
        """
        if nbytes < self.min_bytes:
            return memoryview(np.empty(nbytes, np.uint8))  # type: ignore[arg-type]
        size = -(-nbytes // _GRANULE) * _GRANULE
        with self._locked():
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
        # not at exit: weakref runs pending finalizers then, while the views are still alive
        weakref.finalize(view, self._give_back, slab).atexit = False
        return memoryview(view)  # type: ignore[arg-type]

    def _limit(self) -> int:
        return max(self.keep_bytes, min(self._peak, WORKING_SET_CAP))

    def _give_back(self, slab: np.ndarray) -> None:
        self._returned.append(slab)
        if self._lock.acquire(blocking=False):  # else the holder settles it on release
            self._release()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self._lock.acquire()
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        """Settle the slabs given back, then release the lock; again if more came meanwhile."""
        while True:
            try:
                self._settle()
            finally:
                self._lock.release()
            if not self._returned or not self._lock.acquire(blocking=False):
                return

    def _settle(self) -> None:
        """Keep or free each slab given back (lock held)."""
        while self._returned:
            slab = self._returned.popleft()
            size = slab.nbytes - _ALIGN
            self._in_use -= size
            if self._idle_bytes + size > self._limit():
                continue  # freed with the last reference, here
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
        try:
            if self.expire():
                release_free_memory()
        finally:
            with self._locked():
                self._timer = None
                if self._idle_bytes and self.idle_seconds is not None:
                    oldest = min(t for slabs in self._idle.values() for _, t in slabs)
                    self._arm(max(0.0, oldest + self.idle_seconds - self.clock()))

    def expire(self) -> int:
        """Free the slabs idle for ``idle_seconds`` or longer (by ``clock``); their bytes."""
        if self.idle_seconds is None:
            return 0
        cutoff = self.clock() - self.idle_seconds
        freed = 0
        with self._locked():
            for size, slabs in list(self._idle.items()):
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
        with self._locked():
            return self._idle_bytes

    @property
    def in_use_bytes(self) -> int:
        """Bytes of slabs handed out and not yet given back."""
        with self._locked():
            return self._in_use

    @property
    def working_set_bytes(self) -> int:
        """The most bytes in use at once since the pool was last idle (what it may keep)."""
        with self._locked():
            return self._peak

    def clear(self) -> None:
        """Free every idle slab (and stop the timer)."""
        with self._locked():
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
