"""Large uninitialised arrays from recycled memory.

On small VMs the kernel's first-touch cost of fresh pages (a fault and a zeroing per 4 KiB,
and on a VM with free page reporting a fault in the host too) is larger than the copy into
them: a fresh 64 MiB ``np.empty`` filled by a copy took 78-195 ms here against 11 ms for
recycled memory. Large arrays therefore come from the process's slab pool
(``tensorswap._pool``), the one the wire receives block payloads into: the sums of an
aggregate land in the slabs its uploads arrived in, a loaded tensor in the last round's.
Small arrays gain nothing and stay with numpy.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from tensorswap._pool import receive_buffers

__all__ = ["POOL_MIN_BYTES", "empty"]

POOL_MIN_BYTES = 1 << 20
"""Arrays at least this large come from the pool; smaller ones from ``np.empty``."""


def empty(size: int, dtype: npt.DTypeLike) -> np.ndarray:
    """A writable, uninitialised, 1-D, C-contiguous array of ``size`` items of ``dtype``.

    The caller must have bounded ``size``. A large array is a view of a pooled slab (64-byte
    aligned); it behaves as any numpy array and its slab goes back to the pool when the last
    reference to it (or to a view of it) goes.
    """
    kind = np.dtype(dtype)
    nbytes = size * kind.itemsize
    if size < 0:
        raise ValueError(f"size must not be negative, got {size}")
    if nbytes < POOL_MIN_BYTES:
        return np.empty(size, dtype=kind)
    return np.frombuffer(receive_buffers().take(nbytes), dtype=kind, count=size)
