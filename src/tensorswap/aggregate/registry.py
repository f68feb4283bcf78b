"""The aggregator registry (kind -> implementation, complete at import) and the public calls."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import MappingProxyType
from typing import Any, TypeAlias

from tensorswap.aggregate._kernels import quiet
from tensorswap.aggregate.fedavg import weighted_aggregate
from tensorswap.aggregate.matrix import ContributionMatrix
from tensorswap.aggregate.robust import krum_aggregate, median_aggregate, trimmed_mean_aggregate
from tensorswap.aggregate.types import (
    AggregateResult,
    AggregatorKind,
    AggregatorSpec,
    InvalidAggregatorOption,
    NonFinitePolicy,
)
from tensorswap.aggregate.validate import Batch, validate

#: An implementation: a validated batch and a spec in, a result out; pure.
Aggregator: TypeAlias = Callable[[Batch, AggregatorSpec], AggregateResult]
#: What every aggregation call accepts: contributions, or a matrix they were received into.
Contributions: TypeAlias = Sequence[Any] | ContributionMatrix

REGISTRY: MappingProxyType[AggregatorKind, Aggregator] = MappingProxyType(
    {
        AggregatorKind.MEAN: weighted_aggregate,
        AggregatorKind.FEDAVG: weighted_aggregate,
        AggregatorKind.MEDIAN: median_aggregate,
        AggregatorKind.TRIMMED_MEAN: trimmed_mean_aggregate,
        AggregatorKind.KRUM: krum_aggregate,
        AggregatorKind.MULTI_KRUM: krum_aggregate,
    }
)


def _check_complete() -> None:
    missing = set(AggregatorKind) - set(REGISTRY)
    if missing:
        names = ", ".join(sorted(k.name for k in missing))
        raise RuntimeError(f"aggregator registry lacks an implementation for: {names}")


_check_complete()


@quiet
def aggregate(contributions: Contributions, spec: AggregatorSpec | None = None) -> AggregateResult:
    """Aggregate by `spec` (FedAvg by default); everything is validated before any arithmetic.

    `contributions` is a sequence of Contribution / (values, num_samples) / objects with
    `values` and `num_samples`, where values is a numpy array, a torch tensor, or a mapping
    name -> array; or a ContributionMatrix (its committed rows). The result never aliases
    an input. Raises EmptyInput, AggregateShapeMismatch, DtypeMismatch, KeysMismatch,
    UnsupportedAggregateDtype, InvalidNumSamples, NonFiniteValues (policy RAISE), ...: all
    AggregationError, all ValueError.
    """
    spec = AggregatorSpec() if spec is None else spec
    if not isinstance(spec, AggregatorSpec):
        raise InvalidAggregatorOption("spec", spec, "not an AggregatorSpec")
    if isinstance(contributions, ContributionMatrix):
        batch = contributions.batch(spec.dtype)
    else:
        batch = validate(contributions, spec.dtype)
    return REGISTRY[spec.kind](batch, spec)


def fedavg(
    contributions: Contributions,
    *,
    dtype: Any = None,
    max_norm: float | None = None,
    non_finite: NonFinitePolicy = NonFinitePolicy.RAISE,
) -> AggregateResult:
    """FedAvg: Σ (n_i / Σ n) x_i, or the uniform mean when every num_samples is 0.

    float32 contributions are averaged in float32 with float32 weights (for a
    ContributionMatrix, one BLAS matrix-vector product); dtype='float64' accumulates in
    float64 instead.
    """
    spec = AggregatorSpec(
        AggregatorKind.FEDAVG, dtype=dtype, max_norm=max_norm, non_finite=non_finite
    )
    return aggregate(contributions, spec)


def mean(
    contributions: Contributions,
    *,
    dtype: Any = None,
    max_norm: float | None = None,
    non_finite: NonFinitePolicy = NonFinitePolicy.RAISE,
) -> AggregateResult:
    """The uniform mean; num_samples is ignored."""
    spec = AggregatorSpec(
        AggregatorKind.MEAN, dtype=dtype, max_norm=max_norm, non_finite=non_finite
    )
    return aggregate(contributions, spec)


def median(
    contributions: Contributions,
    *,
    dtype: Any = None,
    max_norm: float | None = None,
    non_finite: NonFinitePolicy = NonFinitePolicy.RAISE,
) -> AggregateResult:
    """The coordinate-wise median (mean of the two middle values for an even count)."""
    spec = AggregatorSpec(
        AggregatorKind.MEDIAN, dtype=dtype, max_norm=max_norm, non_finite=non_finite
    )
    return aggregate(contributions, spec)


def trimmed_mean(
    contributions: Contributions,
    *,
    trim_fraction: float | None = None,
    trim_count: int | None = None,
    dtype: Any = None,
    max_norm: float | None = None,
    non_finite: NonFinitePolicy = NonFinitePolicy.RAISE,
) -> AggregateResult:
    """Coordinate-wise mean without the b lowest and b highest values (b from fraction or count).

    The default trims floor(0.1 * n) from each end; 2b < n is required.
    """
    spec = AggregatorSpec(
        AggregatorKind.TRIMMED_MEAN,
        trim_fraction=trim_fraction,
        trim_count=trim_count,
        dtype=dtype,
        max_norm=max_norm,
        non_finite=non_finite,
    )
    return aggregate(contributions, spec)


def krum(
    contributions: Contributions,
    *,
    byzantine: int,
    dtype: Any = None,
    max_norm: float | None = None,
    non_finite: NonFinitePolicy = NonFinitePolicy.RAISE,
) -> AggregateResult:
    """Krum: the contribution with the smallest summed distance to its n - f - 2 neighbours.

    `byzantine` is f; n > 2f + 2 is required. result.used names the chosen contribution.
    """
    spec = AggregatorSpec(
        AggregatorKind.KRUM,
        byzantine=byzantine,
        dtype=dtype,
        max_norm=max_norm,
        non_finite=non_finite,
    )
    return aggregate(contributions, spec)


def multi_krum(
    contributions: Contributions,
    *,
    byzantine: int,
    select: int | None = None,
    dtype: Any = None,
    max_norm: float | None = None,
    non_finite: NonFinitePolicy = NonFinitePolicy.RAISE,
) -> AggregateResult:
    """Multi-Krum: the uniform mean of the `select` (default n - f) best Krum scores."""
    spec = AggregatorSpec(
        AggregatorKind.MULTI_KRUM,
        byzantine=byzantine,
        select=select,
        dtype=dtype,
        max_norm=max_norm,
        non_finite=non_finite,
    )
    return aggregate(contributions, spec)
