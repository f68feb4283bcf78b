"""Per-contribution L2 norms and clipping, the non-finite screen sharing their pass, overflow."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tensorswap.aggregate._kernels import (
    all_finite,
    build_values,
    count_nonfinite,
    quiet,
    sumsq,
    sumsq_scaled,
)
from tensorswap.aggregate.types import (
    AggregatorKind,
    Contribution,
    InvalidAggregatorOption,
    NonFinitePolicy,
    Values,
)
from tensorswap.aggregate.validate import Batch, validate
from tensorswap.errors import AggregationError, EmptyInput, NonFiniteValues


class AggregateOverflow(AggregationError):
    """Finite contributions produced a non-finite aggregate (float32 overflow)."""

    def __init__(self, kind: AggregatorKind) -> None:
        self.kind = kind
        super().__init__(
            f"{kind.value}: finite contributions overflowed the accumulator; use dtype='float64'"
        )


def ensure_finite(values: Values, kind: AggregatorKind, policy: NonFinitePolicy) -> None:
    """AggregateOverflow if an aggregate of finite inputs is not finite (unless PROPAGATE)."""
    if policy is not NonFinitePolicy.PROPAGATE and not all_finite(values):
        raise AggregateOverflow(kind)


@dataclass(frozen=True)
class RowCheck:
    """One contribution's whole-update L2 norm (nan if non-finite) and its non-finite count."""

    norm: float
    nonfinite: int


def check_row(batch: Batch, i: int, exact: bool = False) -> RowCheck:
    """Norm and finiteness of row i in one pass (a dot product) per tensor.

    A finite sum of squares proves every value finite; only a non-finite sum triggers the
    count, and a sum that merely overflowed is recomputed in scaled float64. The norm is
    accurate to float64 rounding with exact=True (for clipping), else to the row dtype's.
    """
    return check_rows([batch.row(i, j) for j in range(len(batch.parts))], exact)


def check_rows(rows: Sequence[np.ndarray], exact: bool = False) -> RowCheck:
    """Norm and finiteness of one contribution given as flat rows, one per tensor."""
    total = sum(sumsq(r, exact) for r in rows)
    if math.isfinite(total):
        return RowCheck(math.sqrt(total), 0)
    bad = sum(count_nonfinite(r) for r in rows)
    if bad:
        return RowCheck(math.nan, bad)
    return RowCheck(sumsq_scaled(rows), 0)


def nonfinite_error(batch: Batch, i: int, count: int) -> NonFiniteValues:
    """The NonFiniteValues for row i, naming the caller's index."""
    return NonFiniteValues(batch.index[i], count)


def all_dropped(n: int) -> EmptyInput:
    """The error when the DROP policy leaves nothing to aggregate."""
    return EmptyInput(f"all {n} contributions were dropped for non-finite values")


def clip_scales(norms: Sequence[float], max_norm: float) -> np.ndarray:
    """Per-row factors min(1, max_norm / norm) in float64 (1 for a non-finite norm)."""
    out = np.ones(len(norms), dtype=np.float64)
    for i, norm in enumerate(norms):
        if math.isfinite(norm) and norm > max_norm:
            out[i] = max_norm / norm
    return out


@dataclass(frozen=True)
class Screened:
    """A batch after the non-finite policy, with clip factors per remaining row if asked."""

    batch: Batch
    dropped: tuple[NonFiniteValues, ...]
    scales: np.ndarray | None


def screen(batch: Batch, policy: NonFinitePolicy, max_norm: float | None) -> Screened:
    """Apply the non-finite policy to every row and compute clip factors, before aggregating.

    RAISE raises NonFiniteValues for the first offending row; DROP removes every offending
    row and reports it (EmptyInput if none is left); PROPAGATE checks nothing. With PROPAGATE
    and no max_norm no value is read at all.
    """
    if policy is NonFinitePolicy.PROPAGATE and max_norm is None:
        return Screened(batch, (), None)
    checks = [check_row(batch, i, exact=max_norm is not None) for i in range(batch.k)]
    keep: list[int] = []
    dropped: list[NonFiniteValues] = []
    for i, check in enumerate(checks):
        if check.nonfinite and policy is not NonFinitePolicy.PROPAGATE:
            error = nonfinite_error(batch, i, check.nonfinite)
            if policy is NonFinitePolicy.RAISE:
                raise error
            dropped.append(error)
        else:
            keep.append(i)
    if not keep:
        raise all_dropped(batch.k)
    kept = batch if len(keep) == batch.k else batch.select(keep)
    scales = None if max_norm is None else clip_scales([checks[i].norm for i in keep], max_norm)
    return Screened(kept, tuple(dropped), scales)


@quiet
def l2_norms(contributions: Sequence[object]) -> np.ndarray:
    """Whole-update L2 norm of each contribution (float64; nan where values are non-finite).

    For a mapping contribution the norm runs over all its tensors together.
    """
    batch = validate(contributions)
    return np.array([check_row(batch, i, True).norm for i in range(batch.k)], dtype=np.float64)


@quiet
def clip_contributions(contributions: Sequence[object], max_norm: float) -> list[Contribution]:
    """Contributions scaled so that none has an L2 norm above `max_norm`.

    A contribution already within the bound keeps its values (no copy); a larger one is
    scaled by max_norm / norm into a new array of its own dtype. Non-finite values raise
    NonFiniteValues. Aggregators accept `max_norm=` directly, which avoids these copies.
    """
    ok = isinstance(max_norm, float | int) and not isinstance(max_norm, bool)
    if not ok or not math.isfinite(max_norm) or max_norm <= 0:
        raise InvalidAggregatorOption("max_norm", max_norm, "must be a finite number > 0")
    batch = validate(contributions)
    checks = [check_row(batch, i, True) for i in range(batch.k)]
    for i, check in enumerate(checks):
        if check.nonfinite:
            raise nonfinite_error(batch, i, check.nonfinite)
    scales = clip_scales([c.norm for c in checks], max_norm)
    out = []
    for i in range(batch.k):
        rows = [batch.row(i, j) for j in range(len(batch.parts))]
        if scales[i] != 1.0:
            rows = [
                (r.astype(acc) * acc.type(scales[i])).astype(r.dtype)
                for r, acc in zip(rows, batch.acc, strict=True)
            ]
        out.append(Contribution(build_values(batch.layout, rows), batch.num_samples[i]))
    return out
