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
