"""Apply a verified fragment to a list or dict of states, all layers or none."""

from __future__ import annotations

from collections.abc import Callable, MutableMapping, MutableSequence
from typing import Any

import numpy as np

from tensorswap.codec.dtypes import is_torch_tensor
from tensorswap.delta.fragment import (
    KNOWN_SCHEMAS,
    DweFragment,
    LayerTarget,
    layer_target,
    quoted,
)
from tensorswap.errors import DeltaError

States = MutableSequence[Any] | MutableMapping[str, Any]


class ApplyError(DeltaError, ValueError):
    """A fragment does not fit the local states; no state was changed."""


class LayerOutOfRange(ApplyError):
    """A layer index at or beyond the number of local states."""

    def __init__(self, layer_index: int, layer_count: int) -> None:
        self.layer_index = layer_index
        self.layer_count = layer_count
        super().__init__(f"dwe layer {layer_index} out of range ({layer_count} local layers)")


class StateMismatch(ApplyError):
    """A local state cannot take its layer's delta (shape, dtype, read-only, non-contiguous)."""

    def __init__(self, layer_index: int, detail: str) -> None:
        self.layer_index = layer_index
        self.detail = detail
        super().__init__(f"dwe layer {layer_index}: {detail}")


_Step = Callable[[], None]


def _shape_of(state: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in state.shape)


def _numpy_step(state: np.ndarray, target: LayerTarget, values: np.ndarray, index: int) -> _Step:
    if state.dtype.kind != "f":
        raise StateMismatch(index, f"state dtype {state.dtype} is not floating point")
    if not state.flags.writeable:
        raise StateMismatch(index, "state array is read-only")
    if target.sliced and not state.flags.c_contiguous:
        raise StateMismatch(index, "a slice needs a C-contiguous state")
    if _overlapping(state.shape, state.strides):
        raise StateMismatch(index, "state has overlapping memory (a broadcast or strided view)")
    region = (
        state.reshape(-1)[target.offset : target.offset + target.count]
        if target.sliced
        else state.reshape(-1)
    )
    _refuse_numpy_overflow(index, region, values)

    def run() -> None:
        with np.errstate(over="ignore", invalid="ignore"):
            if target.sliced:
                flat = state.reshape(-1)[target.offset : target.offset + target.count]
                np.add(flat, values, out=flat, casting="same_kind")
            else:
                np.add(state, values.reshape(target.shape), out=state, casting="same_kind")

    return run


def _torch_step(state: Any, target: LayerTarget, values: np.ndarray, index: int) -> _Step:
    import torch  # only reached when the states are torch tensors

    if not state.is_floating_point():
        raise StateMismatch(index, f"state dtype {state.dtype} is not floating point")
    if target.sliced and not state.is_contiguous():
        raise StateMismatch(index, "a slice needs a contiguous state")
    if state.is_inference() and not torch.is_inference_mode_enabled():
        raise StateMismatch(
            index, "state is an inference tensor (apply inside torch.inference_mode())"
        )
    if _overlapping(tuple(state.shape), tuple(state.stride())):
        raise StateMismatch(index, "state has overlapping memory (an expanded tensor)")
    # torch.from_numpy warns on read-only arrays (received buffers are): copy those first.
    source = values if values.flags.writeable else values.copy()
    try:  # before any addition: a copy to the device may fail (memory)
        delta = torch.from_numpy(source).to(device=state.device)
    except RuntimeError as exc:
        raise StateMismatch(index, f"cannot move the delta to {state.device}: {exc}") from exc
    region = (
        state.reshape(-1)[target.offset : target.offset + target.count]
        if target.sliced
        else state.reshape(-1)
    )
    _refuse_torch_overflow(index, region.detach(), delta.reshape(-1))

    def run() -> None:
        with torch.no_grad():
            if target.sliced:
                state.view(-1)[target.offset : target.offset + target.count].add_(delta)
            else:
                state.add_(delta.view(target.shape))

    return run


def _numpy_max(dtype: np.dtype) -> float:
    try:
        return float(np.finfo(dtype).max)
    except ValueError:  # bfloat16 and friends: ml_dtypes knows them
        import ml_dtypes

        return float(ml_dtypes.finfo(dtype).max)


def _magnitude(values: Any, count: int) -> float:
    """The largest absolute value (nan or inf if any value is not finite), without a copy."""
    return max(float(values.max()), -float(values.min())) if count else 0.0


