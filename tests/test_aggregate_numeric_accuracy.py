"""Aggregators' numeric limits: no float32 overflow, float64 norms, exact trims, stream parity."""

from __future__ import annotations

import numpy as np
import pytest

from tensorswap.aggregate import (
    AggregateResult,
    AggregatorKind,
    AggregatorSpec,
    InvalidAggregatorOption,
    StreamingAccumulator,
    TooFewContributions,
    clip_contributions,
    fedavg,
    krum,
    l2_norms,
    mean,
    median,
    multi_krum,
    trimmed_mean,
)

# ── trimmed mean: a sum of finite values near float32's maximum must not overflow ──


@pytest.mark.parametrize("trim", [0, 1])
def test_trimmed_mean_of_values_near_the_float32_maximum_does_not_overflow(trim: int) -> None:
    big = np.float32(3e38)
    rows = [np.array([big, -big, 1.0], dtype=np.float32) for _ in range(5)]
    result = trimmed_mean([(r, 1) for r in rows], trim_count=trim)
    np.testing.assert_array_equal(result.values, np.array([big, -big, 1.0], dtype=np.float32))
    if trim == 0:  # b = 0 is the mean, which does not overflow either
        np.testing.assert_allclose(result.values, mean([(r, 1) for r in rows]).values, rtol=1e-6)


def test_trimmed_mean_keeps_exact_results_of_small_sums() -> None:
    rows = [np.array([v], dtype=np.float32) for v in (1.0, 2.0, 3.0, 100.0, -50.0)]
    assert trimmed_mean([(r, 1) for r in rows], trim_count=1).values[0] == np.float32(2.0)


# ── norms of float32 updates are accurate (float64 accumulation), so clipping bounds hold ──

_LONG = 1_000_000  # a float32 dot product over this many values drifts by ~1e-4


def _long_row(value: float = 0.7) -> np.ndarray:
    return np.full(_LONG, value, dtype=np.float32)


def _norm64(a: np.ndarray) -> float:
    return float(np.linalg.norm(a.astype(np.float64)))


def test_l2_norm_of_a_long_float32_update_is_accurate() -> None:
    row = _long_row()
    (norm,) = l2_norms([(row, 1)])
    assert norm == pytest.approx(_norm64(row), rel=1e-12)


@pytest.mark.parametrize("value", [0.7, 3.3, 0.1])
def test_clipped_long_float32_update_is_within_max_norm(value: float) -> None:
    row = _long_row(value)
    (clipped,) = clip_contributions([(row, 1)], max_norm=1.0)
    assert _norm64(clipped.values) == pytest.approx(1.0, rel=1e-6)
    for result in (
        fedavg([(row, 1)], max_norm=1.0),
        median([(row, 1)], max_norm=1.0),
        _streamed([(row, 1)], max_norm=1.0),
    ):
        assert _norm64(result.values) == pytest.approx(1.0, rel=1e-6)


def _streamed(items: list[tuple[np.ndarray, int]], **options: object) -> AggregateResult:
    acc = StreamingAccumulator(**options)  # type: ignore[arg-type]
    for values, n in items:
        acc.add(values, n)
    return acc.result()


# ── trim_fraction: b = floor(fraction * n) for the fraction as written ──


@pytest.mark.parametrize(
    ("fraction", "n", "trim"), [(0.29, 100, 29), (0.07, 100, 7), (0.1, 30, 3), (0.49, 100, 49)]
)
def test_trim_for_is_the_floor_of_the_written_fraction(fraction: float, n: int, trim: int) -> None:
    # 0.29 * 100 is 28.999999999999996 in binary floating point
    spec = AggregatorSpec(AggregatorKind.TRIMMED_MEAN, trim_fraction=fraction)
    assert spec.trim_for(n) == trim


def test_trim_fraction_edges() -> None:
    rows = [np.array([float(v)], dtype=np.float32) for v in (1, 2, 3, 4, 100)]
    items = [(r, 1) for r in rows]
    assert trimmed_mean(items, trim_fraction=0).values[0] == np.float32(22.0)  # the mean
    assert trimmed_mean(items, trim_fraction=0.4).values[0] == np.float32(3.0)  # b = 2: median
    with pytest.raises(InvalidAggregatorOption):
        trimmed_mean(items, trim_fraction=0.5)
    with pytest.raises(TooFewContributions):
        trimmed_mean(items, trim_count=3)  # 2b >= n: nothing left


# ── Krum distances do not cancel catastrophically for updates sharing a large offset ──


def test_krum_on_float64_updates_with_a_large_common_offset() -> None:
    rng = np.random.default_rng(7)
    base = np.full(1000, 1e6)
    honest = [base + rng.standard_normal(1000) * 1e-6 for _ in range(5)]
    outlier = base + 1e-3  # far from every honest update, relative to their spread
    items = [(x, 1) for x in [outlier, *honest]]
    assert krum(items, byzantine=1).used != (0,)
    assert 0 not in multi_krum(items, byzantine=1, select=4).used
    # with max_norm the rows are scaled (by 1 here) before the distances
    assert krum(items, byzantine=1, max_norm=1e9).used != (0,)


# ── streaming agrees with batch FedAvg on extreme sample counts; a failed add changes nothing ──


@pytest.mark.parametrize(
    "counts",
    [[2**62, 2**62], [2**63 - 1, 1, 0], [2**64 - 1, 2**64 - 1, 3], [0, 0, 0], [0, 5, 0], [7]],
)
def test_streaming_matches_batch_fedavg_on_extreme_counts(counts: list[int]) -> None:
    rng = np.random.default_rng(len(counts))
    items = [(rng.standard_normal(5).astype(np.float32), n) for n in counts]
    batch, streamed = fedavg(items), _streamed(items)
    np.testing.assert_allclose(streamed.values, batch.values, rtol=1e-6, atol=1e-7)
    assert (streamed.used, streamed.total_samples) == (batch.used, batch.total_samples)
