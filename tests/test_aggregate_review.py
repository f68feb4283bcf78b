"""tensorswap.aggregate under review: edge inputs, typed errors, numeric limits, stream parity."""

from __future__ import annotations

import numpy as np
import pytest

from tensorswap.aggregate import (
    AggregatorKind,
    AggregatorSpec,
    ContributionMatrix,
    InvalidAggregatorOption,
    InvalidContribution,
    Layout,
    aggregate,
    mean,
    trimmed_mean,
)
from tensorswap.errors import AggregationError


def _ones(n: int = 2) -> np.ndarray:
    return np.ones(n, dtype=np.float32)


# ── bad options and specs raise typed errors, not raw TypeError / ValueError / AttributeError ──


@pytest.mark.parametrize("spec", ["fedavg", AggregatorKind.FEDAVG, 3])
def test_aggregate_rejects_a_spec_that_is_not_an_aggregator_spec(spec: object) -> None:
    with pytest.raises(InvalidAggregatorOption, match="spec"):
        aggregate([(_ones(), 1)], spec)  # type: ignore[arg-type]


@pytest.mark.parametrize("layout", [2.5, None, object()])
def test_matrix_layout_that_is_not_a_shape_is_an_aggregator_option_error(layout: object) -> None:
    with pytest.raises(InvalidAggregatorOption):
        ContributionMatrix(2, layout)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", ["foo", object(), "f4,,", "M8[bogus]"])
def test_dtype_that_is_not_a_dtype_is_an_aggregator_option_error(dtype: object) -> None:
    with pytest.raises(InvalidAggregatorOption):
        ContributionMatrix(2, 3, dtype=dtype)
    with pytest.raises(InvalidAggregatorOption):
        AggregatorSpec(dtype=dtype)


def test_layout_index_of_an_unknown_name_is_a_key_error() -> None:
    m = ContributionMatrix(2, {"w": (2,)})
    with pytest.raises(KeyError):
        m.tensor(0, "nope")
    with pytest.raises(KeyError):
        Layout.named({"w": (2,)}).index("nope")


def test_torch_tensor_without_data_is_an_invalid_contribution() -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(InvalidContribution):
        aggregate([(torch.zeros(2, device="meta"), 1)])


def test_torch_negative_view_is_an_invalid_contribution() -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(InvalidContribution):
        aggregate([(torch.ones(2)._neg_view(), 1)])


def test_sparse_torch_tensor_is_an_invalid_contribution_not_a_dtype_error() -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(InvalidContribution, match="not readable") as info:
        aggregate([(torch.ones(2).to_sparse(), 1)])
    assert isinstance(info.value, AggregationError)


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
