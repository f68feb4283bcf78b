"""ContributionMatrix: a preallocated (K, M) matrix that contributions are received into."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from tensorswap.aggregate.types import InvalidAggregatorOption, Layout, Shape, parse_dtype
from tensorswap.aggregate.validate import (
    FLOAT_DTYPE_NAMES,
    Batch,
    check_against,
    check_num_samples,
    default_accumulate,
    dtype_name,
    ordered,
    tensors_of,
)
from tensorswap.errors import AggregationError, EmptyInput


class InvalidRow(AggregationError, IndexError):
    """A row index outside the matrix."""

    def __init__(self, row: object, capacity: int) -> None:
        self.row = row
        self.capacity = capacity
        super().__init__(f"row {row!r} is outside a matrix of {capacity} rows")


class RowAlreadyFilled(AggregationError):
    """A row that already holds a committed contribution was filled again (discard it first)."""

    def __init__(self, row: int) -> None:
        self.row = row
        super().__init__(f"row {row} already holds a contribution; discard it first")


class ContributionMatrix:
    """K rows of M values each, one row per contribution, allocated once up front.

    A contribution is written straight into its row, either by `fill` (a validated copy) or
    by writing into `row(i)` / `tensor(i, name)` (e.g. a socket's recv_into) and then
    `commit(i, num_samples)`. Only committed rows are aggregated; their order of arrival does
    not matter, and each row counts once. When the committed rows are 0..n-1, FedAvg and the
    mean run as one BLAS matrix-vector product over the (n, M) block with no copy.
    Rows are uninitialized memory until written; the matrix is not thread-safe.
    """

    def __init__(
        self,
        capacity: int,
        layout: Layout | Shape | Mapping[str, Shape] | int,
        dtype: Any = np.float32,
    ) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise InvalidAggregatorOption("capacity", capacity, "must be an int >= 1")
        self.layout = Layout.coerce(layout)
        self.dtype = parse_dtype(dtype)
        if dtype_name(self.dtype) not in FLOAT_DTYPE_NAMES:
            raise InvalidAggregatorOption("dtype", dtype, f"one of {sorted(FLOAT_DTYPE_NAMES)}")
        self.matrix = np.empty((capacity, self.layout.size), dtype=self.dtype)
        self._samples: list[int | None] = [None] * capacity

    @property
    def capacity(self) -> int:
        return len(self._samples)

    @property
    def filled(self) -> tuple[int, ...]:
        """Committed row indices, ascending."""
        return tuple(i for i, n in enumerate(self._samples) if n is not None)

    @property
    def count(self) -> int:
        return sum(n is not None for n in self._samples)

    def num_samples(self, i: int) -> int | None:
        """The committed num_samples of row i, or None if it is not committed."""
        return self._samples[self._check(i)]

    def row(self, i: int) -> np.ndarray:
        """Row i as a writable flat view of M values (tensors back to back in layout order)."""
        return self.matrix[self._check(i)]

    def tensor(self, i: int, name: str | None = None) -> np.ndarray:
        """Tensor `name` of row i as a writable view with its shape."""
        j = self.layout.index(name)
        start, size = self.layout.offsets[j], self.layout.sizes[j]
        return self.row(i)[start : start + size].reshape(self.layout.shapes[j])

    def commit(self, i: int, num_samples: int = 0) -> None:
        """Mark row i, already written in place, as a contribution of num_samples examples."""
        self._check(i)
        n = check_num_samples(num_samples, i)
        if self._samples[i] is not None:
            raise RowAlreadyFilled(i)
        self._samples[i] = n

    def fill(self, i: int, values: object, num_samples: int = 0) -> None:
        """Validate `values` against the layout and dtype, copy them into row i, commit it.

        Shapes, tensor names and the dtype must match exactly (no silent casts); on any error
        the row is left as it was.
        """
        self._check(i)
        n = check_num_samples(num_samples, i)
        if self._samples[i] is not None:
            raise RowAlreadyFilled(i)
        keys, arrays = tensors_of(values, i)
        arrays = ordered(self.layout, keys, arrays, i)
        check_against(self.layout, [self.dtype] * len(arrays), arrays, i)
        for j, arr in enumerate(arrays):
            name = self.layout.names[j]
            np.copyto(self.tensor(i, name), arr)
        self._samples[i] = n

    def discard(self, i: int) -> None:
        """Forget row i's contribution (if any) so that the row can be filled again."""
        self._samples[self._check(i)] = None

    def batch(self, requested: np.dtype | None = None) -> Batch:
        """The committed rows as a validated Batch (views into the matrix, no copies)."""
        rows = self.filled
        if not rows:
            raise EmptyInput("no row of the contribution matrix is committed")
        spans = list(zip(self.layout.offsets, self.layout.sizes, strict=True))
        flat = None
        if rows == tuple(range(len(rows))):
            flat = self.matrix[: len(rows)]
            parts: tuple[Any, ...] = tuple(flat[:, o : o + n] for o, n in spans)
        else:
            parts = tuple(tuple(self.matrix[i, o : o + n] for i in rows) for o, n in spans)
        count = len(self.layout.shapes)
        return Batch(
            layout=self.layout,
            parts=parts,
            num_samples=tuple(self._samples[i] or 0 for i in rows),
            index=rows,
            dtypes=(self.dtype,) * count,
            acc=(default_accumulate(self.dtype, requested),) * count,
            flat=flat,
        )

    def _check(self, i: object) -> int:
        if isinstance(i, bool) or not isinstance(i, int | np.integer):
            raise InvalidRow(i, self.capacity)
        if not 0 <= int(i) < self.capacity:
            raise InvalidRow(i, self.capacity)
        return int(i)
