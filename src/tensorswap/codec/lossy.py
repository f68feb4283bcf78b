"""Tensor encodings: dense, and lossy f16 / bf16 casts, int8 quantization, top-k sparse.

Each encoding turns a flat tensor into named Arrow columns plus numeric parameters and back.
Documented error bounds (x an original value, y its decoded value; all casts round to nearest
even):

- dense: exact, bit for bit (NaN payloads included).
- f16:   |y - x| <= 2**-11 * |x|, or <= 2**-25 when |x| < 2**-14 (float16 subnormals).
         |x| > 65504 (the float16 maximum) is refused, never saturated.
- bf16:  |y - x| <= 2**-8 * |x|, or <= 2**-133 when |x| < 2**-126 (bfloat16 subnormals).
         Values that would round past the bfloat16 maximum are refused.
- int8:  per block, lo = min(x), hi = max(x), scale = (hi - lo) / 255 (both kept as float64);
         |y - x| <= scale / 2 + EPS[dtype] * max(|lo|, |hi|) + TINY[dtype], where the second and
         third terms cover float rounding (see INT8_EPS and INT8_TINY). A constant block decodes
         exactly. Refused when hi - lo overflows float64.
- topk:  the k = ceil(fraction * n) entries of largest magnitude are kept exactly; every dropped
         entry decodes to 0, so its error |x| is <= the smallest kept magnitude.

Lossy encodings accept float tensors only and refuse NaN/Inf (their bounds would be void);
a decoded tensor has the original dtype and shape.
"""

from __future__ import annotations

import math
import sys
from abc import ABC, abstractmethod
from collections.abc import Iterator
from enum import StrEnum
from typing import Any

import numpy as np
import pyarrow as pa

from tensorswap.codec.dtypes import DType
from tensorswap.errors import CodecError, MalformedBlock, UnsupportedDtype

F16_MAX = 65504.0
# Smallest magnitude that rounds to bfloat16 infinity: (2 - 2**-8) * 2**127.
BF16_OVERFLOW = float((2 - 2**-8) * 2.0**127)
BF16_MAX = float((2 - 2**-7) * 2.0**127)
# float16 tensors sent as bf16: |x| >= 65408 rounds to 65536, beyond the float16 maximum.
F16_VIA_BF16_MAX = 65408.0
# int8 bound terms per tensor dtype (see the module docstring; derivation in docs/codec.md).
INT8_EPS: dict[DType, float] = {
    DType.FLOAT32: 2.0**-19,
    DType.FLOAT16: 2.0**-10,
    DType.BFLOAT16: 2.0**-7,
    DType.FLOAT64: 2.0**-48,
}
INT8_TINY: dict[DType, float] = {
    DType.FLOAT32: 2.0**-149,
    DType.FLOAT16: 2.0**-24,
    DType.BFLOAT16: 2.0**-133,
    DType.FLOAT64: 2.0**-1014,
}
_CHUNK = 1 << 16  # elementwise work in cache-sized pieces: bounded temporaries, warm caches
_F32_TINY = float(np.finfo(np.float32).tiny)
_F32_MAX = float(np.finfo(np.float32).max)
_F64_TINY = float(np.finfo(np.float64).tiny)
_FLOAT_DTYPES = ["float32", "float16", "bfloat16", "float64"]
_MAX_FINITE: dict[DType, float] = {
    DType.FLOAT32: _F32_MAX,
    DType.FLOAT16: F16_MAX,
    DType.BFLOAT16: BF16_MAX,
    DType.FLOAT64: float(np.finfo(np.float64).max),
}


class Encoding(StrEnum):
    """How a tensor's values are laid out in its Arrow record batch."""

    DENSE = "dense"
    F16 = "f16"
    BF16 = "bf16"
    INT8 = "int8"
    TOPK = "topk"


class LossyValueError(CodecError, ValueError):
    """The values cannot be encoded within the encoding's documented bound."""


Columns = list[tuple[str, pa.Array]]
Params = dict[str, float | int]


def array_of(values: np.ndarray, arrow_type: pa.DataType) -> pa.Array:
    """A non-null Arrow array over `values`' memory (1-D, C-contiguous) without copying."""
    flat = np.ascontiguousarray(values).reshape(-1)
    raw = flat.view(np.uint8) if flat.size else np.empty(0, np.uint8)
    return pa.Array.from_buffers(arrow_type, flat.size, [None, pa.py_buffer(raw)])


def _torch() -> Any:
    """torch if the application already imported it (importing it here would cost seconds)."""
    return sys.modules.get("torch")


