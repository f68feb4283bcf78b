"""Aggregation domain types: contributions, layouts, aggregator kinds, options and results."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from fractions import Fraction
from typing import Any, TypeAlias

import numpy as np

from tensorswap.errors import AggregationError, NonFiniteValues

Shape: TypeAlias = tuple[int, ...]
#: What an aggregation returns: one array, or named arrays for a whole model update.
Values: TypeAlias = np.ndarray | dict[str, np.ndarray]

#: Accumulation dtypes that may be requested explicitly.
ACCUMULATE_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


class InvalidAggregatorOption(AggregationError):
    """An aggregator option is out of range or does not apply to the chosen kind."""

    def __init__(self, option: str, value: object, reason: str) -> None:
        self.option = option
        self.value = value
        self.reason = reason
        super().__init__(f"invalid aggregator option {option}={value!r}: {reason}")


class AggregatorKind(Enum):
    """Every aggregation rule tensorswap implements (the registry covers each one)."""

    MEAN = "mean"  # uniform mean, num_samples ignored
    FEDAVG = "fedavg"  # weights proportional to num_samples; all zero -> uniform mean
    MEDIAN = "median"  # coordinate-wise median
    TRIMMED_MEAN = "trimmed_mean"  # coordinate-wise mean after dropping b lowest and b highest
    KRUM = "krum"  # the one contribution closest to its n - f - 2 neighbours
    MULTI_KRUM = "multi_krum"  # uniform mean of the m best Krum scores


class NonFinitePolicy(Enum):
    """What happens to a contribution holding NaN or infinite values."""

    RAISE = "raise"  # NonFiniteValues naming the first offending contribution; nothing computed
    DROP = "drop"  # leave the contribution out and report it in AggregateResult.dropped
    PROPAGATE = "propagate"  # no check (the seed's behaviour): IEEE rules decide the result


@dataclass(frozen=True)
class Contribution:
    """One peer's update: an array (numpy or torch) or a mapping name -> array, and its weight.

    `num_samples` is the number of training examples behind the update; FedAvg weighs by it and
    falls back to the uniform mean when every contribution reports 0. Any object with `values`
    and `num_samples` attributes (such as a codec TensorBlock) or a `(values, num_samples)` pair
    is accepted wherever a Contribution is.
    """

    values: Any
    num_samples: int = 0


@dataclass(frozen=True)
class Layout:
    """The structure of a contribution: one tensor (`keys is None`) or named tensors in order.

    A flat row of a contribution holds its tensors back to back in `keys` order; `offsets[j]`
    and `sizes[j]` locate tensor j inside that row of `size` values.
    """

    keys: tuple[str, ...] | None
    shapes: tuple[Shape, ...]

    @staticmethod
    def single(shape: Shape) -> Layout:
        """The layout of one tensor of `shape`."""
        return Layout(None, (_checked_shape(shape),))

    @staticmethod
    def named(shapes: Mapping[str, Shape]) -> Layout:
        """The layout of named tensors, kept in the mapping's order."""
        keys = tuple(shapes)
        for key in keys:
            if not isinstance(key, str):
                raise InvalidAggregatorOption("layout", key, "tensor names must be str")
        return Layout(keys, tuple(_checked_shape(shapes[k]) for k in keys))

    @staticmethod
    def coerce(spec: Layout | Shape | Mapping[str, Shape] | int) -> Layout:
        """A Layout from a Layout, a shape (or a length), or a mapping name -> shape."""
        if isinstance(spec, Layout):
            return spec
        if isinstance(spec, Mapping):
            return Layout.named(spec)
        if isinstance(spec, int | np.integer):
            return Layout.single((int(spec),))
        return Layout.single(spec)  # anything else that is not a sequence of ints is refused

    @property
    def names(self) -> tuple[str | None, ...]:
        """The tensor names, or `(None,)` for a single tensor."""
        return (None,) if self.keys is None else self.keys

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(math.prod(s) for s in self.shapes)

    @property
    def offsets(self) -> tuple[int, ...]:
        out, pos = [], 0
        for n in self.sizes:
            out.append(pos)
            pos += n
        return tuple(out)

    @property
    def size(self) -> int:
        """Number of values in a whole contribution."""
        return sum(self.sizes)

    def index(self, name: str | None) -> int:
        """Position of tensor `name` (None for a single-tensor layout)."""
        if self.keys is None:
            if name is not None:
                raise KeyError(name)
            return 0
        if name is None:
            raise KeyError("a tensor name is required for a named layout")
        if name not in self.keys:
            raise KeyError(name)
        return self.keys.index(name)


def _checked_shape(shape: object) -> Shape:
    try:
        dims = tuple(int(d) for d in shape)  # type: ignore[attr-defined]
    except (TypeError, ValueError) as exc:
        raise InvalidAggregatorOption("shape", shape, "not a sequence of ints") from exc
    if any(d < 0 for d in dims):
        raise InvalidAggregatorOption("shape", shape, "dimensions must be >= 0")
    return dims


