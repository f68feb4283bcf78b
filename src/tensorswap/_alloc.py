"""Large uninitialised arrays from recycled memory.

On small VMs the kernel's first-touch cost of fresh pages (a fault and a zeroing per 4 KiB)
is larger than the copy into them: a fresh 256 MiB ``np.empty`` filled by a copy runs at a
third of the copy's speed. pyarrow's memory pool (mimalloc or jemalloc) keeps freed pages
mapped and hands them out again, so the output of a repeated load (a tensor per round, a
model per step) lands in memory that is already faulted in. Small arrays gain nothing and
stay with numpy.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pyarrow as pa

__all__ = ["POOL_MIN_BYTES", "empty"]

POOL_MIN_BYTES = 1 << 20
"""Arrays at least this large come from pyarrow's pool; smaller ones from ``np.empty``."""


def empty(size: int, dtype: npt.DTypeLike) -> np.ndarray:
    """A writable, uninitialised, 1-D, C-contiguous array of ``size`` items of ``dtype``.

    The caller must have bounded ``size``. The array owns a pyarrow buffer (64-byte aligned)
    when it is large; it behaves as any numpy array and its memory goes back to the pool when
    the last reference to it (or to a view of it) goes.
    """
    kind = np.dtype(dtype)
    nbytes = size * kind.itemsize
    if size < 0:
        raise ValueError(f"size must not be negative, got {size}")
    if nbytes < POOL_MIN_BYTES:
        return np.empty(size, dtype=kind)
    return np.frombuffer(pa.allocate_buffer(nbytes), dtype=kind, count=size)