def cast(values: np.ndarray, target: np.dtype[Any]) -> np.ndarray:
    """`values` (1-D) cast to `target`, rounding to nearest even; no copy if already `target`.

    torch casts float32 <-> float16 several times faster than numpy, so it is used when already
    imported and the source is writable (torch refuses to wrap read-only memory silently).
    float64 sources are cast directly by numpy (no double rounding through float32).
    """
    if values.dtype == target:
        return values
    out = np.empty(values.shape, dtype=target)
    torch = _torch()
    halfs = (np.dtype(np.float16), np.dtype(np.float32))
    if (
        torch is not None
        and values.size > 4096
        and values.flags.writeable
        and values.dtype in halfs
        and target in halfs
    ):
        torch.from_numpy(out).copy_(torch.from_numpy(values))
        return out
    for start in range(0, values.size, _CHUNK):
        out[start : start + _CHUNK] = values[start : start + _CHUNK]
    return out


def _chunks(flat: np.ndarray, compute: type[np.floating[Any]]) -> Iterator[tuple[int, np.ndarray]]:
    """(start, piece as `compute` dtype) over `flat`; pieces are views or one reused buffer."""
    if flat.dtype == compute:
        for start in range(0, flat.size, _CHUNK):
            yield start, flat[start : start + _CHUNK]
        return
    tmp = np.empty(min(_CHUNK, flat.size), dtype=compute)
    for start in range(0, flat.size, _CHUNK):
        piece = flat[start : start + _CHUNK]
        np.copyto(tmp[: piece.size], piece, casting="unsafe")
        yield start, tmp[: piece.size]


def finite_range(flat: np.ndarray, dtype: DType, encoding: Encoding) -> tuple[float, float]:
    """(min, max) of a float tensor as Python floats; refuses other dtypes and NaN/Inf."""
    if not dtype.is_float:
        raise UnsupportedDtype(f"{dtype} with encoding {encoding}", _FLOAT_DTYPES)
    if not flat.size:
        return 0.0, 0.0
    if dtype in (DType.FLOAT32, DType.FLOAT64):
        lo, hi = float(flat.min()), float(flat.max())  # NaN propagates through min and max
    else:
        lo, hi = math.inf, -math.inf
        for _, piece in _chunks(flat, np.float32):
            lo, hi = min(lo, float(piece.min())), max(hi, float(piece.max()))
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise LossyValueError(f"encoding {encoding} refuses NaN or infinite values")
    return lo, hi


class TensorEncoding(ABC):
    """One way of laying a flat tensor into Arrow columns."""

    columns: tuple[tuple[str, pa.DataType | None], ...]  # None: the tensor's own storage type
    options: frozenset[str] = frozenset()

    @abstractmethod
    def encode(self, flat: np.ndarray, dtype: DType, **options: Any) -> tuple[Columns, Params]:
        """Columns and parameters for a flat, C-contiguous tensor of `dtype`."""

    def rows(self, params: Params, size: int) -> int:
        """Rows the record batch must have for a tensor of `size` values; MalformedBlock if bad."""
        return size

    @abstractmethod
    def decode(
        self, cols: dict[str, np.ndarray], params: Params, dtype: DType, size: int
    ) -> np.ndarray:
        """The flat tensor of `dtype` and `size` elements; raises MalformedBlock if inconsistent.

        Every column already holds exactly `rows(params, size)` values.
        """


class Dense(TensorEncoding):
    columns = (("values", None),)

    def encode(self, flat: np.ndarray, dtype: DType, **options: Any) -> tuple[Columns, Params]:
        return [("values", array_of(flat, dtype.arrow))], {}

    def decode(
        self, cols: dict[str, np.ndarray], params: Params, dtype: DType, size: int
    ) -> np.ndarray:
        return cols["values"].view(dtype.numpy)


class CastF16(TensorEncoding):
    columns = (("values", pa.float16()),)

    def encode(self, flat: np.ndarray, dtype: DType, **options: Any) -> tuple[Columns, Params]:
        lo, hi = finite_range(flat, dtype, Encoding.F16)
        if max(-lo, hi) > F16_MAX:
            raise LossyValueError(f"values beyond the float16 range (|x| > {F16_MAX:g})")
        if dtype is DType.BFLOAT16:
            flat = cast(flat, np.dtype(np.float32))  # exact; ml_dtypes has no direct bf16->f16
        return [("values", array_of(cast(flat, np.dtype(np.float16)), pa.float16()))], {}

    def decode(
        self, cols: dict[str, np.ndarray], params: Params, dtype: DType, size: int
    ) -> np.ndarray:
        half = cols["values"].view(np.float16)
        if dtype is DType.BFLOAT16:
            return cast(cast(half, np.dtype(np.float32)), dtype.numpy)  # bf16 > f16 range: exact
        return cast(half, dtype.numpy)


