"""Validation of contributions into a Batch: structure, shapes, dtypes and sample counts."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeAlias

import numpy as np

from tensorswap.aggregate.types import Layout, Shape
from tensorswap.codec.dtypes import as_numpy, is_torch_tensor
from tensorswap.errors import (
    AggregateShapeMismatch,
    AggregationError,
    DtypeMismatch,
    EmptyInput,
    UnsupportedDtype,
)

MAX_NUM_SAMPLES = 2**64 - 1
#: Element types a contribution may have; integers are rejected (dequantize them first).
FLOAT_DTYPE_NAMES = frozenset({"float16", "bfloat16", "float32", "float64"})

#: Values of one tensor across the rows of a batch: a (k, m) array whose rows are contiguous,
#: or k contiguous 1-D arrays of m values each.
Part: TypeAlias = np.ndarray | tuple[np.ndarray, ...]


class InvalidContribution(AggregationError, TypeError):
    """A contribution is not an array, a torch tensor, a mapping of them, or a known wrapper."""

    def __init__(self, index: int, reason: str) -> None:
        self.index = index
        self.reason = reason
        super().__init__(f"contribution {index}: {reason}")


class InvalidNumSamples(AggregationError):
    """num_samples is not an int in [0, 2**64 - 1]."""

    def __init__(self, index: int, value: object) -> None:
        self.index = index
        self.value = value
        super().__init__(f"contribution {index}: num_samples must be an int >= 0, got {value!r}")


class UnsupportedAggregateDtype(AggregationError):
    """An element type aggregation does not accept (only float16/bfloat16/float32/float64)."""

    def __init__(self, index: int, dtype: object, context: str = "") -> None:
        self.index = index
        self.dtype = str(dtype)
        self.context = context
        where = f" ({context})" if context else ""
        super().__init__(
            f"contribution {index} has dtype {self.dtype}{where}; aggregation accepts "
            f"{', '.join(sorted(FLOAT_DTYPE_NAMES))} (dequantize integer tensors first)"
        )


class KeysMismatch(AggregationError):
    """Contributions name different tensors (or mix single tensors with named ones)."""

    def __init__(self, index: int, expected: object, got: object) -> None:
        self.index = index
        self.expected = expected
        self.got = got
        super().__init__(f"contribution {index}: expected tensors {expected}, got {got}")


@dataclass(frozen=True)
class Batch:
    """Validated contributions, ready for arithmetic; nothing in it has been computed on.

    `parts[j]` holds tensor j of every row, flattened; `flat`, when set, is a (k, layout.size)
    matrix whose column slices are the parts (contributions received into one matrix).
    `index[i]` is the caller's index of row i; `acc[j]` is tensor j's accumulation dtype.
    """

    layout: Layout
    parts: tuple[Part, ...]
    num_samples: tuple[int, ...]
    index: tuple[int, ...]
    dtypes: tuple[np.dtype, ...]
    acc: tuple[np.dtype, ...]
    flat: np.ndarray | None = None

    @property
    def k(self) -> int:
        return len(self.index)

    def row(self, i: int, j: int) -> np.ndarray:
        """The flat values of tensor j in row i (a view)."""
        return self.parts[j][i]

    def select(self, rows: Sequence[int]) -> Batch:
        """The sub-batch of the given row positions, in that order (views, no copies)."""
        parts = tuple(tuple(part[i] for i in rows) for part in self.parts)
        return Batch(
            layout=self.layout,
            parts=parts,
            num_samples=tuple(self.num_samples[i] for i in rows),
            index=tuple(self.index[i] for i in rows),
            dtypes=self.dtypes,
            acc=self.acc,
        )


_DTYPE_NAMES: dict[np.dtype, str] = {}


def dtype_name(dtype: np.dtype) -> str:
    """The dtype's plain name ('bfloat16' for ml_dtypes' bfloat16)."""
    # numpy computes ``dtype.name`` in Python (issubdtype checks): ~50 us each, which was 8%
    # of the coordinator's GIL time on tiny contributions (py-spy). Dtypes are few: cached.
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = str(dtype.name)
        if len(_DTYPE_NAMES) < 256:  # bounded: structured dtypes could be many
            _DTYPE_NAMES[dtype] = name
    return name


def default_accumulate(dtype: np.dtype, requested: np.dtype | None) -> np.dtype:
    """float64 for float64 tensors, float32 otherwise, unless a dtype was requested."""
    if requested is not None:
        return requested
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


def as_array(obj: object, index: int) -> np.ndarray:
    """`obj` (array, numpy scalar or torch tensor) as a numpy array, not copied where possible.

    torch tensors go through `tensorswap.codec.dtypes.as_numpy` (detached, moved to the CPU,
    bfloat16 kept as ml_dtypes.bfloat16 over the same bits); torch is never imported unless
    `obj` is a torch tensor (so torch is already loaded). A tensor dtype numpy or the codec
    cannot hold raises UnsupportedAggregateDtype. Non-native byte order is converted to native
    order (a copy).
    """
    if isinstance(obj, np.ndarray):
        arr = obj
    elif isinstance(obj, np.generic):  # a 0-d numpy scalar
        arr = np.asarray(obj)
    elif is_torch_tensor(obj):
        try:
            arr = as_numpy(obj)
        except UnsupportedDtype as exc:  # complex, quantized, int16, float8, ...
            name = str(getattr(obj, "dtype", "?")).removeprefix("torch.")
            raise UnsupportedAggregateDtype(index, name) from exc
        except (TypeError, RuntimeError) as exc:  # sparse; meta (a RuntimeError subclass)
            reason = f"torch tensor not readable as an array: {exc}"
            raise InvalidContribution(index, reason) from exc
    else:
        raise InvalidContribution(
            index, f"values must be a numpy array or torch tensor, got {type(obj).__name__}"
        )
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    return arr


def unpack(item: object, index: int) -> tuple[object, int]:
    """(values, num_samples) of a Contribution, a (values, n) pair, or any object with both."""
    if isinstance(item, tuple):
        if len(item) != 2:
            raise InvalidContribution(index, "a tuple contribution must be (values, num_samples)")
        values, n = item
    elif hasattr(item, "values") and hasattr(item, "num_samples") and not isinstance(item, Mapping):
        values, n = item.values, item.num_samples
    else:
        raise InvalidContribution(
            index, f"expected a Contribution or (values, num_samples), got {type(item).__name__}"
        )
    return values, check_num_samples(n, index)


def check_num_samples(n: object, index: int) -> int:
    """n as an int, or InvalidNumSamples."""
    if isinstance(n, bool) or not isinstance(n, int | np.integer):
        raise InvalidNumSamples(index, n)
    if not 0 <= int(n) <= MAX_NUM_SAMPLES:
        raise InvalidNumSamples(index, n)
    return int(n)


def tensors_of(values: object, index: int) -> tuple[tuple[str, ...] | None, list[np.ndarray]]:
    """The tensor names (None for a single tensor) and arrays of one contribution's values."""
    if isinstance(values, Mapping):
        keys = tuple(values)
        for key in keys:
            if not isinstance(key, str):
                raise InvalidContribution(index, f"tensor names must be str, got {key!r}")
        if not keys:
            raise InvalidContribution(index, "a mapping contribution holds no tensors")
        return keys, [as_array(values[k], index) for k in keys]
    return None, [as_array(values, index)]


