"""Column-blocked numpy kernels over a Batch's parts: weighted sums, squared norms, NaN counts."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar, cast

import numpy as np

from tensorswap import _alloc
from tensorswap.aggregate.types import Layout, Values
from tensorswap.aggregate.validate import Batch, Part

F = TypeVar("F", bound=Callable[..., Any])


def quiet(fn: F) -> F:
    """Run fn with numpy's overflow/invalid warnings off: non-finite values are handled
    explicitly (by the non-finite policy or AggregateOverflow), not reported as warnings."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            return fn(*args, **kwargs)

    return cast(F, wrapper)


#: A (k, chunk) block of about this many bytes stays in the L2 cache while it is worked on.
CHUNK_BYTES = 1 << 20
#: Values per column chunk of the in-place weighted-sum loop (output and scratch stay in L2).
ROW_CHUNK = 1 << 15
_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)


def part_width(part: Part) -> int:
    """Number of values per row."""
    return int(part.shape[1]) if isinstance(part, np.ndarray) else int(part[0].size)


def chunk_len(k: int, itemsize: int) -> int:
    """Columns per block so that a (k, columns) block is about CHUNK_BYTES."""
    return max(4096, CHUNK_BYTES // max(1, k * itemsize))


def blocks(
    part: Part, acc: np.dtype, *, copy: bool = False
) -> Iterator[tuple[int, int, np.ndarray]]:
    """Yield (start, stop, block) covering the columns of `part` left to right.

    `block` is a (k, stop - start) array in dtype `acc`: a view of `part` when it is already a
    matrix of that dtype and `copy` is false, else one scratch buffer that is refilled for the
    next block (so a caller must finish with a block, and may modify it only when copy=True).
    """
    k = part.shape[0] if isinstance(part, np.ndarray) else len(part)
    m = part_width(part)
    step = chunk_len(k, acc.itemsize)
    if isinstance(part, np.ndarray) and part.dtype == acc and not copy:
        for start in range(0, m, step):
            stop = min(start + step, m)
            yield start, stop, part[:, start:stop]
        return
    scratch = np.empty((k, min(step, m)), dtype=acc)
    for start in range(0, m, step):
        stop = min(start + step, m)
        block = scratch[:, : stop - start]
        if isinstance(part, np.ndarray):
            block[...] = part[:, start:stop]
        else:
            for i, row in enumerate(part):
                block[i] = row[start:stop]
        yield start, stop, block


def weighted_sum(part: Part, weights: np.ndarray, out: np.ndarray) -> None:
    """out[:] = weights @ part, accumulated in out.dtype (weights must have that dtype).

    A matrix already in out.dtype with contiguous rows is one BLAS matrix-vector product
    (the fastest kernel measured, with or without BLAS threads). Separate rows, or rows that
    need a cast, go through an in-place loop over cache-sized column chunks: each input value
    is read once, and no temporary larger than a chunk is made. That loop beat BLAS products
    on gathered blocks when the BLAS kernel is a generic one (OPENBLAS_CORETYPE), and tied
    otherwise, so it is the robust choice there.
    """
    acc = out.dtype
    if isinstance(part, np.ndarray) and part.dtype == acc and part.strides[1] == acc.itemsize:
        np.dot(weights, part, out=out)
        return
    rows = [part[i] for i in range(part.shape[0])] if isinstance(part, np.ndarray) else part
    width = out.size
    scratch = np.empty(min(ROW_CHUNK, width), dtype=acc)
    for start in range(0, width, ROW_CHUNK):
        stop = min(start + ROW_CHUNK, width)
        into, tmp = out[start:stop], scratch[: stop - start]
        np.multiply(rows[0][start:stop], weights[0], out=into)
        for row, weight in zip(rows[1:], weights[1:], strict=True):
            np.multiply(row[start:stop], weight, out=tmp)
            np.add(into, tmp, out=into)


def sumsq(row: np.ndarray, exact: bool = False) -> float:
    """Sum of squares of a 1-D row; inf/nan if non-finite.

    Default: BLAS in the row's dtype (float32 for narrow types), the cheapest proof that a row
    is finite, but a float32 dot drifts (~1e-4 relative over 1M values). exact=True
    accumulates in float64 (einsum casts in cache-sized buffers): for a norm that clipping
    relies on. Squares of float32 / float16 / bfloat16 values never overflow float64, so the
    exact sum is finite exactly when the values are.
    """
    if row.dtype == _F64 or (row.dtype == _F32 and not exact):
        return float(np.dot(row, row))
    if row.dtype == _F32:
        return float(np.einsum("i,i->", row, row, dtype=_F64))
    acc = _F64 if exact else _F32
    total = 0.0
    step = chunk_len(1, 4)
    for start in range(0, row.size, step):
        chunk = row[start : start + step].astype(acc)
        total += float(np.dot(chunk, chunk))
    return total


def sumsq_scaled(rows: Sequence[np.ndarray]) -> float:
    """L2 norm of the concatenated rows, computed in float64 with scaling (no overflow)."""
    step = chunk_len(1, 8)
    peak = 0.0
    for row in rows:
        for start in range(0, row.size, step):
            peak = max(peak, float(np.max(np.abs(row[start : start + step]))))
    if peak == 0.0:
        return 0.0
    total = 0.0
    for row in rows:
        for start in range(0, row.size, step):
            chunk = row[start : start + step].astype(_F64) / peak
            total += float(np.dot(chunk, chunk))
    return peak * math.sqrt(total)


def count_nonfinite(row: np.ndarray) -> int:
    """Number of NaN or infinite values in a 1-D row."""
    step = chunk_len(1, row.dtype.itemsize)
    bad = 0
    for start in range(0, row.size, step):
        bad += int(np.count_nonzero(~np.isfinite(row[start : start + step])))
    return bad


def build_values(layout: Layout, outs: Sequence[np.ndarray]) -> Values:
    """Flat per-tensor results shaped back into the layout's structure."""
    shaped = [out.reshape(shape) for out, shape in zip(outs, layout.shapes, strict=True)]
    if layout.keys is None:
        return shaped[0]
    return dict(zip(layout.keys, shaped, strict=True))


def weighted_values(batch: Batch, weights: np.ndarray) -> Values:
    """Σ_i weights[i] * row i, per tensor, in each tensor's accumulation dtype.

    `weights` (float64, length batch.k) is cast once to the accumulation dtype, so float32
    accumulation multiplies by float32 weights and nothing is promoted to float64. Results
    come from recycled memory (``tensorswap._alloc``): an aggregate per round then lands in
    pages already faulted in, not in fresh ones the kernel must zero first.
    """
    if batch.flat is not None and len(set(batch.acc)) == 1:
        acc = batch.acc[0]
        out = _alloc.empty(batch.layout.size, acc)
        weighted_sum(batch.flat, weights.astype(acc), out)
        pieces = [
            out[o : o + n] for o, n in zip(batch.layout.offsets, batch.layout.sizes, strict=True)
        ]
        return build_values(batch.layout, pieces)
    outs = []
    for part, acc, size in zip(batch.parts, batch.acc, batch.layout.sizes, strict=True):
        out = _alloc.empty(size, acc)
        weighted_sum(part, weights.astype(acc), out)
        outs.append(out)
    return build_values(batch.layout, outs)


def all_finite(values: Values) -> bool:
    """True when no array in `values` holds NaN or infinity.

    A finite sum of squares (one BLAS dot) proves a row finite; only when it is not (a
    non-finite value, or squares that overflow) are the values tested one by one.
    """
    arrays = values.values() if isinstance(values, dict) else (values,)
    for a in arrays:
        flat = a.reshape(-1)
        if not math.isfinite(sumsq(flat)) and not bool(np.isfinite(flat).all()):
            return False
    return True
