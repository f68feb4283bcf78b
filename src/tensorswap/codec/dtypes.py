"""The dtypes tensorswap carries, and conversion of numpy/torch inputs to numpy arrays."""

from __future__ import annotations

import sys
from enum import StrEnum
from functools import cache
from typing import Any

import numpy as np
import pyarrow as pa

from tensorswap.errors import UnsupportedDtype


class DType(StrEnum):
    """A tensor element type. bfloat16 stays 16-bit end to end (stored as its raw bits)."""

    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    FLOAT64 = "float64"
    INT8 = "int8"
    UINT8 = "uint8"
    INT32 = "int32"
    INT64 = "int64"

    @property
    def numpy(self) -> np.dtype[Any]:
        """The little-endian numpy dtype of this element type (bfloat16: ml_dtypes', which is
        imported on first use: it costs most of a second of CPU to import)."""
        found = _NUMPY.get(self)
        return bfloat16() if found is None else found

    @property
    def arrow(self) -> pa.DataType:
        """The Arrow storage type (bfloat16 is stored as uint16 bits)."""
        return _ARROW[self]

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @property
    def is_float(self) -> bool:
        return self in (DType.FLOAT32, DType.FLOAT16, DType.BFLOAT16, DType.FLOAT64)

    @classmethod
    def of(cls, dtype: object) -> DType:
        """The DType of a numpy dtype (or anything np.dtype accepts), or UnsupportedDtype."""
        try:
            np_dtype = np.dtype(dtype)  # type: ignore[call-overload]
        except TypeError as exc:
            if not (isinstance(dtype, str) and dtype == "bfloat16"):  # known once imported
                raise UnsupportedDtype(dtype, [d.value for d in cls]) from exc
            np_dtype = bfloat16()
        found = _BY_NUMPY.get(np_dtype.newbyteorder("=") if np_dtype.byteorder != "|" else np_dtype)
        if found is None and "ml_dtypes" in sys.modules and np_dtype == bfloat16():
            found = DType.BFLOAT16  # such an array exists only once ml_dtypes is imported
        if found is None:
            raise UnsupportedDtype(np_dtype, [d.value for d in cls])
        return found

    @classmethod
    def parse(cls, name: str) -> DType:
        """The DType called `name`, or UnsupportedDtype."""
        try:
            return cls(name)
        except ValueError as exc:
            raise UnsupportedDtype(name, [d.value for d in cls]) from exc


@cache
def bfloat16() -> np.dtype[Any]:
    """ml_dtypes' bfloat16 as a numpy dtype, imported on first use."""
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


_NUMPY: dict[DType, np.dtype[Any]] = {  # all but bfloat16 (DType.numpy: imported lazily)
    DType.FLOAT32: np.dtype("<f4"),
    DType.FLOAT16: np.dtype("<f2"),
    DType.FLOAT64: np.dtype("<f8"),
    DType.INT8: np.dtype("i1"),
    DType.UINT8: np.dtype("u1"),
    DType.INT32: np.dtype("<i4"),
    DType.INT64: np.dtype("<i8"),
}
_ARROW: dict[DType, pa.DataType] = {
    DType.FLOAT32: pa.float32(),
    DType.FLOAT16: pa.float16(),
    DType.BFLOAT16: pa.uint16(),
    DType.FLOAT64: pa.float64(),
    DType.INT8: pa.int8(),
    DType.UINT8: pa.uint8(),
    DType.INT32: pa.int32(),
    DType.INT64: pa.int64(),
}
_ITEMSIZE: dict[DType, int] = {d: int(dt.itemsize) for d, dt in _NUMPY.items()}
_ITEMSIZE[DType.BFLOAT16] = 2
_BY_NUMPY: dict[np.dtype[Any], DType] = {dt: d for d, dt in _NUMPY.items()}
# Completeness of the registries is checked at import: every DType has its mappings.
if {*_NUMPY, DType.BFLOAT16} != set(DType) or set(_ARROW) != set(DType):  # pragma: no cover
    raise RuntimeError("dtype registry incomplete")

_TORCH_TO_DTYPE = {
    "torch.float32": DType.FLOAT32,
    "torch.float16": DType.FLOAT16,
    "torch.bfloat16": DType.BFLOAT16,
    "torch.float64": DType.FLOAT64,
    "torch.int8": DType.INT8,
    "torch.uint8": DType.UINT8,
    "torch.int32": DType.INT32,
    "torch.int64": DType.INT64,
}


def is_torch_tensor(obj: object) -> bool:
    """True for a torch.Tensor (subclasses included), checked without importing torch.

    A tensor can only exist once torch is imported, so torch is looked up in ``sys.modules``.
    """
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def as_numpy(values: object) -> np.ndarray:
    """A numpy view (or, for non-numpy input, array) of `values` with a supported dtype.

    torch tensors are detached and moved to the CPU; a CPU tensor's memory is shared, not
    copied. bfloat16 tensors become ml_dtypes.bfloat16 arrays over the same bits.
    Raises UnsupportedDtype for any other element type.
    """
    if isinstance(values, np.ndarray):
        arr = values
    elif is_torch_tensor(values):
        tensor: Any = values
        # a lazily negated or conjugated view (x.conj().imag, torch._neg_view) holds the same
        # numbers once resolved; resolve_* return the tensor itself when no such bit is set
        tensor = tensor.detach().resolve_neg().resolve_conj()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        name = str(tensor.dtype)
        if name not in _TORCH_TO_DTYPE:
            raise UnsupportedDtype(name, [d.value for d in DType])
        if name == "torch.bfloat16":
            import torch

            arr = tensor.view(torch.int16).numpy().view(bfloat16())
        else:
            arr = tensor.numpy()
    else:
        arr = np.asarray(values)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    DType.of(arr.dtype)
    return arr


def to_torch(values: np.ndarray) -> Any:
    """A torch tensor sharing `values`' memory where torch allows it (bfloat16 included).

    Read-only arrays and arrays with a negative stride (``a[::-1]``) are copied once: torch
    cannot mark a tensor read-only and refuses negative strides.
    """
    import torch

    values = as_numpy(values)
    dtype = DType.of(values.dtype)
    if not values.flags.writeable or any(stride < 0 for stride in values.strides):
        values = values.copy()  # C-contiguous and writable
    if dtype is DType.BFLOAT16:
        return torch.from_numpy(values.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(values)
