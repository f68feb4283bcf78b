"""Tensor encodings: dense, and lossy f16 / bf16 casts, int8 quantization, top-k sparse.

Each encoding turns a flat tensor into named Arrow columns plus numeric parameters and back.
Documented error bounds (x the original value, y the decoded one):

- dense: exact (bit for bit).
- f16:   |y - x| <= 2**-11 * |x| for |x| >= 2**-14 (normal range); |y - x| <= 2**-25 below it.
         Values with |x| > 65504 (the float16 maximum) are refused, never saturated.
- bf16:  |y - x| <= 2**-8 * |x| (round to nearest even, float32 range kept).
- int8:  per block, offset = min(x), scale = (max(x) - min(x)) / 255; |y - x| <= scale / 2.
- topk:  the k entries of largest magnitude are kept exactly; every dropped entry decodes to 0,
         so its error is |x| <= the smallest kept magnitude.

Lossy encodings accept float tensors only and refuse NaN/Inf (their bounds would be void).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from enum import StrEnum
from typing import Any

import ml_dtypes
import numpy as np
import pyarrow as pa

from tensorswap.codec.dtypes import DType
from tensorswap.errors import CodecError, MalformedBlock, UnsupportedDtype

F16_MAX = 65504.0
_CAST_CHUNK = 1 << 20  # numpy casts in cache-sized pieces run ~2x faster than one big cast


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


def _cast(values: np.ndarray, target: np.dtype[Any]) -> np.ndarray:
    """Cast with torch when installed (an order of magnitude faster), else numpy in chunks."""
    try:
        import torch
    except ImportError:
        torch = None  # type: ignore[assignment]
    if torch is not None and values.dtype in (np.float32, np.float64) and values.size > 4096:
        src = torch.from_numpy(values)
        if target == np.dtype(ml_dtypes.bfloat16):
            return src.to(torch.bfloat16).view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        if target == np.float16:
            return src.to(torch.float16).numpy()
    out = np.empty(values.shape, dtype=target)
    for start in range(0, values.size, _CAST_CHUNK):
        out[start : start + _CAST_CHUNK] = values[start : start + _CAST_CHUNK]
    return out


def _check_float_finite(flat: np.ndarray, dtype: DType, encoding: Encoding) -> None:
    if not dtype.is_float:
        raise UnsupportedDtype(
            f"{dtype} with encoding {encoding}", ["float32", "float16", "bfloat16", "float64"]
        )
    if flat.size and not np.isfinite(flat).all():
        raise LossyValueError(f"encoding {encoding} refuses NaN or infinite values")


class TensorEncoding(ABC):
    """One way of laying a flat tensor into Arrow columns."""

    columns: tuple[tuple[str, pa.DataType | None], ...]  # None: the tensor's own storage type

    @abstractmethod
    def encode(self, flat: np.ndarray, dtype: DType, **options: Any) -> tuple[Columns, Params]:
        """Columns and parameters for a flat, C-contiguous tensor of `dtype`."""

    @abstractmethod
    def decode(
        self, cols: dict[str, np.ndarray], params: Params, dtype: DType, size: int
    ) -> np.ndarray:
        """The flat tensor of `dtype` and `size` elements; raises MalformedBlock if inconsistent."""


class Dense(TensorEncoding):
    columns = (("values", None),)

    def encode(self, flat: np.ndarray, dtype: DType, **options: Any) -> tuple[Columns, Params]:
        return [("values", array_of(flat, dtype.arrow))], {}

    def decode(
        self, cols: dict[str, np.ndarray], params: Params, dtype: DType, size: int
    ) -> np.ndarray:
        values = cols["values"]
        _expect_len("values", values, size)
        return values.view(dtype.numpy)


class CastF16(TensorEncoding):
    columns = (("values", pa.float16()),)

    def encode(self, flat: np.ndarray, dtype: DType, **options: Any) -> tuple[Columns, Params]:
        _check_float_finite(flat, dtype, Encoding.F16)
        if dtype is DType.FLOAT16:
            return [("values", array_of(flat, pa.float16()))], {}
        if flat.size and float(np.abs(flat).max()) > F16_MAX:
            raise LossyValueError(f"values beyond the float16 range (|x| > {F16_MAX:g})")
        return [
            (
                "values",
                array_of(_cast(flat.astype(np.float32, copy=False), np.dtype("<f2")), pa.float16()),
            )
        ], {}

    def decode(
        self, cols: dict[str, np.ndarray], params: Params, dtype: DType, size: int
    ) -> np.ndarray:
        values = cols["values"]
        _expect_len("values", values, size)
        return values.view(np.float16).astype(dtype.numpy)


class CastBF16(TensorEncoding):
    columns = (("values", pa.uint16()),)

    def encode(self, flat: np.ndarray, dtype: DType, **options: Any) -> tuple[Columns, Params]:
        _check_float_finite(flat, dtype, Encoding.BF16)
        bf = _cast(flat.astype(np.float32, copy=False), np.dtype(ml_dtypes.bfloat16))
        return [("values", array_of(bf.view(np.uint16), pa.uint16()))], {}

    def decode(
        self, cols: dict[str, np.ndarray], params: Params, dtype: DType, size: int
    ) -> np.ndarray:
        values = cols["values"]
        _expect_len("values", values, size)
        return values.view(ml_dtypes.bfloat16).astype(dtype.numpy)


class QuantInt8(TensorEncoding):
    columns = (("values", pa.int8()),)

    def encode(self, flat: np.ndarray, dtype: DType, **options: Any) -> tuple[Columns, Params]:
        _check_float_finite(flat, dtype, Encoding.INT8)
        work = flat.astype(np.float32, copy=False)
        lo = float(work.min()) if work.size else 0.0
        hi = float(work.max()) if work.size else 0.0
        scale = (hi - lo) / 255.0
        if scale == 0.0:
            q = np.full(work.shape, -128, dtype=np.int8)
        else:
            scaled = (work - np.float32(lo)) / np.float32(scale)
            q = (np.rint(scaled) - 128).clip(-128, 127).astype(np.int8)
        return [("values", array_of(q, pa.int8()))], {"scale": scale, "offset": lo}

    def decode(
        self, cols: dict[str, np.ndarray], params: Params, dtype: DType, size: int
    ) -> np.ndarray:
        values = cols["values"]
        _expect_len("values", values, size)
        scale = float(_param(params, "scale"))
        offset = float(_param(params, "offset"))
        out = (values.view(np.int8).astype(np.float64) + 128.0) * scale + offset
        return out.astype(dtype.numpy)


class TopK(TensorEncoding):
    columns = (("indices", pa.int64()), ("values", None))

    def encode(self, flat: np.ndarray, dtype: DType, **options: Any) -> tuple[Columns, Params]:
        _check_float_finite(flat, dtype, Encoding.TOPK)
        fraction = float(options.get("topk_fraction", 0.01))
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"topk_fraction must be in (0, 1], got {fraction}")
        k = min(flat.size, max(1, int(np.ceil(flat.size * fraction)))) if flat.size else 0
        if k == flat.size:
            idx = np.arange(flat.size, dtype=np.int64)
        else:
            idx = np.sort(np.argpartition(np.abs(flat), flat.size - k)[flat.size - k :])
            idx = idx.astype(np.int64)
        vals = flat[idx]
        return [("indices", array_of(idx, pa.int64())), ("values", array_of(vals, dtype.arrow))], {
            "k": k
        }

    def decode(
        self, cols: dict[str, np.ndarray], params: Params, dtype: DType, size: int
    ) -> np.ndarray:
        idx = cols["indices"].view(np.int64)
        vals = cols["values"].view(dtype.numpy)
        if idx.size != vals.size:
            raise MalformedBlock(f"topk: {idx.size} indices but {vals.size} values")
        if idx.size > size:
            raise MalformedBlock(f"topk: {idx.size} entries for a tensor of {size} values")
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= size):
            raise MalformedBlock(f"topk: an index is outside [0, {size})")
        out = np.zeros(size, dtype=dtype.numpy)
        out[idx] = vals
        return out


def _expect_len(column: str, values: np.ndarray, size: int) -> None:
    if values.size != size:
        raise MalformedBlock(f"column {column!r} has {values.size} values, the shape needs {size}")


def _param(params: Params, name: str) -> float | int:
    value = params.get(name)
    if not isinstance(value, int | float) or not np.isfinite(value):
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
