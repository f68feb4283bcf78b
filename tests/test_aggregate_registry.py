"""The aggregator registry, AggregatorSpec validation and the package's public names."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from tensorswap.aggregate import (
    REGISTRY,
    AggregatorKind,
    AggregatorSpec,
    Contribution,
    InvalidAggregatorOption,
    aggregate,
)

# `import tensorswap.aggregate as agg` would give the function re-exported by tensorswap
agg = importlib.import_module("tensorswap.aggregate")


def _contributions() -> list[Contribution]:
    return [Contribution(np.full(3, float(i), np.float32), i + 1) for i in range(5)]


def test_every_kind_has_an_implementation() -> None:
    assert set(REGISTRY) == set(AggregatorKind)


@pytest.mark.parametrize("kind", list(AggregatorKind))
def test_every_kind_aggregates_through_one_call(kind: AggregatorKind) -> None:
    result = aggregate(_contributions(), AggregatorSpec(kind))
    assert result.kind is kind
    assert result.values.shape == (3,) and result.values.dtype == np.float32


def test_default_spec_is_fedavg() -> None:
    result = aggregate(_contributions())
    assert result.kind is AggregatorKind.FEDAVG
    assert result.values[0] == pytest.approx(sum(i * (i + 1) for i in range(5)) / 15)


@pytest.mark.parametrize(
    "options",
    [
        {"kind": AggregatorKind.FEDAVG, "byzantine": 1},
        {"kind": AggregatorKind.KRUM, "select": 2},
        {"kind": AggregatorKind.MEDIAN, "trim_count": 1},
        {"kind": AggregatorKind.MEAN, "trim_fraction": 0.1},
        {"kind": AggregatorKind.KRUM, "byzantine": -1},
        {"kind": AggregatorKind.MULTI_KRUM, "select": 0},
        {"kind": AggregatorKind.TRIMMED_MEAN, "trim_fraction": -0.1},
        {"dtype": "float16"},
        {"dtype": "int32"},
        {"dtype": "not a dtype"},
        {"kind": "fedavg"},
        {"non_finite": "raise"},
    ],
)
def test_spec_rejects_inapplicable_or_out_of_range_options(options: dict) -> None:
    with pytest.raises(InvalidAggregatorOption):
        AggregatorSpec(**options)


def test_spec_normalizes_the_dtype() -> None:
    assert AggregatorSpec(dtype="float64").dtype == np.dtype(np.float64)


def test_contributions_must_be_a_sequence() -> None:
    with pytest.raises(agg.InvalidContribution):
        aggregate({"a": Contribution(np.ones(1, np.float32), 1)})  # type: ignore[arg-type]


def test_public_names_import() -> None:
    for name in agg.__all__:
        assert getattr(agg, name) is not None
