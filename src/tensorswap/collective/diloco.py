"""DiLoCo on the collective: local inner steps, an all-reduced pseudo-gradient every H steps."""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

import numpy as np

from tensorswap.aggregate.server_opt import server_optimizer
from tensorswap.collective._call import CallStats
from tensorswap.collective.peer import Collective

__all__ = ["DiLoCo"]


class DiLoCo:
    """DiLoCo (Douillard et al.) for a ``model`` in a collective ``group``.

    ``model`` is a torch module (its ``named_parameters``) or a mutable mapping of names to
    numpy arrays (the parameters of a numpy model, kept float32). The caller runs its own
    inner optimizer and calls ``await diloco.step()`` after each inner step. Every
    ``inner_steps`` steps the peers all-reduce their pseudo-gradients (the outer anchor minus
    their parameters, float32) and every peer applies the same outer Nesterov step (``lr``
    0.7, ``momentum`` 0.9 by default, the DiLoCo paper's) from ``tensorswap.aggregate``'s
    server optimizers to the anchor, then loads the result into ``model``: after each sync
    every member holds the same parameters, bit for bit. A mapping's arrays are overwritten
    in place where they are writeable arrays of the same shape (so references to them see
    the outer step), replaced otherwise.
    """

    def __init__(
        self,
        model: Any,
        group: Collective,
        *,
        inner_steps: int = 500,
        lr: float = 0.7,
        momentum: float = 0.9,
    ) -> None:
        if inner_steps < 1:
            raise ValueError(f"inner_steps must be at least 1, got {inner_steps}")
        self.model = model
        self.group = group
        self.inner_steps = inner_steps
        self.outer = server_optimizer("nesterov", lr=lr, momentum=momentum)
        self._params: _TorchParams | _MappingParams = (
            _TorchParams(model) if hasattr(model, "named_parameters") else _MappingParams(model)
        )
        self.anchor = {name: value.copy() for name, value in self._params.read().items()}
        self.steps = 0
        self.outer_steps = 0
        self.last: CallStats | None = None

    async def step(self, weight: float = 1.0) -> bool:
        """Count one inner step; on every ``inner_steps``-th, sync (True when it did)."""
        self.steps += 1
        if self.steps % self.inner_steps:
            return False
        await self.sync(weight)
        return True

    async def sync(self, weight: float = 1.0) -> None:
        """All-reduce the pseudo-gradients and take the outer step now."""
        current = self._params.read()
        delta = {name: self.anchor[name] - current[name] for name in self.anchor}
        mean = await self.group.all_reduce(delta, weight)
        aggregate = {name: self.anchor[name] - np.asarray(mean[name]) for name in self.anchor}
        self.outer_steps += 1
        new = self.outer.step(self.anchor, aggregate, self.outer_steps)
        self.anchor = {name: np.array(value, np.float32) for name, value in new.items()}
        self._params.write(self.anchor)
        self.last = self.group.stats


class _TorchParams:
    """A torch module's parameters as float32 numpy arrays, and back."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def read(self) -> dict[str, np.ndarray]:
        return {
            name: np.asarray(p.detach().cpu().numpy(), np.float32)
            for name, p in self.model.named_parameters()
        }

    def write(self, values: Mapping[str, np.ndarray]) -> None:
        import torch

        with torch.no_grad():
            for name, param in self.model.named_parameters():
                param.copy_(torch.from_numpy(values[name]).to(param.dtype))


class _MappingParams:
    """A mapping of names to numpy arrays (a numpy model's parameters)."""

    def __init__(self, params: MutableMapping[str, Any]) -> None:
        if not isinstance(params, MutableMapping):
            raise TypeError(
                "DiLoCo needs a torch module or a mutable mapping of names to numpy arrays, "
                f"got {type(params).__name__}"
            )
        self.params = params

    def read(self) -> dict[str, np.ndarray]:
        return {name: np.asarray(value, np.float32) for name, value in self.params.items()}

    def write(self, values: Mapping[str, np.ndarray]) -> None:
        for name, value in values.items():
            old = self.params.get(name)
            if isinstance(old, np.ndarray) and old.flags.writeable and old.shape == value.shape:
                np.copyto(old, value, casting="same_kind")
            else:
                self.params[name] = value.copy()