def _may_overflow(region: Any, delta: Any, count: int, limit: float) -> bool:
    """False when adding ``delta`` to ``region`` certainly stays finite, or ``region`` already
    holds inf or NaN (the delta cannot make it worse); two reductions, no copy."""
    held = _magnitude(region, count)
    return held < float("inf") and held + _magnitude(delta, count) > limit


# The verified delta is finite, but a finite sum can still overflow the state's dtype (float16
# stops at 65504) and poison the receiver: refused before any addition. When two reductions
# cannot rule it out, the sum is tried in a temporary.
def _refuse_numpy_overflow(index: int, region: np.ndarray, delta: np.ndarray) -> None:
    if not _may_overflow(region, delta, region.size, _numpy_max(region.dtype)):
        return
    with np.errstate(over="ignore", invalid="ignore"):
        trial = region + delta.astype(region.dtype)
    if not np.isfinite(trial).all():
        raise StateMismatch(index, f"adding the delta would overflow the state's {region.dtype}")


def _refuse_torch_overflow(index: int, region: Any, delta: Any) -> None:
    import torch

    limit = float(torch.finfo(region.dtype).max)
    if not _may_overflow(region, delta, region.numel(), limit):
        return
    if not bool(torch.isfinite(region + delta.to(region.dtype)).all()):
        raise StateMismatch(index, f"adding the delta would overflow the state's {region.dtype}")


def _overlapping(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """True when two elements share memory through a zero stride (broadcast / expand): an
    in-place add would then add several deltas into one place, or fail half-way."""
    return any(stride == 0 and size > 1 for size, stride in zip(shape, strides, strict=True))


def _plan(state: Any, target: LayerTarget, values: np.ndarray, index: int) -> _Step:
    if _shape_of(state) != target.shape:
        raise StateMismatch(
            index, f"state shape {list(_shape_of(state))} vs delta shape {list(target.shape)}"
        )
    if is_torch_tensor(state):
        return _torch_step(state, target, values, index)
    if isinstance(state, np.ndarray):
        return _numpy_step(state, target, values, index)
    raise StateMismatch(index, f"unsupported state type {type(state).__name__}")


def apply_fragment(states: States, fragment: DweFragment) -> int:
    """Add every layer delta of ``fragment`` to ``states`` in place; all layers or none.

    ``states`` is a list of numpy arrays / torch tensors, or a dict whose i-th key is layer i.
    Every layer is checked first (index range, value count vs shape or slice bounds, state shape,
    floating dtype, writability, no two entries adding to the same values); only when all pass
    are the additions made, so a bad layer in the middle leaves every state untouched. Returns
    the number of layer entries applied. The fragment is assumed verified (see
    :class:`~tensorswap.delta.verify.FragmentVerifier`).
    """
    if fragment.schema not in KNOWN_SCHEMAS:
        raise ApplyError(f"cannot apply schema {quoted(fragment.schema)}")
    targets = state_list(states)
    steps: list[_Step] = []
    covered: dict[int, list[tuple[int, int]]] = {}
    for layer in fragment.layers:
        if layer.layer_index >= len(targets):
            raise LayerOutOfRange(layer.layer_index, len(targets))
        target = layer_target(fragment.schema, layer)
        steps.append(_plan(targets[layer.layer_index], target, layer.values, layer.layer_index))
        covered.setdefault(layer.layer_index, []).append(
            (target.offset, target.offset + target.count)
        )
    _refuse_overlap(covered)
    for step in steps:
        step()
    return len(steps)


def _refuse_overlap(covered: dict[int, list[tuple[int, int]]]) -> None:
    """Refuse entries that add to the same values of one state twice: each entry's overflow
    check sees the state before the others, so two 60,000 deltas on one float16 value each
    passed and the sum became inf."""
    for index, ranges in covered.items():
        if len(ranges) < 2:
            continue
        reach = 0
        for start, end in sorted(r for r in ranges if r[0] < r[1]):
            if start < reach:
                raise StateMismatch(
                    index, "two entries of the fragment add to the same values of this layer"
                )
            reach = end


def state_list(states: States) -> list[Any]:
    """The states in layer order (a dict's insertion order), as :func:`apply_fragment` sees them."""
    return list(states.values()) if isinstance(states, MutableMapping) else list(states)
