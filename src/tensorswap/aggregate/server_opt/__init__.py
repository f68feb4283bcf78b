"""Server optimizers: FedAvg, FedAvgM, FedAdam, FedYogi, FedAdagrad (Flower 1.42), Nesterov."""

from __future__ import annotations

from tensorswap.aggregate.server_opt.optimizer import (
    SERVER_OPTIMIZERS,
    ServerOptimizer,
    server_optimizer,
)
from tensorswap.aggregate.server_opt.types import (
    FedAdagradHyper,
    FedAdamHyper,
    FedAvgHyper,
    FedAvgMHyper,
    FedYogiHyper,
    InvalidServerOptimizer,
    InvalidServerRound,
    InvalidServerStepInput,
    NesterovHyper,
    ServerOptimizerKind,
    ServerOptimizerStateMismatch,
)

__all__ = [
    "SERVER_OPTIMIZERS",
    "FedAdagradHyper",
    "FedAdamHyper",
    "FedAvgHyper",
    "FedAvgMHyper",
    "FedYogiHyper",
    "InvalidServerOptimizer",
    "InvalidServerRound",
    "InvalidServerStepInput",
    "NesterovHyper",
    "ServerOptimizer",
    "ServerOptimizerKind",
    "ServerOptimizerStateMismatch",
    "server_optimizer",
]
