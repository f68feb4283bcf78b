"""Bad specs, options, contributions raise typed errors; a failed streaming add changes nothing."""

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
    StreamingAccumulator,
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


def test_torch_negative_view_is_read_as_the_numbers_it_shows() -> None:
    torch = pytest.importorskip("torch")
    negated = torch.complex(torch.zeros(2), torch.ones(2)).conj().imag  # the neg bit set
    assert negated.is_neg()
    result = aggregate([(negated, 1), (torch.ones(2), 3)])
    np.testing.assert_array_equal(result.values, np.full(2, 0.5, np.float32))


def test_sparse_torch_tensor_is_an_invalid_contribution_not_a_dtype_error() -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(InvalidContribution, match="not readable") as info:
        aggregate([(torch.ones(2).to_sparse(), 1)])
    assert isinstance(info.value, AggregationError)


# ── a streaming add that raises leaves the accumulator as it was ──


def test_streaming_add_that_raises_leaves_the_accumulator_unchanged() -> None:
    acc = StreamingAccumulator(max_norm=10.0)
    acc.add({"w": np.ones(3, np.float32)}, 2)
    before = (acc.result().values["w"].copy(), acc.count, acc.total_samples)  # type: ignore[index]
    bad = [
        ({"w": np.ones(4, np.float32)}, 1),
        ({"v": np.ones(3, np.float32)}, 1),
        ({"w": np.ones(3, np.float64)}, 1),
        ({"w": np.ones(3, np.int32)}, 1),
        ({"w": np.array([1.0, np.nan, 1.0], np.float32)}, 1),
        ({"w": np.ones(3, np.float32)}, -1),
        ([1.0, 2.0, 3.0], 1),
    ]
    for values, n in bad:
        with pytest.raises(AggregationError):
            acc.add(values, n)
    after = acc.result()
    np.testing.assert_array_equal(after.values["w"], before[0])  # type: ignore[index]
    assert (acc.count, acc.total_samples) == before[1:]
