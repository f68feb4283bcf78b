"""tensorswap._alloc: large arrays from the process's slab pool behave as numpy arrays."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from tensorswap._alloc import POOL_MIN_BYTES, empty
from tensorswap._pool import receive_buffers


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int8, np.uint8, np.int64])
@pytest.mark.parametrize("nbytes", [0, 8, POOL_MIN_BYTES - 8, POOL_MIN_BYTES, 3 * POOL_MIN_BYTES])
def test_empty_is_a_writable_contiguous_array(dtype: type, nbytes: int) -> None:
    size = nbytes // np.dtype(dtype).itemsize
    out = empty(size, dtype)
    assert out.shape == (size,)
    assert out.dtype == np.dtype(dtype)
    assert out.flags.writeable and out.flags.c_contiguous
    out[:] = np.arange(size, dtype=dtype)
    assert np.array_equal(out, np.arange(size, dtype=dtype))


def test_large_arrays_come_from_the_pool_and_are_aligned() -> None:
    pool = receive_buffers()
    before = pool.in_use_bytes
    out = empty(POOL_MIN_BYTES // 4, np.float32)
    assert pool.in_use_bytes == before + POOL_MIN_BYTES
    assert out.ctypes.data % 64 == 0
    small = empty(4, np.float32)
    assert pool.in_use_bytes == before + POOL_MIN_BYTES
    del out, small
    gc.collect()
    assert pool.in_use_bytes == before  # its slab is back (idle, or freed)


def test_arrays_do_not_share_memory() -> None:
    a = empty(POOL_MIN_BYTES, np.uint8)
    b = empty(POOL_MIN_BYTES, np.uint8)
    a[:] = 1
    b[:] = 2
    assert not np.shares_memory(a, b)
    assert int(a.sum()) == POOL_MIN_BYTES


def test_negative_size_is_refused() -> None:
    with pytest.raises(ValueError, match="must not be negative"):
        empty(-1, np.float32)


def _pooled(array: np.ndarray) -> bool:
    """Whether ``array`` is a view of a pool slab (a memoryview the pool handed out)."""
    base: object = array
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    return isinstance(base, memoryview)


@pytest.mark.parametrize("kind", ["fedavg", "mean", "median", "trimmed_mean"])
def test_large_aggregates_land_in_recycled_memory(kind: str) -> None:
    from tensorswap.aggregate import AggregatorKind, AggregatorSpec, aggregate

    size = POOL_MIN_BYTES // 4 * 2
    rows = [np.full(size, float(i), np.float32) for i in range(4)]
    trim = {"trim_fraction": 0.25} if kind == "trimmed_mean" else {}
    spec = AggregatorSpec(AggregatorKind(kind), **trim)
    result = aggregate([(row, 1) for row in rows], spec)
    assert isinstance(result.values, np.ndarray) and _pooled(result.values)
    assert result.values.flags.writeable
    np.testing.assert_allclose(result.values, 1.5)
    named = aggregate([({"a": row, "b": row[:10]}, 1) for row in rows], spec)
    assert isinstance(named.values, dict) and _pooled(named.values["a"])
