"""ContributionMatrix: receiving contributions into rows of one preallocated matrix."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.aggregate import f32
from tensorswap.aggregate import (
    Contribution,
    ContributionMatrix,
    InvalidAggregatorOption,
    InvalidRow,
    KeysMismatch,
    NonFinitePolicy,
    RowAlreadyFilled,
    fedavg,
    krum,
    mean,
    median,
)
from tensorswap.errors import AggregateShapeMismatch, DtypeMismatch, EmptyInput, NonFiniteValues


def test_seed_weighted_example_through_the_matrix() -> None:
    m = ContributionMatrix(2, 2)
    m.fill(0, f32(0.0, 0.0), 100)
    m.fill(1, f32(2.0, 4.0), 300)
    assert fedavg(m).values.tolist() == [1.5, 3.0]


def test_rows_are_views_that_can_be_written_in_place() -> None:
    m = ContributionMatrix(3, (2, 2))
    m.row(0)[:] = [1, 2, 3, 4]
    m.tensor(1)[...] = [[3, 4], [5, 6]]
    m.commit(0, 1)
    m.commit(1, 1)
    assert fedavg(m).values.tolist() == [[2.0, 3.0], [4.0, 5.0]]
    assert np.shares_memory(m.row(2), m.matrix)


def test_named_layout_places_tensors_back_to_back() -> None:
    m = ContributionMatrix(2, {"w": (2,), "b": (1,)})
    m.fill(0, {"b": f32(9.0), "w": f32(1.0, 2.0)}, 1)
    assert m.row(0).tolist() == [1.0, 2.0, 9.0]
    assert m.tensor(0, "b").tolist() == [9.0]


def test_only_committed_rows_are_aggregated_in_any_order() -> None:
    m = ContributionMatrix(4, 1)
    m.row(1)[:] = np.nan  # written but never committed: ignored
    m.fill(3, f32(6.0), 1)
    m.fill(0, f32(2.0), 1)
    result = mean(m)
    assert result.values.tolist() == [4.0] and result.used == (0, 3)


def test_prefix_and_scattered_rows_agree() -> None:
    rng = np.random.default_rng(3)
    rows = rng.standard_normal((3, 50)).astype(np.float32)
    samples = [5, 1, 9]
    prefix = ContributionMatrix(3, 50)
    scattered = ContributionMatrix(6, 50)
    for i, (row, n) in enumerate(zip(rows, samples, strict=True)):
        prefix.fill(i, row, n)
        scattered.fill(2 * i + 1, row, n)
    listed = fedavg([Contribution(r, n) for r, n in zip(rows, samples, strict=True)])
    np.testing.assert_allclose(fedavg(prefix).values, listed.values, rtol=1e-6)
    np.testing.assert_allclose(fedavg(scattered).values, listed.values, rtol=1e-6)
    assert fedavg(scattered).used == (1, 3, 5)


def test_robust_aggregators_accept_a_matrix() -> None:
    m = ContributionMatrix(3, {"w": (2,)})
    for i, v in enumerate([1.0, 2.0, 30.0]):
        m.fill(i, {"w": f32(v, v)}, 1)
    assert median(m).values["w"].tolist() == [2.0, 2.0]
    assert krum(m, byzantine=0).used == (0,)


def test_a_row_counts_once() -> None:
    m = ContributionMatrix(2, 1)
    m.fill(0, f32(1.0), 1)
    with pytest.raises(RowAlreadyFilled):
        m.fill(0, f32(5.0), 1)
    with pytest.raises(RowAlreadyFilled):
        m.commit(0, 1)
    assert m.row(0).tolist() == [1.0]


def test_discard_frees_a_row() -> None:
    m = ContributionMatrix(2, 1)
    m.fill(0, f32(1.0), 1)
    m.discard(0)
    assert m.count == 0 and m.num_samples(0) is None
    m.fill(0, f32(7.0), 2)
    assert fedavg(m).values.tolist() == [7.0]


def test_fill_validates_before_writing() -> None:
    m = ContributionMatrix(1, {"w": (2,)})
    m.row(0)[:] = [4.0, 4.0]
    with pytest.raises(AggregateShapeMismatch):
        m.fill(0, {"w": f32(1.0)}, 1)
    with pytest.raises(DtypeMismatch):
        m.fill(0, {"w": np.array([1.0, 2.0])}, 1)
    with pytest.raises(KeysMismatch):
        m.fill(0, f32(1.0, 2.0), 1)
    assert m.row(0).tolist() == [4.0, 4.0] and m.count == 0


def test_rows_outside_the_matrix() -> None:
    m = ContributionMatrix(2, 1)
    for bad in (-1, 2, True):
        with pytest.raises(InvalidRow):
            m.row(bad)  # type: ignore[arg-type]
    with pytest.raises(IndexError):
        m.commit(5, 1)


def test_nothing_committed_is_empty_input() -> None:
    with pytest.raises(EmptyInput):
        fedavg(ContributionMatrix(2, 3))


def test_non_finite_rows_are_named_by_row_index() -> None:
    m = ContributionMatrix(3, 2)
    m.fill(0, f32(1.0, 1.0), 1)
    m.fill(2, f32(np.inf, 1.0), 1)
    with pytest.raises(NonFiniteValues) as info:
        fedavg(m)
    assert info.value.index == 2
    result = fedavg(m, non_finite=NonFinitePolicy.DROP)
    assert result.used == (0,) and [e.index for e in result.dropped] == [2]


def test_float64_accumulation_of_a_float32_matrix() -> None:
    m = ContributionMatrix(3, 1)
    for i in range(3):
        m.fill(i, f32(1.0 / 3.0 + i), 1)
    assert fedavg(m, dtype="float64").values.dtype == np.float64


def test_matrix_options_are_validated() -> None:
    with pytest.raises(InvalidAggregatorOption):
        ContributionMatrix(0, 3)
    with pytest.raises(InvalidAggregatorOption):
        ContributionMatrix(2, 3, dtype=np.int32)
    with pytest.raises(InvalidAggregatorOption):
        ContributionMatrix(2, (-1,))