class CastBF16(TensorEncoding):
    columns = (("values", pa.uint16()),)

    def encode(self, flat: np.ndarray, dtype: DType, **options: Any) -> tuple[Columns, Params]:
        lo, hi = finite_range(flat, dtype, Encoding.BF16)
        if max(-lo, hi) >= BF16_OVERFLOW:
            raise LossyValueError(f"values beyond the bfloat16 range (|x| >= {BF16_OVERFLOW:g})")
        if dtype is DType.FLOAT16 and max(-lo, hi) >= F16_VIA_BF16_MAX:
            raise LossyValueError(
                f"float16 values with |x| >= {F16_VIA_BF16_MAX:g} round past the float16 maximum"
            )
        bf = cast(flat, DType.BFLOAT16.numpy)
        if max(-lo, hi) > BF16_MAX and bool(np.isinf(bf).any()):  # float64 double rounding
            raise LossyValueError("values round past the bfloat16 maximum")
        return [("values", array_of(bf.view(np.uint16), pa.uint16()))], {}

    def decode(
        self, cols: dict[str, np.ndarray], params: Params, dtype: DType, size: int
    ) -> np.ndarray:
        bf = cols["values"].view(DType.BFLOAT16.numpy)
        if dtype is DType.FLOAT16:
            # bf16 values can exceed the float16 range only if the block was not made by us.
            wide = cast(bf, np.dtype(np.float32))
            if wide.size and float(np.abs(wide).max()) > F16_MAX:
                raise MalformedBlock("bf16 values beyond the float16 range of the tensor")
            return cast(wide, dtype.numpy)
        return cast(bf, dtype.numpy)


class QuantInt8(TensorEncoding):
    """Affine int8: q = rint((x - lo) / scale) - 128, decoded as (q + 128) * scale + lo."""

    columns = (("values", pa.int8()),)

    def encode(self, flat: np.ndarray, dtype: DType, **options: Any) -> tuple[Columns, Params]:
        lo, hi = finite_range(flat, dtype, Encoding.INT8)
        span = hi - lo
        if not math.isfinite(span):
            raise LossyValueError(f"int8: value range [{lo:g}, {hi:g}] overflows float64")
        scale = span / 255.0
        if scale < _F64_TINY:  # only a float64 block spanning < 255 * 2**-1022; decodes to lo
            scale = 0.0
        if not math.isfinite(lo + 255.0 * scale):
            raise LossyValueError(f"int8: value range [{lo:g}, {hi:g}] overflows float64")
        q = np.empty(flat.size, dtype=np.int8)
        if scale == 0.0:
            q.fill(-128)
        else:
            _quantize(flat, lo, scale, q)
        return [("values", array_of(q, pa.int8()))], {"scale": scale, "offset": lo}

    def decode(
        self, cols: dict[str, np.ndarray], params: Params, dtype: DType, size: int
    ) -> np.ndarray:
        if not dtype.is_float:
            raise UnsupportedDtype(f"{dtype} with encoding int8", _FLOAT_DTYPES)
        q = cols["values"].view(np.int8)
        scale = float(_param(params, "scale"))
        lo = float(_param(params, "offset"))
        if scale < 0.0:
            raise MalformedBlock(f"int8: negative scale {scale!r}")
        # The decoded range [lo, lo + 255 * scale] must fit the dtype (float rounding aside).
        limit = _MAX_FINITE[dtype] * (1.0 if dtype is DType.FLOAT64 else 1.0 + 2.0**-20)
        if not -limit <= lo <= lo + 255.0 * scale <= limit:
            raise MalformedBlock(f"int8: range [{lo!r}, {lo + 255.0 * scale!r}] exceeds {dtype}")
        base = lo + 128.0 * scale  # y = q * scale + base == (q + 128) * scale + lo
        # float32 keeps the bound (its EPS term) when scale is a normal float32 and no
        # intermediate can overflow; otherwise, and for float64 tensors, compute in float64.
        use32 = (
            dtype is not DType.FLOAT64
            and abs(lo) + 256.0 * scale < _F32_MAX
            and (scale == 0.0 or scale >= _F32_TINY)
        )
        compute = np.float32 if use32 else np.float64
        out = np.empty(q.size, dtype=dtype.numpy)
        if out.dtype == compute:
            np.multiply(q, compute(scale), out=out, dtype=compute)
            np.add(out, compute(base), out=out)
            return out
        tmp = np.empty(min(_CHUNK, q.size), dtype=compute)
        for start in range(0, q.size, _CHUNK):
            piece = tmp[: min(_CHUNK, q.size - start)]
            np.multiply(q[start : start + piece.size], compute(scale), out=piece, dtype=compute)
            np.add(piece, compute(base), out=piece)
            np.copyto(out[start : start + piece.size], piece, casting="unsafe")
        return out


