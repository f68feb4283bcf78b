"""A small real learning task for the demo: scikit-learn's bundled digits, an MLP, FedAvg peers.

The digits data ships inside scikit-learn, so the demo runs offline. Each peer gets a non-IID
shard (label proportions drawn from a Dirichlet distribution); the test split is shared.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

HIDDEN = 128
CLASSES = 10
FEATURES = 64


@dataclass(frozen=True)
class Shard:
    """One peer's training data (standardised features, integer labels)."""

    x: np.ndarray
    y: np.ndarray

    @property
    def num_samples(self) -> int:
        return int(self.y.size)


@dataclass(frozen=True)
class Dataset:
    shards: tuple[Shard, ...]
    test_x: np.ndarray
    test_y: np.ndarray


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits (1797 x 64 pixel values 0-16, labels 0-9).

    Read straight from the CSV that ships inside scikit-learn when it is where
    ``sklearn.datasets.load_digits`` reads it (importing scikit-learn costs seconds per peer
    process); otherwise through ``load_digits``.
    """
    import gzip
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    if spec is not None and spec.submodule_search_locations:
        for root in spec.submodule_search_locations:
            path = Path(root) / "datasets" / "data" / "digits.csv.gz"
            if path.is_file():
                with gzip.open(path, "rt") as f:
                    table = np.loadtxt(f, delimiter=",")
                return table[:, :-1], table[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits

    digits = load_digits()
    return digits.data, digits.target


def load_dataset(
    peers: int, *, seed: int = 0, alpha: float = 0.5, test_fraction: float = 0.25
) -> Dataset:
    """Split digits into a shared test set and `peers` label-skewed training shards.

    Deterministic for a given seed. Every shard gets at least a few samples.
    """
    data, target = load_digits_arrays()
    x = (data.astype(np.float32) / np.float32(16.0) - np.float32(0.5)) / np.float32(0.5)
    y = target.astype(np.int64)
    rng = np.random.default_rng(seed)
    order = rng.permutation(y.size)
    n_test = int(y.size * test_fraction)
    test, train = order[:n_test], order[n_test:]
    buckets: list[list[int]] = [[] for _ in range(peers)]
    for label in range(CLASSES):
        idx = train[y[train] == label]
        idx = idx[rng.permutation(idx.size)]
        share = rng.dirichlet(np.full(peers, alpha))
        cuts = (np.cumsum(share)[:-1] * idx.size).astype(int)
        for peer, part in enumerate(np.split(idx, cuts)):
            buckets[peer].extend(part.tolist())
    # No empty peer: top up a small shard from the largest one.
    for peer in range(peers):
        while len(buckets[peer]) < 8:
            donor = max(range(peers), key=lambda p: len(buckets[p]))
            buckets[peer].append(buckets[donor].pop())
    shards = tuple(Shard(x[np.array(b)], y[np.array(b)]) for b in buckets)
    return Dataset(shards, x[test], y[test])


def make_model(seed: int = 0) -> Any:
    """The demo's MLP: 64 -> 128 -> 10, the same initial weights for a given seed."""
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, CLASSES)
    )


def train_local(
    model: Any,
    shard: Shard,
    *,
    epochs: int = 2,
    lr: float = 0.05,
    batch_size: int = 32,
    seed: int = 0,
) -> float:
    """Train in place with SGD (momentum 0.9) for `epochs`; return the mean training loss.

    The update is torch.optim.SGD's (no dampening, no Nesterov, no weight decay) written out:
    creating a torch.optim optimizer imports torch._dynamo, seconds of start-up per process.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    x, y = torch.from_numpy(shard.x), torch.from_numpy(shard.y)
    params = [p for p in model.parameters() if p.requires_grad]
    momentum: list[Any] = [None] * len(params)
    loss_fn = torch.nn.CrossEntropyLoss()
    model.train()
    total, batches = 0.0, 0
    for _ in range(epochs):
        perm = torch.randperm(y.numel(), generator=gen)
        for start in range(0, y.numel(), batch_size):
            idx = perm[start : start + batch_size]
            for p in params:
                p.grad = None
            loss = loss_fn(model(x[idx]), y[idx])
            loss.backward()
            with torch.no_grad():
                for i, p in enumerate(params):
                    if p.grad is None:
                        continue
                    buf = momentum[i]
                    if buf is None:
                        buf = momentum[i] = p.grad.detach().clone()
                    else:
                        buf.mul_(0.9).add_(p.grad)
                    p.add_(buf, alpha=-lr)
            total += loss.item()
            batches += 1
    return total / max(batches, 1)


def evaluate(model: Any, x: np.ndarray, y: np.ndarray) -> float:
    """Accuracy of `model` on (x, y)."""
    import torch

    model.eval()
    with torch.no_grad():
        pred = model(torch.from_numpy(x)).argmax(dim=1).numpy()
    return float((pred == y).mean())


class StepTrainer:
    """Minibatch SGD (momentum 0.9, as `train_local`) that runs a given number of steps.

    For DiLoCo's inner loop: the momentum buffers and the batch order carry over between
    calls of `run`, a fresh permutation of the shard is drawn each time one is used up.
    """

    def __init__(
        self, model: Any, shard: Shard, *, lr: float = 0.05, batch_size: int = 32, seed: int = 0
    ) -> None:
        import torch

        self.model = model
        self.lr = lr
        self.batch_size = batch_size
        self._gen = torch.Generator().manual_seed(seed)
        self._x, self._y = torch.from_numpy(shard.x), torch.from_numpy(shard.y)
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._momentum: list[Any] = [None] * len(self._params)
        self._order: list[Any] = []

    def _batch(self) -> Any:
        import torch

        if not self._order:
            perm = torch.randperm(self._y.numel(), generator=self._gen)
            self._order = list(torch.split(perm, self.batch_size))
        return self._order.pop(0)

    def run(self, steps: int) -> float:
        """Take `steps` minibatch steps in place; return their mean training loss."""
        import torch

        loss_fn = torch.nn.CrossEntropyLoss()
        self.model.train()
        total = 0.0
        for _ in range(steps):
            idx = self._batch()
            for p in self._params:
                p.grad = None
            loss = loss_fn(self.model(self._x[idx]), self._y[idx])
            loss.backward()
            with torch.no_grad():
                for i, p in enumerate(self._params):
                    if p.grad is None:
                        continue
                    buf = self._momentum[i]
                    if buf is None:
                        buf = self._momentum[i] = p.grad.detach().clone()
                    else:
                        buf.mul_(0.9).add_(p.grad)
                    p.add_(buf, alpha=-self.lr)
            total += loss.item()
        return total / max(steps, 1)
