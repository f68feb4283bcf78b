"""Aggregation: FedAvg, the mean, robust aggregators, norm clipping, streaming accumulation and
server optimizers."""

from __future__ import annotations

from tensorswap.aggregate._kernels import quiet
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
from tensorswap.aggregate.server_opt import (
    SERVER_OPTIMIZERS,
    FedAdagradHyper,
    FedAdamHyper,
    FedAvgHyper,
    FedAvgMHyper,
    FedYogiHyper,
    InvalidServerOptimizer,
    InvalidServerRound,
    InvalidServerStepInput,
    NesterovHyper,
    ServerOptimizer,
    ServerOptimizerKind,
    ServerOptimizerStateMismatch,
    server_optimizer,
)
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
    "SERVER_OPTIMIZERS",
    "AggregateOverflow",
    "AggregateResult",
    "AggregatorKind",
    "AggregatorSpec",
    "Contribution",
    "ContributionMatrix",
    "FedAdagradHyper",
    "FedAdamHyper",
    "FedAvgHyper",
    "FedAvgMHyper",
    "FedYogiHyper",
    "InvalidAggregatorOption",
    "InvalidContribution",
    "InvalidNumSamples",
    "InvalidRow",
    "InvalidServerOptimizer",
    "InvalidServerRound",
    "InvalidServerStepInput",
    "KeysMismatch",
    "Layout",
    "NesterovHyper",
    "NonFinitePolicy",
    "RowAlreadyFilled",
    "ServerOptimizer",
    "ServerOptimizerKind",
    "ServerOptimizerStateMismatch",
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
    "quiet",
    "server_optimizer",
    "trimmed_mean",
]
