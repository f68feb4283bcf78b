"""TensorBlock: one named tensor with its sample count and string metadata."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np

from tensorswap.codec.dtypes import DType, as_numpy

MAX_U64 = 2**64 - 1


@dataclass(frozen=True, eq=False)
class TensorBlock:
    """A named tensor: values (numpy; torch accepted), num_samples and string metadata.

    The values are held as given (no copy) when they are a numpy array of a supported dtype;
    torch tensors are converted with `as_numpy` (shared memory for CPU tensors).
    Equality compares names, sample counts, metadata, dtypes, shapes and values bit for bit.
    """

    name: str
    values: np.ndarray
    num_samples: int = 0
    metadata: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"name must be a str, got {type(self.name).__name__}")
        object.__setattr__(self, "values", as_numpy(self.values))
        if isinstance(self.num_samples, bool) or not isinstance(self.num_samples, int | np.integer):
            raise TypeError(f"num_samples must be an int, got {type(self.num_samples).__name__}")
        if not 0 <= int(self.num_samples) <= MAX_U64:
            raise ValueError(f"num_samples must be in [0, 2**64-1], got {self.num_samples}")
        object.__setattr__(self, "num_samples", int(self.num_samples))
        for key, value in self.metadata.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise TypeError(f"metadata must map str to str, got {key!r}: {value!r}")
        object.__setattr__(self, "metadata", MappingProxyType(dict(self.metadata)))

    @property
    def dtype(self) -> DType:
        return DType.of(self.values.dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self.values.shape)

    @property
    def size(self) -> int:
        """Number of elements (1 for a 0-d tensor)."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def flat(self) -> np.ndarray:
        """A 1-D C-contiguous view of the values (a copy only if the input was not contiguous)."""
        return np.ascontiguousarray(self.values).reshape(-1)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorBlock):
            return NotImplemented
        return (
            self.name == other.name
            and self.num_samples == other.num_samples
            and dict(self.metadata) == dict(other.metadata)
            and self.values.dtype == other.values.dtype
            and self.shape == other.shape
            and _same_bits(self.values, other.values)
        )

    __hash__ = None  # type: ignore[assignment]

    def with_values(self, values: Any) -> TensorBlock:
        """The same block (name, samples, metadata) over other values."""
        return TensorBlock(self.name, values, self.num_samples, self.metadata)


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise equality (NaN payloads and signed zeros included) without copying contiguous data."""
    bits = np.dtype(f"u{a.dtype.itemsize}")
    return bool(np.array_equal(a.view(bits), b.view(bits)))
