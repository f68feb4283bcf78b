"""What a simulation runs: clients, sampling, rounds, the task, the backend, where it writes."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tensorswap.runs.errors import InvalidRunSpec
from tensorswap.runs.model import RunSpec
from tensorswap.runs.step import check_policies
from tensorswap.simulate.errors import InvalidSimulation

__all__ = ["BACKENDS", "DIGITS_MAX_CLIENTS", "TASKS", "SimConfig"]

BACKENDS = ("process", "ray")
TASKS = ("auto", "digits", "synthetic")
DIGITS_MAX_CLIENTS = 200
"""``--task auto`` trains the demo's digits MLP up to this many clients (each needs a shard
of the 1,347 training images), the synthetic task above it or with ``--model-mib``."""
MAX_CLIENTS = 1_000_000
MAX_MODEL_MIB = 4096.0


@dataclass(frozen=True)
class SimConfig:
    """One simulation. ``workers`` None: one per CPU core (at most 8, at most one per
    client). ``model_mib``: the synthetic model's size (default 1 MiB). ``data``: the
    coordinator's data directory (default ``out/coordinator``; emptied first)."""

    clients: int
    per_round: int
    rounds: int
    model_mib: float | None = None
    task: str = "auto"
    backend: str = "process"
    workers: int | None = None
    out: Path = field(default_factory=lambda: Path("simulate-out"))
    data: Path | None = None
    seed: int = 0
    local_epochs: int = 2
    lr: float = 0.5
    round_timeout_s: float = 600.0
    ray_address: str | None = None
    listen: str = "127.0.0.1:0"
    advertise: str | None = None
    connections: int = 2
    chunk: int = 16
    keep_rounds: int = 1
    strategy: str = "fedavg"
    params: Mapping[str, float | int | str] = field(default_factory=dict)
    optimizer: str = "fedavg"
    optimizer_params: Mapping[str, float] = field(default_factory=dict)
    """Rounds whose blocks the coordinator keeps (0: every round's, as ``serve`` does)."""

    def __post_init__(self) -> None:
        for name in ("clients", "per_round", "rounds", "local_epochs", "connections", "chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidSimulation(f"{name} must be a whole number >= 1, got {value!r}")
        if self.clients > MAX_CLIENTS:
            raise InvalidSimulation(f"at most {MAX_CLIENTS:,} clients, got {self.clients:,}")
        if self.per_round > self.clients:
            raise InvalidSimulation(
                f"cannot sample {self.per_round} clients per round of {self.clients}"
            )
        if self.backend not in BACKENDS:
            raise InvalidSimulation(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.task not in TASKS:
            raise InvalidSimulation(f"task must be one of {TASKS}, got {self.task!r}")
        if self.model_mib is not None and not (
            math.isfinite(self.model_mib) and 0 < self.model_mib <= MAX_MODEL_MIB
        ):
            raise InvalidSimulation(
                f"model_mib must be > 0 and <= {MAX_MODEL_MIB:g}, got {self.model_mib!r}"
            )
        if self.task == "digits" and self.model_mib is not None:
            raise InvalidSimulation("--model-mib sizes the synthetic task, not the digits MLP")
        if self.task == "digits" and self.clients > DIGITS_MAX_CLIENTS:
            raise InvalidSimulation(
                f"the digits task has data for at most {DIGITS_MAX_CLIENTS} clients; "
                f"use --task synthetic for {self.clients:,}"
            )
        if self.workers is not None and (
            isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1
        ):
            raise InvalidSimulation(f"workers must be a whole number >= 1, got {self.workers!r}")
        if not (math.isfinite(self.lr) and 0 < self.lr <= 1):
            raise InvalidSimulation(f"lr must be in (0, 1], got {self.lr!r}")
        if not (math.isfinite(self.round_timeout_s) and self.round_timeout_s > 0):
            raise InvalidSimulation(f"round timeout must be > 0, got {self.round_timeout_s!r}")
        if (
            isinstance(self.keep_rounds, bool)
            or not isinstance(self.keep_rounds, int)
            or (self.keep_rounds < 0)
        ):
            raise InvalidSimulation(
                f"keep_rounds must be a whole number >= 0, got {self.keep_rounds!r}"
            )
        if self.ray_address is not None and self.backend != "ray":
            raise InvalidSimulation("--ray-address is for --backend ray")
        self.run_spec()  # the strategy and server optimizer exist, with those options

    def run_spec(self) -> RunSpec:
        """The sync run the driver creates: ``per_round`` sampled of every client, all of
        them needed (quorum 1), aggregated by ``strategy`` and stepped by ``optimizer``."""
        try:
            spec = RunSpec(
                per_round=self.per_round,
                min_clients=self.per_round,
                rounds=self.rounds,
                seed=self.seed,
                quorum=1.0,
                strategy=self.strategy,
                params=dict(self.params),
                optimizer=self.optimizer,
                optimizer_params=dict(self.optimizer_params),
            )
            check_policies(spec)
        except InvalidRunSpec as exc:
            raise InvalidSimulation(str(exc)) from None
        return spec

    @property
    def resolved_task(self) -> str:
        if self.task != "auto":
            return self.task
        if self.model_mib is None and self.clients <= DIGITS_MAX_CLIENTS:
            return "digits"
        return "synthetic"

    @property
    def resolved_workers(self) -> int:
        wanted = self.workers or min(8, os.cpu_count() or 1)
        return max(1, min(wanted, self.clients))

    def task_spec(self) -> dict[str, Any]:
        """The task as JSON: what every worker (and the driver) builds its copy from."""
        return {
            "task": self.resolved_task,
            "clients": self.clients,
            "model_mib": self.model_mib if self.model_mib is not None else 1.0,
            "seed": self.seed,
            "epochs": self.local_epochs,
            "lr": self.lr,
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "clients": self.clients,
            "per_round": self.per_round,
            "rounds": self.rounds,
            "task": self.resolved_task,
            "model_mib": self.model_mib,
            "backend": self.backend,
            "workers": self.resolved_workers,
            "seed": self.seed,
            "local_epochs": self.local_epochs,
            "lr": self.lr,
            "ray_address": self.ray_address,
            "strategy": self.strategy,
            "params": dict(self.params),
            "optimizer": self.optimizer,
            "optimizer_params": dict(self.optimizer_params),
        }
