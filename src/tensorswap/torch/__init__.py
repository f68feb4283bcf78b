"""PyTorch adapters: state_dict <-> named numpy tensors, weight deltas and gradients.

Needs the optional extra (``pip install 'tensorswap[torch]'``). CPU tensors are shared with
numpy, never copied, when read; writing back copies into the module's own parameters.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from tensorswap.codec.dtypes import as_numpy, to_torch
from tensorswap.errors import AggregateShapeMismatch, TensorSwapError


class TensorNamesMismatch(TensorSwapError, ValueError):
    """Two sets of named tensors disagree on their names (a module's state and the tensors
    loaded into it, or the two sides of a delta): ``missing`` and ``unexpected`` names.

    Other shapes under the same name are :class:`~tensorswap.errors.AggregateShapeMismatch`.
    """

    def __init__(self, missing: list[str], unexpected: list[str], detail: str = "") -> None:
        self.missing = missing
        self.unexpected = unexpected
        parts = []
        if missing:
            parts.append(f"missing {missing}")
        if unexpected:
            parts.append(f"unexpected {unexpected}")
        if detail:
            parts.append(detail)
        super().__init__("tensor names do not match: " + "; ".join(parts))


def _state(obj: Any) -> Mapping[str, Any]:
    return obj.state_dict() if hasattr(obj, "state_dict") else obj


def tensors_of(module_or_state: Any, *, trainable_only: bool = False) -> dict[str, np.ndarray]:
    """Named numpy views of a module's state_dict (or of a state_dict itself), in its order.

    With `trainable_only`, only parameters with requires_grad (no buffers) are returned.
    """
    if trainable_only:
        return {n: as_numpy(p) for n, p in module_or_state.named_parameters() if p.requires_grad}
    return {name: as_numpy(t) for name, t in _state(module_or_state).items()}


def gradients_of(module: Any) -> dict[str, np.ndarray]:
    """Named numpy views of the parameters' .grad (parameters without a gradient are skipped)."""
    return {n: as_numpy(p.grad) for n, p in module.named_parameters() if p.grad is not None}


def load_tensors(module: Any, tensors: Mapping[str, Any], *, strict: bool = True) -> None:
    """Copy named tensors into the module's parameters and buffers, checked first.

    All names and shapes are checked, and every value converted to torch (bfloat16 included),
    before anything is written, so a mismatch leaves the module untouched. Values are cast to
    each target's dtype and device by the copy. With strict=False, names absent from `tensors`
    keep their values.
    """
    import torch

    state = module.state_dict()
    missing = [n for n in state if n not in tensors] if strict else []
    unexpected = [n for n in tensors if n not in state]
    if missing or unexpected:
        raise TensorNamesMismatch(missing, unexpected)
    arrays = {n: as_numpy(v) for n, v in tensors.items()}
    for name, arr in arrays.items():
        if tuple(arr.shape) != tuple(state[name].shape):
            raise AggregateShapeMismatch(tuple(state[name].shape), arr.shape, context=name)
    # torch.from_numpy cannot take ml_dtypes.bfloat16; to_torch shares writable memory and
    # copies read-only arrays (decoded blocks) once.
    sources = {name: to_torch(arr) for name, arr in arrays.items()}
    with torch.no_grad():
        for name, source in sources.items():
            state[name].copy_(source)


def delta_of(new: Mapping[str, Any], base: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """new - base per name (float32 unless the inputs are float64); names must match."""
    missing = [n for n in base if n not in new]
    unexpected = [n for n in new if n not in base]
    if missing or unexpected:
        raise TensorNamesMismatch(missing, unexpected)
    out = {}
    for name in base:
        a, b = as_numpy(new[name]), as_numpy(base[name])
        if a.shape != b.shape:
            raise AggregateShapeMismatch(b.shape, a.shape, context=name)
        dtype = np.float64 if np.float64 in (a.dtype, b.dtype) else np.float32
        out[name] = np.subtract(a, b, dtype=dtype)
    return out


__all__ = ["TensorNamesMismatch", "delta_of", "gradients_of", "load_tensors", "tensors_of"]
