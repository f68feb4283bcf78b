"""The learning tasks of a simulation: the demo's digits MLP, or a synthetic model of any size.

Both are deterministic for a seed: client ``i`` always has the same data, so a simulation
can be repeated and compared. The synthetic task gives each client a quadratic objective
``0.5 * mean((w - c_i)^2)`` around its own target ``c_i = c* + noise_i``; local training
is ``epochs`` steps of gradient descent, FedAvg of the clients' models moves the global one
towards ``c*``, and the reported loss is the global model's distance to ``c*``. A client's
noise is a window of one shared random array (``NOISE_OFFSETS`` longer than the model),
starting at an offset drawn from the client's index: each client's update is a real,
distinct tensor, and a client costs a few passes over the model, no random draw, so
thousands of clients and models of many MiB stay cheap (a simulation measures the engine).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from tensorswap.simulate.errors import InvalidSimulation

__all__ = ["DigitsTask", "SimTask", "SyntheticTask", "make_task"]

COLUMNS = 256
NOISE_OFFSETS = 1 << 16


class SimTask(Protocol):
    metric: str  # "accuracy" or "loss"

    def initial(self) -> dict[str, np.ndarray]: ...

    def num_samples(self, client: int) -> int: ...

    def train(
        self, client: int, round: int, tensors: Mapping[str, np.ndarray]
    ) -> tuple[dict[str, np.ndarray], float]: ...

    def evaluate(self, tensors: Mapping[str, np.ndarray]) -> float: ...


class SyntheticTask:
    """A ``model_mib`` MiB float32 model (one ``weight`` of shape (rows, 256))."""

    metric = "loss"

    def __init__(
        self, clients: int, model_mib: float, seed: int, *, epochs: int = 2, lr: float = 0.5
    ) -> None:
        self.clients, self.seed, self.epochs, self.lr = clients, seed, epochs, lr
        self.shape = (max(1, round(model_mib * 1024 * 1024 / 4 / COLUMNS)), COLUMNS)
        rng = np.random.default_rng([seed, 0x5EED])
        self.optimum = rng.standard_normal(self.shape, dtype=np.float32)
        self.size = self.shape[0] * self.shape[1]
        self.noise = rng.standard_normal(self.size + NOISE_OFFSETS, dtype=np.float32)

    def initial(self) -> dict[str, np.ndarray]:
        return {"weight": np.zeros(self.shape, np.float32)}

    def num_samples(self, client: int) -> int:
        return 16 + (client * 7919) % 64

    def target(self, client: int) -> np.ndarray:
        """Client ``client``'s optimum: ``c*`` plus its window of the shared noise."""
        at = (client * 7919 + 17) % NOISE_OFFSETS
        return self.optimum + self.noise[at : at + self.size].reshape(self.shape)

    def train(
        self, client: int, round: int, tensors: Mapping[str, np.ndarray]
    ) -> tuple[dict[str, np.ndarray], float]:
        w = np.array(_weight(tensors, self.shape), dtype=np.float32)
        c = self.target(client)
        losses = []
        for _ in range(self.epochs):
            diff = w - c  # the gradient of 0.5 * |w - c|^2
            losses.append(0.5 * float(np.mean(np.square(diff))))
            diff *= np.float32(self.lr)
            w -= diff
        return {"weight": w}, float(np.mean(losses))

    def evaluate(self, tensors: Mapping[str, np.ndarray]) -> float:
        w = _weight(tensors, self.shape)
        return 0.5 * float(np.mean(np.square(w - self.optimum)))


def _weight(tensors: Mapping[str, np.ndarray], shape: tuple[int, int]) -> np.ndarray:
    w = tensors.get("weight")
    if w is None or tuple(np.shape(w)) != shape:
        got = None if w is None else tuple(np.shape(w))
        raise InvalidSimulation(f"the synthetic model is a weight of shape {shape}, got {got}")
    return np.asarray(w)


class DigitsTask:
    """The demo's task (``tensorswap.demo.task``): scikit-learn's digits, a 64-128-10 MLP,
    one non-IID shard per client; the metric is the global model's test accuracy."""

    metric = "accuracy"

    def __init__(self, clients: int, seed: int, *, epochs: int = 2) -> None:
        import torch

        from tensorswap.demo.task import load_dataset, make_model

        torch.set_num_threads(1)
        self.seed, self.epochs = seed, epochs
        self.data = load_dataset(clients, seed=seed)
        self.model = make_model(seed)

    def initial(self) -> dict[str, np.ndarray]:
        from tensorswap.torch import tensors_of

        return {k: v.copy() for k, v in tensors_of(self.model).items()}

    def num_samples(self, client: int) -> int:
        return self.data.shards[client].num_samples

    def train(
        self, client: int, round: int, tensors: Mapping[str, np.ndarray]
    ) -> tuple[dict[str, np.ndarray], float]:
        from tensorswap.demo.task import train_local
        from tensorswap.torch import load_tensors

        load_tensors(self.model, tensors)
        seed = self.seed * 1_000_003 + round * 1009 + client
        loss = train_local(self.model, self.data.shards[client], epochs=self.epochs, seed=seed)
        return self.initial(), loss

    def evaluate(self, tensors: Mapping[str, np.ndarray]) -> float:
        from tensorswap.demo.task import evaluate
        from tensorswap.torch import load_tensors

        load_tensors(self.model, tensors)
        return evaluate(self.model, self.data.test_x, self.data.test_y)


def make_task(spec: Mapping[str, Any]) -> SimTask:
    """The task a ``SimConfig.task_spec()`` names (checked: it comes over a pipe)."""
    try:
        kind = str(spec["task"])
        clients, seed = int(spec["clients"]), int(spec["seed"])
        epochs = int(spec.get("epochs", 2))
        if kind == "synthetic":
            return SyntheticTask(
                clients, float(spec["model_mib"]), seed, epochs=epochs, lr=float(spec["lr"])
            )
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidSimulation(f"a bad task spec {dict(spec)!r}: {exc}") from None
    if kind == "digits":
        return DigitsTask(clients, seed, epochs=epochs)
    raise InvalidSimulation(f"unknown task {kind!r}")
