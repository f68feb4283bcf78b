"""Coordinate-wise median, trimmed mean, Krum and multi-Krum."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.aggregate import float32_matrices
from tensorswap.aggregate import (
    AggregateOverflow,
    Contribution,
    InvalidAggregatorOption,
    NonFinitePolicy,
    TooFewContributions,
    krum,
    mean,
    median,
    multi_krum,
    trimmed_mean,
)
from tensorswap.errors import NonFiniteValues


def contribs(matrix: np.ndarray, samples: list[int] | None = None) -> list[Contribution]:
    ns = samples or [1] * len(matrix)
    return [Contribution(row, n) for row, n in zip(matrix, ns, strict=True)]


def f32(rows: list[list[float]]) -> np.ndarray:
    return np.array(rows, dtype=np.float32)


_matrices = float32_matrices(7, 12, 1e3)


# ── median ───────────────────────────────────────────────────────────────────
def test_median_odd_count_picks_the_middle_value() -> None:
    result = median(contribs(f32([[1, 9], [5, -1], [100, 3]])))
    assert result.values.tolist() == [5.0, 3.0]
    assert result.values.dtype == np.float32


def test_median_even_count_averages_the_two_middle_values() -> None:
    assert median(contribs(f32([[1], [2], [4], [100]]))).values.tolist() == [3.0]


def test_median_ignores_num_samples() -> None:
    assert median(contribs(f32([[0], [1], [2]]), [1000, 1, 1])).values.tolist() == [1.0]


def test_median_of_two_huge_values_does_not_overflow() -> None:
    big = float(np.finfo(np.float32).max)
    assert median(contribs(f32([[big], [big]]))).values.tolist() == [big]


def test_median_spans_several_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    from tensorswap.aggregate import _kernels as kernels

    monkeypatch.setattr(kernels, "chunk_len", lambda k, itemsize: 3)
    matrix = np.arange(30, dtype=np.float32).reshape(3, 10)
    assert np.array_equal(median(contribs(matrix)).values, matrix[1])


@settings(max_examples=50, deadline=None)
@given(_matrices, st.randoms(use_true_random=False))
def test_median_is_permutation_invariant(matrix: np.ndarray, rnd: object) -> None:
    order = list(range(len(matrix)))
    rnd.shuffle(order)  # type: ignore[attr-defined]
    a = median(contribs(matrix)).values
    b = median(contribs(matrix[order])).values
    assert np.array_equal(a, b)


@settings(max_examples=50, deadline=None)
@given(_matrices)
def test_median_lies_between_min_and_max(matrix: np.ndarray) -> None:
    values = median(contribs(matrix)).values
    assert np.all(values >= matrix.min(axis=0)) and np.all(values <= matrix.max(axis=0))


def test_median_of_two_equal_subnormals_is_that_value() -> None:
    matrix = np.full((2, 1), 1e-45, dtype=np.float32)
    assert median(contribs(matrix)).values[0] == matrix[0, 0]


def test_median_rejects_non_finite_by_default() -> None:
    with pytest.raises(NonFiniteValues):
        median(contribs(f32([[1.0], [np.nan], [2.0]])))


def test_median_drop_policy() -> None:
    result = median(contribs(f32([[1.0], [np.nan], [3.0]])), non_finite=NonFinitePolicy.DROP)
    assert result.values.tolist() == [2.0] and result.used == (0, 2)


# ── trimmed mean ─────────────────────────────────────────────────────────────
def test_trimmed_mean_removes_extremes() -> None:
    matrix = f32([[-1000, 1], [1, 2], [2, 3], [3, 1000]])
    assert trimmed_mean(contribs(matrix), trim_count=1).values.tolist() == [1.5, 2.5]


def test_trimmed_mean_fraction_rounds_down() -> None:
    matrix = f32([[0], [1], [2], [3], [100]])
    # floor(0.3 * 5) = 1 trimmed from each end
    assert trimmed_mean(contribs(matrix), trim_fraction=0.3).values.tolist() == [2.0]


@settings(max_examples=50, deadline=None)
@given(_matrices)
def test_trimmed_mean_without_trim_is_the_mean(matrix: np.ndarray) -> None:
    a = trimmed_mean(contribs(matrix), trim_count=0).values
    b = mean(contribs(matrix)).values
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-3)


@settings(max_examples=50, deadline=None)
@given(_matrices, st.randoms(use_true_random=False))
def test_trimmed_mean_is_permutation_invariant(matrix: np.ndarray, rnd: object) -> None:
    order = list(range(len(matrix)))
    rnd.shuffle(order)  # type: ignore[attr-defined]
    trim = (len(matrix) - 1) // 2
    a = trimmed_mean(contribs(matrix), trim_count=trim).values
    b = trimmed_mean(contribs(matrix[order]), trim_count=trim).values
    assert np.array_equal(a, b)


def test_trimmed_mean_needs_more_than_twice_the_trim() -> None:
    with pytest.raises(TooFewContributions) as info:
        trimmed_mean(contribs(f32([[1], [2], [3], [4]])), trim_count=2)
    assert info.value.have == 4 and info.value.need == 5


def test_trimmed_mean_overflow_is_reported() -> None:
    big = float(np.finfo(np.float32).max)
    xs = contribs(f32([[big], [big]]))
    # the sum overflows float32 but the mean of the quotients does not (nor does mean())
    assert trimmed_mean(xs, trim_count=0).values[0] == np.float32(big)
    assert trimmed_mean(xs, trim_count=0, dtype="float64").values[0] == big
    wide = [Contribution(np.array([1e39, 1e39]), 1) for _ in range(3)]  # float64 beyond float32
    with pytest.raises(AggregateOverflow):
        trimmed_mean(wide, trim_count=1, dtype="float32")


def test_trim_options_are_exclusive_and_bounded() -> None:
    xs = contribs(f32([[1], [2], [3]]))
    with pytest.raises(InvalidAggregatorOption):
        trimmed_mean(xs, trim_fraction=0.1, trim_count=1)
    with pytest.raises(InvalidAggregatorOption):
        trimmed_mean(xs, trim_fraction=0.5)


# ── Krum ─────────────────────────────────────────────────────────────────────
def _honest_and_outliers(honest: int, byzantine: int, dim: int = 6) -> np.ndarray:
    rng = np.random.default_rng(7)
    good = rng.normal(1.0, 0.01, size=(honest, dim))
    bad = rng.normal(500.0, 50.0, size=(byzantine, dim))
    rows = np.concatenate([bad[:1], good[: honest // 2], bad[1:], good[honest // 2 :]])
    return rows.astype(np.float32)


def test_krum_picks_an_honest_contribution() -> None:
    matrix = _honest_and_outliers(honest=5, byzantine=2)
    result = krum(contribs(matrix), byzantine=2)
    (chosen,) = result.used
    assert np.allclose(matrix[chosen], 1.0, atol=0.1)
    assert np.array_equal(result.values, matrix[chosen])


def test_multi_krum_averages_only_the_honest_cluster() -> None:
    matrix = _honest_and_outliers(honest=6, byzantine=2)
    result = multi_krum(contribs(matrix), byzantine=2)
    assert len(result.used) == 6
    assert all(np.allclose(matrix[i], 1.0, atol=0.1) for i in result.used)
    np.testing.assert_allclose(result.values, matrix[list(result.used)].mean(axis=0), rtol=1e-6)


def test_multi_krum_select_limits_the_average() -> None:
    matrix = _honest_and_outliers(honest=5, byzantine=1)
    assert len(multi_krum(contribs(matrix), byzantine=1, select=2).used) == 2


def test_krum_with_f_zero_needs_three_contributions() -> None:
    with pytest.raises(TooFewContributions):
        krum(contribs(f32([[1], [2]])), byzantine=0)
    assert krum(contribs(f32([[0], [1], [50]])), byzantine=0).used == (0,)


def test_krum_requires_more_than_2f_plus_2() -> None:
    matrix = _honest_and_outliers(honest=4, byzantine=2)  # n = 6 = 2f + 2
    with pytest.raises(TooFewContributions) as info:
        krum(contribs(matrix), byzantine=2)
    assert info.value.need == 7 and "2f + 2" in str(info.value)


def test_krum_uses_the_whole_update_across_tensors() -> None:
    # as 2-D points (a, b): (0, 9), (1, 1), (1.1, 1.1), (9, 0); with f = 0 each score sums
    # the 2 nearest squared distances: (1.1, 1.1) scores 0.02 + 63.62, the lowest
    points = [(0.0, 9.0), (1.0, 1.0), (1.1, 1.1), (9.0, 0.0)]
    xs = [Contribution({"a": np.float32([a]), "b": np.float32([b])}, 1) for a, b in points]
    assert krum(xs, byzantine=0).used == (2,)


def test_krum_ties_go_to_the_lower_index() -> None:
    matrix = f32([[1.0], [1.0], [1.0], [1.0]])
    assert krum(contribs(matrix), byzantine=0).used == (0,)


def test_select_larger_than_n_is_rejected() -> None:
    with pytest.raises(InvalidAggregatorOption):
        multi_krum(contribs(f32([[0], [1], [2]])), byzantine=0, select=4)


def _reference_scores(matrix: np.ndarray, f: int) -> np.ndarray:
    m = matrix.astype(np.float64)
    d = ((m[:, None, :] - m[None, :, :]) ** 2).sum(-1)
    n = len(m)
    return np.array([np.sort(np.delete(d[i], i))[: n - f - 2].sum() for i in range(n)])


@settings(max_examples=50, deadline=None)
@given(_matrices)
def test_krum_chooses_a_minimum_reference_score(matrix: np.ndarray) -> None:
    if len(matrix) < 3:
        return
    result = krum(contribs(matrix), byzantine=0)
    scores = _reference_scores(matrix, 0)
    (chosen,) = result.used
    assert scores[chosen] <= scores.min() * (1 + 1e-9) + 1e-6
    assert np.array_equal(result.values, matrix[chosen])