def parse_dtype(dtype: object) -> np.dtype:
    """np.dtype(dtype), or InvalidAggregatorOption (numpy raises TypeError, ValueError and
    even SyntaxError, for 'f4,,', on what it cannot parse)."""
    try:
        return np.dtype(dtype)  # type: ignore[call-overload]
    except (TypeError, ValueError, SyntaxError) as exc:
        raise InvalidAggregatorOption("dtype", dtype, "not a dtype") from exc


def _accumulate_dtype(dtype: object) -> np.dtype | None:
    if dtype is None:
        return None
    dt = parse_dtype(dtype)
    if dt not in ACCUMULATE_DTYPES:
        raise InvalidAggregatorOption("dtype", dtype, "accumulate in float32 or float64")
    return dt


@dataclass(frozen=True)
class AggregatorSpec:
    """A validated choice of aggregation rule and its options.

    - `byzantine` (f): peers assumed malicious; Krum needs n > 2f + 2 contributions.
    - `select` (m): how many best-scored contributions multi-Krum averages (default n - f).
    - `trim_fraction` / `trim_count`: trimmed mean drops b = floor(fraction * n) (or b = count)
      lowest and highest values per coordinate; the default is a fraction of 0.1.
    - `max_norm`: scale every contribution whose whole-update L2 norm exceeds it down to it,
      before aggregating.
    - `dtype`: accumulate in float32 or float64; default float32, or float64 for a tensor
      given in float64 (never widened or narrowed silently).
    - `non_finite`: the NaN / infinity policy.

    Options that do not apply to `kind` are rejected rather than ignored.
    """

    kind: AggregatorKind = AggregatorKind.FEDAVG
    byzantine: int = 0
    select: int | None = None
    trim_fraction: float | None = None
    trim_count: int | None = None
    max_norm: float | None = None
    dtype: Any = None
    non_finite: NonFinitePolicy = NonFinitePolicy.RAISE

    def __post_init__(self) -> None:
        if not isinstance(self.kind, AggregatorKind):
            raise InvalidAggregatorOption("kind", self.kind, "not an AggregatorKind")
        if not isinstance(self.non_finite, NonFinitePolicy):
            raise InvalidAggregatorOption("non_finite", self.non_finite, "not a NonFinitePolicy")
        object.__setattr__(self, "dtype", _accumulate_dtype(self.dtype))
        krum = self.kind in (AggregatorKind.KRUM, AggregatorKind.MULTI_KRUM)
        _check_int("byzantine", self.byzantine, 0)
        if self.byzantine and not krum:
            raise InvalidAggregatorOption("byzantine", self.byzantine, f"unused by {self.kind}")
        if self.select is not None:
            _check_int("select", self.select, 1)
            if self.kind is not AggregatorKind.MULTI_KRUM:
                raise InvalidAggregatorOption("select", self.select, f"unused by {self.kind}")
        trimmed = self.kind is AggregatorKind.TRIMMED_MEAN
        if self.trim_fraction is not None:
            f = self.trim_fraction
            if not trimmed:
                raise InvalidAggregatorOption("trim_fraction", f, f"unused by {self.kind}")
            if not isinstance(f, float | int) or isinstance(f, bool) or not 0 <= f < 0.5:
                raise InvalidAggregatorOption("trim_fraction", f, "must be in [0, 0.5)")
        if self.trim_count is not None:
            _check_int("trim_count", self.trim_count, 0)
            if not trimmed:
                unused = f"unused by {self.kind}"
                raise InvalidAggregatorOption("trim_count", self.trim_count, unused)
            if self.trim_fraction is not None:
                raise InvalidAggregatorOption("trim_count", self.trim_count, "give one of the two")
        if self.max_norm is not None:
            m = self.max_norm
            ok = isinstance(m, float | int) and not isinstance(m, bool) and math.isfinite(m)
            if not ok or m <= 0:
                raise InvalidAggregatorOption("max_norm", m, "must be a finite number > 0")

    def trim_for(self, n: int) -> int:
        """Values trimmed from each end of every coordinate among n contributions."""
        if self.trim_count is not None:
            return self.trim_count
        fraction = 0.1 if self.trim_fraction is None else self.trim_fraction
        # The fraction as written (its shortest repr), exactly: 0.29 * 100 is 28.999999999999996
        # in binary floating point, and floor(0.29 * 100) must be 29.
        return math.floor(Fraction(repr(float(fraction))) * n)


def _check_int(option: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
        raise InvalidAggregatorOption(option, value, f"must be an int >= {low}")


@dataclass(frozen=True)
class AggregateResult:
    """An aggregate and the facts about how it was formed.

    `values` has the structure of the inputs (one array, or a dict in the inputs' key order) in
    the accumulation dtype; it never aliases an input. `used` lists the indices (input positions,
    or matrix rows) of the contributions that entered the result, ascending; for Krum these
    are the selected ones. `dropped` holds one NonFiniteValues per contribution left out by
    the DROP policy. `total_samples` sums num_samples over `used`.
    """

    values: Values
    kind: AggregatorKind
    used: tuple[int, ...]
    total_samples: int
    dropped: tuple[NonFiniteValues, ...] = field(default=())