def _quantize(flat: np.ndarray, lo: float, scale: float, q: np.ndarray) -> None:
    """q = clip(rint((x - lo) / scale), 0, 255) - 128, in float32 where that keeps the bound."""
    inv = 1.0 / scale
    # float32 is exact enough (the bound's EPS term) unless x - lo or 1 / scale would overflow it.
    use32 = flat.dtype != np.float64 and 255.0 * scale < _F32_MAX and inv < _F32_MAX
    compute = np.float32 if use32 else np.float64
    lo_c, inv_c = compute(lo), compute(inv)
    work = np.empty(min(_CHUNK, flat.size), dtype=compute)
    for start, piece in _chunks(flat, compute):
        t = work[: piece.size]
        np.subtract(piece, lo_c, out=t)
        np.multiply(t, inv_c, out=t)
        np.rint(t, out=t)
        np.clip(t, 0.0, 255.0, out=t)
        np.subtract(t, 128.0, out=t)
        np.copyto(q[start : start + piece.size], t, casting="unsafe")


MAX_TOPK_RATIO = 1 << 20
"""A top-k block expands to at most this many values per kept entry (``topk_fraction`` >=
2**-20): a small block can never make a decoder allocate an unbounded tensor."""


class TopK(TensorEncoding):
    """The k largest-magnitude entries as (sorted int64 indices, values of the tensor dtype)."""

    columns = (("indices", pa.int64()), ("values", None))
    options = frozenset({"topk_fraction"})

    def encode(self, flat: np.ndarray, dtype: DType, **options: Any) -> tuple[Columns, Params]:
        finite_range(flat, dtype, Encoding.TOPK)
        fraction = float(options.get("topk_fraction", 0.01))
        if not 1.0 / MAX_TOPK_RATIO <= fraction <= 1.0:
            raise ValueError(f"topk_fraction must be in [2**-20, 1], got {fraction}")
        k = min(flat.size, max(1, math.ceil(flat.size * fraction))) if flat.size else 0
        if k == flat.size:
            idx = np.arange(flat.size, dtype=np.int64)
        else:
            magnitude = np.abs(cast(flat, np.dtype(np.float32)) if flat.itemsize == 2 else flat)
            idx = np.sort(np.argpartition(magnitude, flat.size - k)[flat.size - k :])
            idx = idx.astype(np.int64, copy=False)
        vals = flat[idx]
        columns = [("indices", array_of(idx, pa.int64())), ("values", array_of(vals, dtype.arrow))]
        return columns, {"k": k}

    def rows(self, params: Params, size: int) -> int:
        k = params.get("k")
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= size:
            raise MalformedBlock(f"topk: k={k!r} is not an integer in [0, {size}]")
        if size > k * MAX_TOPK_RATIO:  # the encoder keeps >= 1 entry per 2**20 values
            raise MalformedBlock(f"topk: {k} entries cannot stand for {size} values")
        return k

    def decode(
        self, cols: dict[str, np.ndarray], params: Params, dtype: DType, size: int
    ) -> np.ndarray:
        idx = cols["indices"].view(np.int64)
        vals = cols["values"].view(dtype.numpy)
        if idx.size and (int(idx[0]) < 0 or int(idx[-1]) >= size):
            raise MalformedBlock(f"topk: an index is outside [0, {size})")
        if idx.size > 1 and not bool(np.all(idx[1:] > idx[:-1])):
            raise MalformedBlock("topk: indices are not strictly increasing")
        try:
            out = np.zeros(size, dtype=dtype.numpy)
        except MemoryError as exc:
            raise MalformedBlock(f"topk: cannot allocate {size} values") from exc
        out[idx] = vals
        return out


def _param(params: Params, name: str) -> float | int:
    value = params.get(name)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise MalformedBlock(f"encoding parameter {name!r} is missing or not a finite number")
    return value


ENCODINGS: dict[Encoding, TensorEncoding] = {
    Encoding.DENSE: Dense(),
    Encoding.F16: CastF16(),
    Encoding.BF16: CastBF16(),
    Encoding.INT8: QuantInt8(),
    Encoding.TOPK: TopK(),
}
if set(ENCODINGS) != set(Encoding):  # pragma: no cover - checked at import
    raise RuntimeError("encoding registry incomplete")
