"""StreamingAccumulator: equal to batch FedAvg / mean, O(model) state, atomic adds."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.aggregate import f32, weighted_float32_matrices
from tensorswap.aggregate import (
    AggregateOverflow,
    AggregatorKind,
    Contribution,
    InvalidAggregatorOption,
    KeysMismatch,
    NonFinitePolicy,
    StreamingAccumulator,
    fedavg,
    mean,
)
from tensorswap.aggregate import streaming as streaming_module
from tensorswap.errors import AggregateShapeMismatch, DtypeMismatch, EmptyInput, NonFiniteValues

_batches = weighted_float32_matrices(6, 16, 1e3, st.sampled_from([0, 0, 1, 7, 300]))


@settings(max_examples=60, deadline=None)
@given(_batches)
def test_streaming_equals_batch_fedavg(data: tuple[np.ndarray, list[int]]) -> None:
    matrix, samples = data
    acc = StreamingAccumulator()
    for row, n in zip(matrix, samples, strict=True):
        assert acc.add(row, n)
    batch = fedavg([Contribution(r, n) for r, n in zip(matrix, samples, strict=True)])
    streamed = acc.result()
    np.testing.assert_allclose(streamed.values, batch.values, rtol=1e-5, atol=1e-3)
    assert streamed.total_samples == batch.total_samples
    assert streamed.used == batch.used


@settings(max_examples=40, deadline=None)
@given(_batches)
def test_streaming_mean_equals_batch_mean(data: tuple[np.ndarray, list[int]]) -> None:
    matrix, samples = data
    acc = StreamingAccumulator(AggregatorKind.MEAN)
    for row, n in zip(matrix, samples, strict=True):
        acc.add(row, n)
    expected = mean([Contribution(r, n) for r, n in zip(matrix, samples, strict=True)]).values
    np.testing.assert_allclose(acc.result().values, expected, rtol=1e-5, atol=1e-3)


def test_uniform_until_the_first_positive_count_then_weighted() -> None:
    acc = StreamingAccumulator()
    acc.add(f32(10.0), 0)
    acc.add(f32(20.0), 0)
    assert acc.result().values.tolist() == [15.0]
    acc.add(f32(1.0), 1)
    acc.add(f32(4.0), 2)
    acc.add(f32(1000.0), 0)
    assert acc.result().values.tolist() == [3.0]
    assert acc.count == 5 and acc.total_samples == 3


def test_memory_does_not_grow_with_contributions() -> None:
    acc = StreamingAccumulator()
    sizes = []
    for i in range(20):
        acc.add({"w": np.full((64, 64), i, np.float32), "b": f32(i)}, 1 + i % 3)
        sizes.append(acc.nbytes)
    model = (64 * 64 + 1) * 4
    assert len(set(sizes[1:])) == 1
    assert sizes[-1] <= model + streaming_module.FOLD_CHUNK * 4


def test_result_is_fresh_and_accumulation_continues() -> None:
    acc = StreamingAccumulator()
    acc.add(f32(2.0), 1)
    first = acc.result().values
    first[0] = -1.0
    acc.add(f32(4.0), 1)
    assert acc.result().values.tolist() == [3.0]


@settings(max_examples=30, deadline=None)
@given(_batches)
def test_a_consumed_result_has_the_same_bits_and_empties_the_accumulator(
    data: tuple[np.ndarray, list[int]],
) -> None:
    rows, counts = data
    kept, spent = StreamingAccumulator(), StreamingAccumulator()
    for row, n in zip(rows, counts, strict=True):
        kept.add({"w": row}, n)
        spent.add({"w": row}, n)
    want = kept.result()
    got = spent.result(consume=True)
    assert got.values["w"].tobytes() == want.values["w"].tobytes()
    assert (got.used, got.total_samples) == (want.used, want.total_samples)
    assert spent.count == 0 and spent.nbytes == 0 and spent.layout is None
    with pytest.raises(EmptyInput):
        spent.result()
    spent.add({"other": f32(1.0, 3.0)}, 1)  # as new: any layout again
    assert spent.result().values["other"].tolist() == [1.0, 3.0]


def test_a_consumed_result_that_overflows_still_empties_the_accumulator() -> None:
    acc = StreamingAccumulator(AggregatorKind.MEAN)
    big = np.float32(3e38)
    acc.add(f32(big), 0)
    acc.add(f32(big), 0)
    with pytest.raises(AggregateOverflow):
        acc.result(consume=True)
    assert acc.count == 0


def test_mapping_contributions() -> None:
    acc = StreamingAccumulator()
    acc.add({"w": f32(1.0, 1.0), "b": f32(0.0)}, 1)
    acc.add({"b": f32(3.0), "w": f32(3.0, 5.0)}, 3)
    values = acc.result().values
    assert values["w"].tolist() == [2.5, 4.0] and values["b"].tolist() == [2.25]


def test_empty_accumulator_has_no_result() -> None:
    with pytest.raises(EmptyInput):
        StreamingAccumulator().result()


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        (f32(1.0, 2.0, 3.0), AggregateShapeMismatch),
        (np.array([1.0, 2.0]), DtypeMismatch),
        ({"w": f32(1.0, 2.0)}, KeysMismatch),
        (f32(np.nan, 1.0), NonFiniteValues),
    ],
)
def test_a_rejected_add_leaves_the_accumulator_unchanged(bad: object, error: type) -> None:
    acc = StreamingAccumulator()
    acc.add(f32(1.0, 2.0), 2)
    before = acc.result()
    with pytest.raises(error):
        acc.add(bad, 5)
    after = acc.result()
    assert np.array_equal(after.values, before.values)
    assert (acc.count, acc.total_samples) == (1, 2)
    acc.add(f32(3.0, 4.0), 2)
    assert acc.result().used == (0, 1)


def test_first_add_rejected_fixes_no_layout() -> None:
    acc = StreamingAccumulator()
    with pytest.raises(NonFiniteValues):
        acc.add(f32(np.inf), 1)
    acc.add(f32(1.0, 2.0), 1)
    assert acc.result().values.tolist() == [1.0, 2.0]


def test_drop_policy_reports_and_skips() -> None:
    acc = StreamingAccumulator(non_finite=NonFinitePolicy.DROP)
    assert acc.add(f32(1.0), 1)
    assert not acc.add(f32(np.nan), 100)
    assert acc.add(f32(3.0), 1)
    result = acc.result()
    assert result.values.tolist() == [2.0]
    assert result.used == (0, 2) and [e.index for e in result.dropped] == [1]


def test_all_dropped_is_empty_input() -> None:
    acc = StreamingAccumulator(non_finite=NonFinitePolicy.DROP)
    acc.add(f32(np.nan), 1)
    with pytest.raises(EmptyInput, match="dropped"):
        acc.result()


def test_clipping_scales_before_folding() -> None:
    acc = StreamingAccumulator(AggregatorKind.MEAN, max_norm=1.0)
    acc.add(f32(3.0, 4.0))  # norm 5 -> scaled to (0.6, 0.8)
    acc.add(f32(0.0, 0.5))  # within the bound
    np.testing.assert_allclose(acc.result().values, [0.3, 0.65], rtol=1e-6)


def test_float32_overflow_is_reported_and_float64_avoids_it() -> None:
    # Finite float64 values beyond float32's range, accumulated in float32 as asked (batch
    # FedAvg overflows on them too; n * values alone no longer can, see the 2**64 test).
    big = 1e300
    acc = StreamingAccumulator(dtype="float32")
    acc.add(np.array([big]), 10)
    with pytest.raises(AggregateOverflow):
        acc.result()
    acc64 = StreamingAccumulator(dtype="float64")
    acc64.add(np.array([big]), 10)
    assert acc64.result().values.tolist() == [pytest.approx(big)]


def test_huge_sample_counts_do_not_overflow_where_batch_fedavg_does_not() -> None:
    big = float(np.finfo(np.float32).max) / 2
    top = 2**64 - 1
    cases = [
        [(f32(1e20, -3.0), top), (f32(0.0, 1.0), 1)],  # 2**64 * 1e20 is beyond float32
        [(f32(big, 1.0), 10), (f32(big, -1.0), 30)],  # 10 * big already is
        [(f32(1e30, 2.0), top), (f32(3e30, -2.0), top), (f32(5e30, 0.5), top)],  # total > 2**64
        [(f32(1.0, -1.0), 1), (f32(2.0, 3e30), 2**20), (f32(1e20, 4.0), top)],  # rescaled twice
    ]
    for contributions in cases:
        acc = StreamingAccumulator()
        for values, n in contributions:
            acc.add(values, n)
        batch = fedavg([Contribution(v, n) for v, n in contributions])
        np.testing.assert_allclose(acc.result().values, batch.values, rtol=1e-6)
        assert acc.total_samples == batch.total_samples


def test_rescaled_sums_equal_batch_fedavg(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(streaming_module, "HEADROOM_BITS", 0)  # rescale whenever Σ n passes R
    monkeypatch.setattr(streaming_module, "FOLD_CHUNK", 3)
    rng = np.random.default_rng(7)
    for _ in range(20):
        k = int(rng.integers(1, 8))
        rows = rng.standard_normal((k, 10)).astype(np.float32)
        choices = [0, 1, 3, 1000, 2**40, 2**64 - 1]
        counts = [choices[i] for i in rng.integers(0, len(choices), size=k)]
        acc = StreamingAccumulator()
        for row, n in zip(rows, counts, strict=True):
            acc.add(row, n)
        batch = fedavg([Contribution(r, n) for r, n in zip(rows, counts, strict=True)])
        np.testing.assert_allclose(acc.result().values, batch.values, rtol=1e-5, atol=1e-6)


def test_float32_sums_stay_float32() -> None:
    acc = StreamingAccumulator()
    acc.add(np.array([1.0], np.float16), 3)
    assert acc.result().values.dtype == np.float32


def test_only_mean_kinds_stream() -> None:
    with pytest.raises(InvalidAggregatorOption):
        StreamingAccumulator(AggregatorKind.MEDIAN)


def test_torch_tensors_can_be_added() -> None:
    torch = pytest.importorskip("torch")
    acc = StreamingAccumulator()
    acc.add(torch.tensor([0.0, 0.0]), 100)
    acc.add(torch.tensor([2.0, 4.0]), 300)
    assert acc.result().values.tolist() == [1.5, 3.0]


def test_folding_spans_several_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(streaming_module, "FOLD_CHUNK", 3)
    rows = [np.arange(10, dtype=np.float32) * (i + 1) for i in range(3)]
    acc = StreamingAccumulator()
    for i, row in enumerate(rows):
        acc.add(row, i + 1)
    expected = (rows[0] * 1 + rows[1] * 2 + rows[2] * 3) / 6
    np.testing.assert_allclose(acc.result().values, expected, rtol=1e-6)
