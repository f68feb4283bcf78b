"""Byzantine-robust aggregators: coordinate-wise median, trimmed mean, Krum and multi-Krum."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tensorswap import _alloc
from tensorswap.aggregate._kernels import blocks, build_values, weighted_values
from tensorswap.aggregate.clip import Screened, ensure_finite, screen
from tensorswap.aggregate.types import (
    AggregateResult,
    AggregatorKind,
    AggregatorSpec,
    InvalidAggregatorOption,
    Values,
)
from tensorswap.aggregate.validate import Batch
from tensorswap.errors import AggregationError

#: Reduces a scratch block (k, c), which it may reorder, into an output slice (c,).
Reducer = Callable[[np.ndarray, np.ndarray], None]


class TooFewContributions(AggregationError):
    """A robust rule needs more contributions than it was given (after any drops)."""

    def __init__(self, kind: AggregatorKind, have: int, need: int, rule: str) -> None:
        self.kind = kind
        self.have = have
        self.need = need
        self.rule = rule
        super().__init__(f"{kind.value} needs at least {need} contributions ({rule}), got {have}")


def _coordinatewise(screened: Screened, reduce: Reducer) -> Values:
    """Apply `reduce` to each (k, c) column block of every tensor, clip factors applied first."""
    batch = screened.batch
    outs = []
    for part, acc, size in zip(batch.parts, batch.acc, batch.layout.sizes, strict=True):
        out = _alloc.empty(size, acc)  # recycled memory, as weighted_values
        factors = None if screened.scales is None else screened.scales.astype(acc)[:, None]
        for start, stop, block in blocks(part, acc, copy=True):
            if factors is not None:
                block *= factors
            reduce(block, out[start:stop])
        outs.append(out)
    return build_values(batch.layout, outs)


def _median_reducer(block: np.ndarray, out: np.ndarray) -> None:
    block.sort(axis=0)
    k = block.shape[0]
    if k % 2:
        out[...] = block[k // 2]
    else:  # halves first: the mean of two float32 values near the maximum must not overflow
        half = block.dtype.type(0.5)
        low, high = block[k // 2 - 1], block[k // 2]
        np.multiply(low, half, out=out)
        out += high * half
        # Halving rounds subnormals (0.5 * 1e-45 is 0): keep the mean between its two values.
        np.clip(out, low, high, out=out)


def _trimmed_reducer(trim: int) -> Reducer:
    def reduce(block: np.ndarray, out: np.ndarray) -> None:
        k = block.shape[0]
        block.sort(axis=0)
        kept, count = block[trim : k - trim], block.dtype.type(k - 2 * trim)
        np.sum(kept, axis=0, out=out)
        np.divide(out, count, out=out)
        if not np.isfinite(out).all():  # a sum of finite values near the maximum overflowed:
            np.divide(kept, count, out=kept)  # average the quotients (as the mean's weights do)
            np.sum(kept, axis=0, out=out)

    return reduce


def _result(
    values: Values,
    spec: AggregatorSpec,
    screened: Screened,
    rows: list[int] | None = None,
) -> AggregateResult:
    """The result, once it is known finite (AggregateOverflow otherwise, unless PROPAGATE)."""
    kind, policy = spec.kind, spec.non_finite
    batch = screened.batch
    chosen = range(batch.k) if rows is None else rows
    ensure_finite(values, kind, policy)
    return AggregateResult(
        values=values,
        kind=kind,
        used=tuple(sorted(batch.index[i] for i in chosen)),
        total_samples=sum(batch.num_samples[i] for i in chosen),
        dropped=screened.dropped,
    )


def median_aggregate(batch_in: Batch, spec: AggregatorSpec) -> AggregateResult:
    """Coordinate-wise median (the mean of the two middle values for an even count).

    Guarantees: invariant under reordering the contributions; unweighted (num_samples is
    ignored, so a peer cannot buy influence by claiming more samples); memory beyond the
    result is one cache-sized block.
    """
    screened = screen(batch_in, spec.non_finite, spec.max_norm)
    values = _coordinatewise(screened, _median_reducer)
    return _result(values, spec, screened)


def trimmed_mean_aggregate(batch_in: Batch, spec: AggregatorSpec) -> AggregateResult:
    """Coordinate-wise mean after removing the b smallest and b largest values.

    b = spec.trim_count, or floor(trim_fraction * n) (fraction 0.1 by default); 2b < n is
    required. b = 0 is the plain mean. Unweighted and order-invariant like the median. A
    column whose sum of kept values overflows (finite values near the dtype's maximum) is
    recomputed as the sum of their quotients, so it overflows no more than the mean does.
    """
    screened = screen(batch_in, spec.non_finite, spec.max_norm)
    n = screened.batch.k
    trim = spec.trim_for(n)
    if 2 * trim >= n:
        raise TooFewContributions(spec.kind, n, 2 * trim + 1, f"2 * trim < n with trim={trim}")
    values = _coordinatewise(screened, _trimmed_reducer(trim))
    return _result(values, spec, screened)


def _gram(screened: Screened) -> np.ndarray:
    """Float64 inner products of the (clipped) rows, centred, over all tensors, block by block.

    Distances come from |a|^2 + |b|^2 - 2 a.b, which cancels catastrophically when the rows
    share an offset large against their differences (float64 updates around 1e6 differing by
    1e-6 made Krum pick an outlier). Each block is therefore centred on its coordinate-wise
    median first (distances do not change under translation; the median keeps the centre
    among the honest rows); a column whose median is not finite (PROPAGATE) is not centred.
    """
    batch = screened.batch
    gram = np.zeros((batch.k, batch.k), dtype=np.float64)
    factors = None if screened.scales is None else screened.scales[:, None]
    for part in batch.parts:
        for _, _, block in blocks(part, np.dtype(np.float64), copy=True):
            if factors is not None:
                block *= factors
            centre = np.median(block, axis=0)
            centre[~np.isfinite(centre)] = 0.0
            block -= centre
            gram += block @ block.T
    return gram


def krum_scores(screened: Screened, byzantine: int) -> np.ndarray:
    """Each row's sum of squared distances to its n - f - 2 nearest other rows."""
    gram = _gram(screened)
    diag = np.diag(gram)
    dist = np.maximum(diag[:, None] + diag[None, :] - 2.0 * gram, 0.0)
    n = dist.shape[0]
    neighbours = n - byzantine - 2
    scores = np.empty(n, dtype=np.float64)
    for i in range(n):
        others = np.sort(np.delete(dist[i], i))
        scores[i] = others[:neighbours].sum()
    return scores


def krum_aggregate(batch_in: Batch, spec: AggregatorSpec) -> AggregateResult:
    """Krum (one contribution) or multi-Krum (uniform mean of the m best-scored ones).

    Requires n > 2f + 2 with f = spec.byzantine. Scores are computed on float64 inner
    products over the whole update; ties go to the lower index. multi-Krum averages the
    m = spec.select (default n - f) lowest-scored contributions uniformly, since
    self-reported sample counts are exactly what a byzantine peer would inflate. Plain Krum
    returns the chosen contribution's values (clipped if max_norm is set) in the
    accumulation dtype.
    """
    screened = screen(batch_in, spec.non_finite, spec.max_norm)
    batch = screened.batch
    n, f = batch.k, spec.byzantine
    if n <= 2 * f + 2:
        raise TooFewContributions(spec.kind, n, 2 * f + 3, f"n > 2f + 2 with f={f}")
    if spec.kind is AggregatorKind.KRUM:
        m = 1
    else:
        m = n - f if spec.select is None else spec.select
        if m > n:
            raise InvalidAggregatorOption("select", m, f"more than the {n} contributions")
    scores = krum_scores(screened, f)
    chosen = sorted(int(i) for i in np.argsort(scores, kind="stable")[:m])
    weights = np.full(m, 1.0 / m, dtype=np.float64)
    if screened.scales is not None:
        weights = weights * screened.scales[chosen]
    values = weighted_values(batch.select(chosen), weights)
    return _result(values, spec, screened, chosen)
