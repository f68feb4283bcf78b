"""L2 norms and norm clipping, standalone and as an aggregator option."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.aggregate import f32, float32_matrices
from tensorswap.aggregate import (
    Contribution,
    InvalidAggregatorOption,
    NonFinitePolicy,
    clip_contributions,
    fedavg,
    l2_norms,
    mean,
    median,
)
from tensorswap.errors import NonFiniteValues

_matrices = float32_matrices(6, 16, 1e4)


def test_norm_covers_every_tensor_of_an_update() -> None:
    norms = l2_norms([Contribution({"a": f32(3.0), "b": f32(0.0, 4.0)}, 1)])
    assert norms.tolist() == [5.0]


def test_norm_of_non_finite_values_is_nan() -> None:
    assert np.isnan(l2_norms([Contribution(f32(1.0, np.inf), 1)])[0])


def test_norm_survives_float32_overflow_of_the_squares() -> None:
    big = float(np.finfo(np.float32).max)
    assert l2_norms([Contribution(f32(big, big), 1)])[0] == pytest.approx(big * np.sqrt(2))


@settings(max_examples=60, deadline=None)
@given(_matrices, st.floats(0.01, 1e3))
def test_clipping_bounds_every_norm(matrix: np.ndarray, max_norm: float) -> None:
    clipped = clip_contributions([Contribution(r, 1) for r in matrix], max_norm)
    norms = l2_norms(clipped)
    assert np.all(norms <= max_norm * (1 + 1e-5))


@settings(max_examples=60, deadline=None)
@given(_matrices, st.floats(0.01, 1e3))
def test_clipping_keeps_direction_and_small_updates(matrix: np.ndarray, max_norm: float) -> None:
    before = l2_norms([Contribution(r, 1) for r in matrix])
    clipped = clip_contributions([Contribution(r, 1) for r in matrix], max_norm)
    for row, norm, out in zip(matrix, before, clipped, strict=True):
        if norm <= max_norm:
            assert np.array_equal(out.values, row)
        else:
            np.testing.assert_allclose(out.values, row * (max_norm / norm), rtol=1e-5, atol=1e-30)


def test_clipped_values_keep_their_dtype_and_samples() -> None:
    (out,) = clip_contributions([Contribution(np.array([30.0, 40.0], np.float16), 7)], 5.0)
    assert out.values.dtype == np.float16 and out.num_samples == 7
    assert out.values.tolist() == [3.0, 4.0]


def test_fedavg_option_equals_clipping_first() -> None:
    xs = [
        Contribution(f32(3.0, 4.0), 1),
        Contribution(f32(0.1, 0.0), 3),
        Contribution(f32(0.0, 9.0), 2),
    ]
    direct = fedavg(xs, max_norm=1.0).values
    staged = fedavg(clip_contributions(xs, 1.0)).values
    np.testing.assert_allclose(direct, staged, rtol=1e-6)


def test_median_option_clips_before_the_median() -> None:
    xs = [Contribution(f32(100.0), 1), Contribution(f32(200.0), 1), Contribution(f32(0.5), 1)]
    assert median(xs, max_norm=1.0).values.tolist() == [1.0]


def test_clipping_with_drop_policy_screens_in_the_same_pass() -> None:
    xs = [Contribution(f32(3.0, 4.0), 1), Contribution(f32(np.nan, 0.0), 1)]
    result = mean(xs, max_norm=1.0, non_finite=NonFinitePolicy.DROP)
    np.testing.assert_allclose(result.values, [0.6, 0.8], rtol=1e-6)
    assert [e.index for e in result.dropped] == [1]


def test_clip_contributions_rejects_non_finite_values() -> None:
    with pytest.raises(NonFiniteValues):
        clip_contributions([Contribution(f32(np.nan), 1)], 1.0)


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), True])
def test_max_norm_must_be_positive_and_finite(bad: float) -> None:
    with pytest.raises(InvalidAggregatorOption):
        fedavg([Contribution(f32(1.0), 1)], max_norm=bad)
    with pytest.raises(InvalidAggregatorOption):
        clip_contributions([Contribution(f32(1.0), 1)], bad)
