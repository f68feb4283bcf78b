"""Aggregation: FedAvg, the mean, robust aggregators, norm clipping and streaming accumulation."""

from __future__ import annotations

from tensorswap.aggregate.clip import AggregateOverflow, clip_contributions, l2_norms
from tensorswap.aggregate.matrix import ContributionMatrix, InvalidRow, RowAlreadyFilled
from tensorswap.aggregate.registry import (
    REGISTRY,
    aggregate,
    fedavg,
    krum,
    mean,
    median,
    multi_krum,
    trimmed_mean,
)
from tensorswap.aggregate.robust import TooFewContributions
from tensorswap.aggregate.streaming import StreamingAccumulator
from tensorswap.aggregate.types import (
    AggregateResult,
    AggregatorKind,
    AggregatorSpec,
    Contribution,
    InvalidAggregatorOption,
    Layout,
    NonFinitePolicy,
)
from tensorswap.aggregate.validate import (
    InvalidContribution,
    InvalidNumSamples,
    KeysMismatch,
    UnsupportedAggregateDtype,
)

__all__ = [
    "REGISTRY",
    "AggregateOverflow",
    "AggregateResult",
    "AggregatorKind",
    "AggregatorSpec",
    "Contribution",
    "ContributionMatrix",
    "InvalidAggregatorOption",
    "InvalidContribution",
    "InvalidNumSamples",
    "InvalidRow",
    "KeysMismatch",
    "Layout",
    "NonFinitePolicy",
    "RowAlreadyFilled",
    "StreamingAccumulator",
    "TooFewContributions",
    "UnsupportedAggregateDtype",
    "aggregate",
    "clip_contributions",
    "fedavg",
    "krum",
    "l2_norms",
    "mean",
    "median",
    "multi_krum",
    "trimmed_mean",
]
