"""FedAvg and the mean: seed 000 semantics, validation, dtypes, non-finite policies."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.aggregate import f32, weighted_float32_matrices
from tensorswap.aggregate import (
    AggregateOverflow,
    Contribution,
    InvalidContribution,
    InvalidNumSamples,
    KeysMismatch,
    NonFinitePolicy,
    UnsupportedAggregateDtype,
    fedavg,
    mean,
)
from tensorswap.errors import (
    AggregateShapeMismatch,
    AggregationError,
    DtypeMismatch,
    EmptyInput,
    NonFiniteValues,
)


# ── ported from seed 000 ─────────────────────────────────────────────────────
def test_fedavg_weighted() -> None:
    a = Contribution(f32(0.0, 0.0), 100)
    b = Contribution(f32(2.0, 4.0), 300)
    avg = fedavg([a, b]).values
    assert abs(avg[0] - 1.5) < 1e-5
    assert abs(avg[1] - 3.0) < 1e-5


def test_fedavg_empty_returns_error() -> None:
    with pytest.raises(EmptyInput, match="No gradient blocks provided"):
        fedavg([])


def test_fedavg_shape_mismatch() -> None:
    a = Contribution(f32(1.0, 2.0, 3.0), 10)
    b = Contribution(f32(1.0, 2.0), 10)
    with pytest.raises(AggregateShapeMismatch) as info:
        fedavg([a, b])
    assert info.value.expected == (3,) and info.value.got == (2,)
    assert "[3]" in str(info.value) and "[2]" in str(info.value)


# ── semantics ────────────────────────────────────────────────────────────────
def test_all_zero_samples_is_uniform_mean() -> None:
    result = fedavg([Contribution(f32(1.0), 0), Contribution(f32(3.0), 0)])
    assert result.values.tolist() == [2.0]
    assert result.total_samples == 0


def test_zero_sample_contribution_weighs_nothing_among_positive_ones() -> None:
    result = fedavg([Contribution(f32(100.0), 0), Contribution(f32(3.0), 5)])
    assert result.values.tolist() == [3.0]
    assert result.used == (0, 1)


def test_mean_ignores_num_samples() -> None:
    assert mean([Contribution(f32(0.0), 1), Contribution(f32(4.0), 99)]).values.tolist() == [2.0]


def test_single_contribution_is_returned_unchanged_but_copied() -> None:
    x = f32(1.25, -2.5)
    result = fedavg([Contribution(x, 7)])
    assert np.array_equal(result.values, x)
    assert not np.shares_memory(result.values, x)


def test_pairs_and_duck_typed_objects_are_contributions() -> None:
    class Block:
        def __init__(self, values: np.ndarray, num_samples: int) -> None:
            self.values, self.num_samples = values, num_samples

    result = fedavg([(f32(0.0), 1), Block(f32(4.0), 3)])
    assert result.values.tolist() == [3.0]


def test_codec_tensor_block_is_a_contribution() -> None:
    block_mod = pytest.importorskip("tensorswap.codec")
    blocks = [block_mod.TensorBlock("w", f32(2.0), 1), block_mod.TensorBlock("w", f32(4.0), 1)]
    assert fedavg(blocks).values.tolist() == [3.0]


def test_shape_is_kept_including_zero_d_and_empty() -> None:
    assert fedavg([Contribution(np.float32(2.0) * np.ones((), np.float32), 1)]).values.shape == ()
    empty = np.zeros((0, 3), np.float32)
    assert fedavg([Contribution(empty, 1), Contribution(empty, 2)]).values.shape == (0, 3)


def test_non_contiguous_input() -> None:
    base = np.arange(12, dtype=np.float32).reshape(3, 4)
    result = fedavg([Contribution(base.T, 1), Contribution(base.T * 3, 1)])
    assert np.array_equal(result.values, base.T * 2)


# ── named tensors ────────────────────────────────────────────────────────────
def test_mapping_contributions_average_each_tensor() -> None:
    a = {"w": np.ones((2, 2), np.float32), "b": f32(0.0)}
    b = {"w": np.full((2, 2), 3.0, np.float32), "b": f32(8.0)}
    values = fedavg([Contribution(a, 1), Contribution(b, 1)]).values
    assert list(values) == ["w", "b"]
    assert np.array_equal(values["w"], np.full((2, 2), 2.0, np.float32))
    assert values["b"].tolist() == [4.0]


def test_mapping_keys_may_come_in_any_order() -> None:
    a = {"w": f32(1.0), "b": f32(0.0)}
    b = {"b": f32(2.0), "w": f32(3.0)}
    values = fedavg([Contribution(a, 1), Contribution(b, 1)]).values
    assert values["w"].tolist() == [2.0] and values["b"].tolist() == [1.0]


def test_mapping_keys_must_match() -> None:
    with pytest.raises(KeysMismatch):
        fedavg([Contribution({"w": f32(1.0)}, 1), Contribution({"v": f32(1.0)}, 1)])


def test_single_tensor_and_mapping_do_not_mix() -> None:
    with pytest.raises(KeysMismatch):
        fedavg([Contribution(f32(1.0), 1), Contribution({"w": f32(1.0)}, 1)])


def test_shape_mismatch_names_the_tensor() -> None:
    with pytest.raises(AggregateShapeMismatch, match="'w'"):
        fedavg([Contribution({"w": f32(1.0)}, 1), Contribution({"w": f32(1.0, 2.0)}, 1)])


# ── validation ───────────────────────────────────────────────────────────────
def test_dtype_mismatch_is_rejected() -> None:
    with pytest.raises(DtypeMismatch, match=r"float32.*float64"):
        fedavg([Contribution(f32(1.0), 1), Contribution(np.array([1.0]), 1)])


def test_integer_tensors_are_rejected() -> None:
    with pytest.raises(UnsupportedAggregateDtype, match="int32"):
        fedavg([Contribution(np.array([1, 2], np.int32), 1)])


def test_lists_are_not_arrays() -> None:
    with pytest.raises(InvalidContribution):
        fedavg([Contribution([1.0, 2.0], 1)])


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3", 2**64])
def test_num_samples_must_be_a_non_negative_int(bad: object) -> None:
    with pytest.raises(InvalidNumSamples):
        fedavg([Contribution(f32(1.0), bad)])  # type: ignore[arg-type]


def test_validation_happens_before_any_arithmetic() -> None:
    ok = Contribution(f32(1.0, 2.0), 1)
    with pytest.raises(AggregateShapeMismatch):
        fedavg([ok, Contribution(f32(np.nan, 1.0), 1), Contribution(f32(1.0), 1)])


def test_errors_are_value_errors() -> None:
    assert issubclass(AggregateShapeMismatch, AggregationError)
    with pytest.raises(ValueError):
        fedavg([])


# ── dtypes ───────────────────────────────────────────────────────────────────
def test_float32_stays_float32() -> None:
    assert fedavg([Contribution(f32(1.0), 1), Contribution(f32(2.0), 2)]).values.dtype == np.float32


def test_float64_on_request() -> None:
    result = fedavg([Contribution(f32(1.0), 1), Contribution(f32(2.0), 2)], dtype="float64")
    assert result.values.dtype == np.float64
    assert result.values[0] == pytest.approx(5.0 / 3.0, rel=1e-15)


def test_float64_input_is_not_narrowed() -> None:
    assert fedavg([Contribution(np.array([0.1]), 1)]).values.dtype == np.float64


def test_float16_accumulates_in_float32() -> None:
    xs = [Contribution(np.array([1.0, 2.0], np.float16), 1) for _ in range(3)]
    result = fedavg(xs)
    assert result.values.dtype == np.float32 and result.values.tolist() == [1.0, 2.0]


def test_bfloat16_is_accepted() -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    xs = [Contribution(np.array([1.0, 3.0], ml_dtypes.bfloat16), 1) for _ in range(2)]
    assert fedavg(xs).values.tolist() == [1.0, 3.0]


def test_torch_tensors_are_accepted() -> None:
    torch = pytest.importorskip("torch")
    a = torch.tensor([0.0, 0.0], requires_grad=True)
    b = torch.tensor([2.0, 4.0])
    result = fedavg([Contribution(a, 100), Contribution(b, 300)])
    assert isinstance(result.values, np.ndarray)
    assert result.values.tolist() == [1.5, 3.0]


def test_torch_bfloat16_is_accepted() -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("ml_dtypes")
    t = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    assert fedavg([Contribution(t, 1), Contribution(t * 3, 1)]).values.tolist() == [2.0, 4.0]


def test_torch_bfloat16_views_keep_their_layout() -> None:
    torch = pytest.importorskip("torch")
    t = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3).t()  # a non-contiguous view
    assert fedavg([Contribution(t, 1)]).values.tolist() == [[0, 3], [1, 4], [2, 5]]


@pytest.mark.parametrize("name", ["complex64", "int16", "int8", "bool"])
def test_torch_tensors_of_other_dtypes_are_aggregate_errors(name: str) -> None:
    torch = pytest.importorskip("torch")
    t = torch.zeros(2, dtype=getattr(torch, name))
    with pytest.raises(UnsupportedAggregateDtype, match=rf"contribution 1 has dtype {name}\b"):
        fedavg([Contribution(torch.zeros(2), 1), Contribution(t, 1)])


# ── non-finite values ────────────────────────────────────────────────────────
def test_non_finite_raises_by_default_naming_the_contribution() -> None:
    xs = [Contribution(f32(1.0, 2.0), 1), Contribution(f32(np.inf, np.nan), 1)]
    with pytest.raises(NonFiniteValues) as info:
        fedavg(xs)
    assert info.value.index == 1 and info.value.count == 2


def test_non_finite_in_a_zero_weight_contribution_is_still_caught() -> None:
    xs = [Contribution(f32(1.0), 5), Contribution(f32(np.nan), 0)]
    with pytest.raises(NonFiniteValues):
        fedavg(xs)


def test_drop_policy_leaves_out_and_reports() -> None:
    xs = [Contribution(f32(1.0), 1), Contribution(f32(np.nan), 100), Contribution(f32(3.0), 1)]
    result = fedavg(xs, non_finite=NonFinitePolicy.DROP)
    assert result.values.tolist() == [2.0]
    assert result.used == (0, 2) and result.total_samples == 2
    assert [e.index for e in result.dropped] == [1]


def test_drop_policy_with_nothing_left_is_empty_input() -> None:
    with pytest.raises(EmptyInput):
        fedavg([Contribution(f32(np.nan), 1)], non_finite=NonFinitePolicy.DROP)


def test_propagate_policy_is_the_seed_behaviour() -> None:
    xs = [Contribution(f32(1.0, np.nan), 1), Contribution(f32(3.0, 1.0), 1)]
    result = fedavg(xs, non_finite=NonFinitePolicy.PROPAGATE)
    assert result.values[0] == 2.0 and np.isnan(result.values[1])


def test_overflow_of_finite_values_is_reported() -> None:
    xs = [Contribution(np.array([1e300]), 1), Contribution(np.array([1e300]), 1)]
    with pytest.raises(AggregateOverflow):
        fedavg(xs, dtype=np.float32)  # finite float64 values, too large for float32


def test_overflow_disappears_in_float64() -> None:
    big = float(np.finfo(np.float32).max)
    xs = [Contribution(f32(big), 1), Contribution(f32(big), 1)]
    assert fedavg(xs, dtype=np.float64).values.tolist() == [big]


# ── against a float64 reference ──────────────────────────────────────────────
_rows = weighted_float32_matrices(6, 20, 1e3, st.integers(0, 10_000))


@settings(max_examples=60, deadline=None)
@given(_rows)
def test_fedavg_matches_float64_reference(data: tuple[np.ndarray, list[int]]) -> None:
    matrix, samples = data
    result = fedavg([Contribution(row, n) for row, n in zip(matrix, samples, strict=True)])
    ref64 = matrix.astype(np.float64)
    total = sum(samples)
    if total:
        weights = np.array(samples, dtype=np.float64) / total
    else:
        weights = np.full(len(samples), 1.0 / len(samples))
    expected = weights @ ref64
    assert result.values.dtype == np.float32
    np.testing.assert_allclose(result.values, expected, rtol=1e-5, atol=1e-3)
