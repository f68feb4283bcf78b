"""FedAvg and the plain mean: weighted sums of contributions, screened through their result."""

from __future__ import annotations

import numpy as np

from tensorswap.aggregate._kernels import all_finite, weighted_values
from tensorswap.aggregate.clip import (
    AggregateOverflow,
    all_dropped,
    check_row,
    ensure_finite,
    nonfinite_error,
    screen,
)
from tensorswap.aggregate.types import (
    AggregateResult,
    AggregatorKind,
    AggregatorSpec,
    NonFinitePolicy,
    Values,
)
from tensorswap.aggregate.validate import Batch
from tensorswap.errors import NonFiniteValues


def sample_weights(kind: AggregatorKind, num_samples: tuple[int, ...]) -> np.ndarray:
    """Normalized float64 weights: num_samples / total for FEDAVG (uniform if total is 0)."""
    k = len(num_samples)
    total = sum(num_samples)
    if kind is AggregatorKind.FEDAVG and total > 0:
        return np.array([n / total for n in num_samples], dtype=np.float64)
    return np.full(k, 1.0 / k, dtype=np.float64)


def weighted_aggregate(batch: Batch, spec: AggregatorSpec) -> AggregateResult:
    """MEAN or FEDAVG of a validated batch under spec's clipping and non-finite policy.

    Without clipping the values are read once: the weighted sum itself is the finiteness
    test, because a NaN or infinity times a non-zero weight makes its column of the sum
    non-finite. Only then (or for zero-weight rows, which a sum cannot reveal) are rows
    scanned one by one to name the offenders. The result is returned only if it is finite
    (policies RAISE and DROP); under DROP the weights are renormalized over what is left.
    """
    kind = spec.kind
    policy = spec.non_finite
    verified = policy is NonFinitePolicy.PROPAGATE or spec.max_norm is not None
    dropped: list[NonFiniteValues] = []
    scales = None
    if verified:  # clipping reads every row for its norm anyway; that pass screens it too
        screened = screen(batch, policy, spec.max_norm)
        batch, scales = screened.batch, screened.scales
        dropped.extend(screened.dropped)
    else:
        batch = _screen_zero_weight(batch, kind, policy, dropped)
    weights = sample_weights(kind, batch.num_samples)
    if scales is not None:
        weights = weights * scales
    values = weighted_values(batch, weights)
    if policy is not NonFinitePolicy.PROPAGATE and not all_finite(values):
        if verified:  # every row was proven finite: the sum overflowed
            raise AggregateOverflow(kind)
        batch, values = _drop_and_retry(batch, kind, policy, dropped)
        ensure_finite(values, kind, policy)
    return _result(values, kind, batch, dropped)


def _screen_zero_weight(
    batch: Batch, kind: AggregatorKind, policy: NonFinitePolicy, dropped: list[NonFiniteValues]
) -> Batch:
    """Check rows whose FedAvg weight is 0 (num_samples 0 among positive ones) directly."""
    if kind is not AggregatorKind.FEDAVG or sum(batch.num_samples) == 0:
        return batch
    keep = []
    for i, n in enumerate(batch.num_samples):
        bad = check_row(batch, i).nonfinite if n == 0 else 0
        if bad and policy is NonFinitePolicy.RAISE:
            raise nonfinite_error(batch, i, bad)
        if bad:
            dropped.append(nonfinite_error(batch, i, bad))
        else:
            keep.append(i)
    return batch if len(keep) == batch.k else batch.select(keep)


def _drop_and_retry(
    batch: Batch, kind: AggregatorKind, policy: NonFinitePolicy, dropped: list[NonFiniteValues]
) -> tuple[Batch, Values]:
    """Name the rows that made the sum non-finite; raise, or drop them and sum again."""
    keep = []
    for i in range(batch.k):
        bad = check_row(batch, i).nonfinite
        if bad and policy is NonFinitePolicy.RAISE:
            raise nonfinite_error(batch, i, bad)
        if bad:
            dropped.append(nonfinite_error(batch, i, bad))
        else:
            keep.append(i)
    if len(keep) == batch.k:
        raise AggregateOverflow(kind)
    if not keep:
        raise all_dropped(len(dropped))
    batch = batch.select(keep)
    return batch, weighted_values(batch, sample_weights(kind, batch.num_samples))


def _result(
    values: Values, kind: AggregatorKind, batch: Batch, dropped: list[NonFiniteValues]
) -> AggregateResult:
    return AggregateResult(
        values=values,
        kind=kind,
        used=tuple(sorted(batch.index)),
        total_samples=sum(batch.num_samples),
        dropped=tuple(sorted(dropped, key=lambda e: e.index)),
    )