def check_dtype(arr: np.ndarray, index: int, context: str) -> None:
    """UnsupportedAggregateDtype unless arr holds one of the accepted float types."""
    if dtype_name(arr.dtype) not in FLOAT_DTYPE_NAMES:
        raise UnsupportedAggregateDtype(index, arr.dtype, context)


def ordered(
    layout: Layout, keys: tuple[str, ...] | None, arrays: list[np.ndarray], index: int
) -> list[np.ndarray]:
    """`arrays` (named `keys`) in the layout's tensor order; KeysMismatch if the names differ.

    Named tensors may come in any order; a single tensor matches only a single-tensor layout.
    """
    if keys == layout.keys:
        return arrays
    if keys is None or layout.keys is None or set(keys) != set(layout.keys):
        raise KeysMismatch(index, _describe(layout.keys), _describe(keys))
    by_name = dict(zip(keys, arrays, strict=True))
    return [by_name[k] for k in layout.keys]


def check_against(
    layout: Layout, dtypes: Sequence[np.dtype], arrays: Sequence[np.ndarray], index: int
) -> None:
    """Raise unless `arrays` (in layout order) have the layout's shapes and `dtypes` exactly."""
    for name, shape, dtype, arr in zip(layout.names, layout.shapes, dtypes, arrays, strict=True):
        context = f"contribution {index}" + ("" if name is None else f", tensor {name!r}")
        if arr.shape != shape:
            raise AggregateShapeMismatch(shape, arr.shape, context)
        check_dtype(arr, index, context)
        if arr.dtype != dtype:
            raise DtypeMismatch(dtype_name(dtype), dtype_name(arr.dtype), context)


def _describe(keys: tuple[str, ...] | None) -> str:
    return "a single tensor" if keys is None else str(sorted(keys))


def flat_view(arr: np.ndarray) -> np.ndarray:
    """arr as a contiguous 1-D array (a view when arr is C-contiguous, else a copy)."""
    return np.ascontiguousarray(arr).reshape(-1)


def validate(contributions: Sequence[object], requested: np.dtype | None = None) -> Batch:
    """Check every contribution against the first and return the Batch; no arithmetic done.

    Guarantees on return: at least one contribution; every num_samples an int in range; every
    contribution has the same tensor names (any order), and per tensor the same shape and the
    same float dtype. Errors name the contribution index and, for shapes, both shapes.
    """
    if isinstance(contributions, Mapping | np.ndarray) or not isinstance(contributions, Sequence):
        raise InvalidContribution(-1, "contributions must be a sequence (list or tuple)")
    if len(contributions) == 0:
        raise EmptyInput()
    given: list[list[np.ndarray]] = []
    counts: list[int] = []
    layout: Layout | None = None
    dtypes: list[np.dtype] = []
    for index, item in enumerate(contributions):
        values, n = unpack(item, index)
        keys, arrays = tensors_of(values, index)
        if layout is None:
            shapes: tuple[Shape, ...] = tuple(a.shape for a in arrays)
            layout = Layout(keys, shapes)
            for name, arr in zip(layout.names, arrays, strict=True):
                check_dtype(arr, index, "" if name is None else f"tensor {name!r}")
            dtypes = [a.dtype for a in arrays]
        arrays = ordered(layout, keys, arrays, index)
        check_against(layout, dtypes, arrays, index)
        given.append(arrays)
        counts.append(n)
    if layout is None:
        raise EmptyInput()
    rows = [[flat_view(a) for a in arrays] for arrays in given]  # copies only if non-contiguous
    parts = tuple(tuple(row[j] for row in rows) for j in range(len(layout.shapes)))
    return Batch(
        layout=layout,
        parts=parts,
        num_samples=tuple(counts),
        index=tuple(range(len(rows))),
        dtypes=tuple(dtypes),
        acc=tuple(default_accumulate(d, requested) for d in dtypes),
    )
