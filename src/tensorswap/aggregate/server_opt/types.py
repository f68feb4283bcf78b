"""Server-optimizer domain types: the kinds, their hyper-parameters (validated) and errors.

Errors (all AggregationError, so all ValueError)::

    InvalidServerOptimizer       an unknown kind or hyper-parameter, or one out of range
    InvalidServerRound           server_round is not an int >= 1
    InvalidServerStepInput       current / aggregate differ in names, shapes, or are not float
    ServerOptimizerStateMismatch a state to load, or the loaded state, does not fit the model
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from enum import Enum
from typing import Any

from tensorswap.errors import AggregationError


class InvalidServerOptimizer(AggregationError):
    """An unknown server-optimizer kind or hyper-parameter, or a value out of its range."""

    def __init__(self, option: str, value: object, reason: str) -> None:
        self.option = option
        self.value = value
        self.reason = reason
        super().__init__(f"invalid server optimizer {option}={value!r}: {reason}")


class InvalidServerRound(AggregationError):
    """server_round is not an int >= 1 (Flower numbers rounds from 1)."""

    def __init__(self, value: object) -> None:
        self.value = value
        super().__init__(f"server_round must be an int >= 1, got {value!r}")


class InvalidServerStepInput(AggregationError):
    """The current model and the aggregate do not fit each other (names, shapes, dtypes)."""

    def __init__(self, name: str | None, reason: str) -> None:
        self.name = name
        self.reason = reason
        where = f"tensor {name!r}: " if name is not None else ""
        super().__init__(f"server optimizer step: {where}{reason}")


class ServerOptimizerStateMismatch(AggregationError):
    """An optimizer state (loaded or kept) does not fit its kind or the model it is used on."""

    def __init__(self, name: str | None, reason: str) -> None:
        self.name = name
        self.reason = reason
        where = f"{name!r}: " if name is not None else ""
        super().__init__(f"server optimizer state {where}{reason}")


class ServerOptimizerKind(Enum):
    """Every server optimizer tensorswap implements (the registry covers each one)."""

    FEDAVG = "fedavg"  # new global = aggregate
    FEDAVGM = "fedavgm"  # SGD with heavy-ball momentum on current - aggregate (Flower FedAvgM)
    FEDADAM = "fedadam"  # Adam on aggregate - current, bias-corrected step (Flower FedAdam)
    FEDYOGI = "fedyogi"  # Yogi's sign-controlled second moment (Flower FedYogi)
    FEDADAGRAD = "fedadagrad"  # summed squared deltas (Flower FedAdagrad)
    NESTEROV = "nesterov"  # DiLoCo's outer step: SGD, Nesterov momentum, on current - aggregate


def _real(option: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidServerOptimizer(option, value, "must be a real number")
    out = float(value)
    if not math.isfinite(out):
        raise InvalidServerOptimizer(option, value, "must be finite")
    return out


def _positive(option: str, value: object) -> None:
    if _real(option, value) <= 0.0:
        raise InvalidServerOptimizer(option, value, "must be > 0")


def _unit(option: str, value: object) -> None:
    """0 <= value < 1 (a decay rate: 1 would never forget, and FedAdam divides by 1 - beta)."""
    x = _real(option, value)
    if not 0.0 <= x < 1.0:
        raise InvalidServerOptimizer(option, value, "must be in [0, 1)")


@dataclass(frozen=True)
class FedAvgHyper:
    """FedAvg has no server-side hyper-parameters: the aggregate becomes the global model."""


@dataclass(frozen=True)
class FedAvgMHyper:
    """Flower FedAvgM's server_learning_rate (> 0) and server_momentum (in [0, 1))."""

    server_learning_rate: float = 1.0
    server_momentum: float = 0.0

    def __post_init__(self) -> None:
        _positive("server_learning_rate", self.server_learning_rate)
        _unit("server_momentum", self.server_momentum)


@dataclass(frozen=True)
class _FedOptHyper:
    """Flower FedOpt's eta (server rate), eta_l (client rate), beta_1, beta_2 and tau."""

    eta: float
    eta_l: float
    beta_1: float
    beta_2: float
    tau: float

    def __post_init__(self) -> None:
        _positive("eta", self.eta)
        _positive("eta_l", self.eta_l)
        _unit("beta_1", self.beta_1)
        _unit("beta_2", self.beta_2)
        _positive("tau", self.tau)


@dataclass(frozen=True)
class FedAdamHyper(_FedOptHyper):
    """Defaults of flwr.serverapp.strategy.FedAdam (Flower 1.42)."""

    eta: float = 1e-1
    eta_l: float = 1e-1
    beta_1: float = 0.9
    beta_2: float = 0.99
    tau: float = 1e-3


@dataclass(frozen=True)
class FedYogiHyper(_FedOptHyper):
    """Defaults of flwr.serverapp.strategy.FedYogi (Flower 1.42)."""

    eta: float = 1e-2
    eta_l: float = 0.0316
    beta_1: float = 0.9
    beta_2: float = 0.99
    tau: float = 1e-3


@dataclass(frozen=True)
class FedAdagradHyper:
    """Defaults of flwr.serverapp.strategy.FedAdagrad (Flower 1.42; beta_1 = beta_2 = 0 fixed)."""

    eta: float = 1e-1
    eta_l: float = 1e-1
    tau: float = 1e-3

    def __post_init__(self) -> None:
        _positive("eta", self.eta)
        _positive("eta_l", self.eta_l)
        _positive("tau", self.tau)


@dataclass(frozen=True)
class NesterovHyper:
    """DiLoCo's outer optimizer: lr (> 0) and momentum (in [0, 1)); DiLoCo uses 0.7 and 0.9."""

    lr: float = 0.7
    momentum: float = 0.9

    def __post_init__(self) -> None:
        _positive("lr", self.lr)
        _unit("momentum", self.momentum)


Hyper = FedAvgHyper | FedAvgMHyper | FedAdamHyper | FedYogiHyper | FedAdagradHyper | NesterovHyper

HYPER_TYPES: dict[ServerOptimizerKind, type[Any]] = {
    ServerOptimizerKind.FEDAVG: FedAvgHyper,
    ServerOptimizerKind.FEDAVGM: FedAvgMHyper,
    ServerOptimizerKind.FEDADAM: FedAdamHyper,
    ServerOptimizerKind.FEDYOGI: FedYogiHyper,
    ServerOptimizerKind.FEDADAGRAD: FedAdagradHyper,
    ServerOptimizerKind.NESTEROV: NesterovHyper,
}


def coerce_kind(kind: object) -> ServerOptimizerKind:
    """A ServerOptimizerKind from itself or its value ('fedadam')."""
    if isinstance(kind, ServerOptimizerKind):
        return kind
    if isinstance(kind, str):
        try:
            return ServerOptimizerKind(kind.lower())
        except ValueError:
            pass
    known = ", ".join(k.value for k in ServerOptimizerKind)
    raise InvalidServerOptimizer("kind", kind, f"unknown kind; known: {known}")


def make_hyper(kind: ServerOptimizerKind, hyper: dict[str, object]) -> Hyper:
    """The kind's hyper-parameters from keyword values (defaults for the rest), validated."""
    cls = HYPER_TYPES[kind]
    names = {f.name for f in fields(cls)}
    for name in hyper:
        if name not in names:
            allowed = ", ".join(sorted(names)) or "none"
            raise InvalidServerOptimizer(
                name, hyper[name], f"not a {kind.value} option ({allowed})"
            )
    result: Hyper = cls(**hyper)
    return result
