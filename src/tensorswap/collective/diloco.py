"""DiLoCo on the collective: local inner steps, an all-reduced pseudo-gradient every H steps."""

from __future__ import annotations

from typing import Any

import numpy as np

from tensorswap.aggregate.server_opt import server_optimizer
from tensorswap.collective._call import CallStats
from tensorswap.collective.peer import Collective

__all__ = ["DiLoCo"]


class DiLoCo:
    """DiLoCo (Douillard et al.) for a torch ``model`` in a collective ``group``.

    The caller runs its own inner optimizer and calls ``await diloco.step()`` after each
    inner step. Every ``inner_steps`` steps the peers all-reduce their pseudo-gradients
    (the outer anchor minus their parameters, float32) and every peer applies the same
    outer Nesterov step (``lr`` 0.7, ``momentum`` 0.9 by default, the DiLoCo paper's) from
    ``tensorswap.aggregate``'s server optimizers to the anchor, then loads the result into
    ``model``: after each sync every member holds the same parameters, bit for bit.
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
        self.anchor = {name: _numpy(p).copy() for name, p in model.named_parameters()}
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
        params = dict(self.model.named_parameters())
        delta = {name: self.anchor[name] - _numpy(params[name]) for name in self.anchor}
        mean = await self.group.all_reduce(delta, weight)
        aggregate = {name: self.anchor[name] - np.asarray(mean[name]) for name in self.anchor}
        self.outer_steps += 1
        new = self.outer.step(self.anchor, aggregate, self.outer_steps)
        self.anchor = {name: np.array(value, np.float32) for name, value in new.items()}
        _load(params, self.anchor)
        self.last = self.group.stats


def _numpy(param: Any) -> np.ndarray:
    return np.asarray(param.detach().cpu().numpy(), np.float32)


def _load(params: dict[str, Any], values: dict[str, np.ndarray]) -> None:
    import torch

    with torch.no_grad():
        for name, param in params.items():
            param.copy_(torch.from_numpy(values[name]).to(param.dtype))
