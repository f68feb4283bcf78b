"""How a call's tensors become one float32 vector, its chunks and its slices (and back)."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from tensorswap._alloc import empty
from tensorswap.collective.errors import GroupMismatch

__all__ = [
    "MAX_CHUNK_ELEMS",
    "MIN_PIPELINE_ELEMS",
    "PIPELINE_CHUNKS",
    "Layout",
    "chunk_bounds",
    "flatten",
    "slice_range",
    "unflatten",
]

MAX_CHUNK_ELEMS = 1 << 20
"""Float32 elements in a chunk at most (4 MiB): a block on the wire, one CID."""
PIPELINE_CHUNKS = 4
"""Chunks a slice is cut into when its chunks may be that small (MIN_PIPELINE_ELEMS): the
all-gather of a slice's last chunk is what the pipeline cannot overlap. 4 beat 8 and 16
on netlab (4 x 32 MiB) and on loopback CPU (2026-12-07, docs/collective.md)."""
MIN_PIPELINE_ELEMS = 1 << 16
"""Float32 elements in a chunk at least (256 KiB) when a slice is cut for the pipeline."""


@dataclass(frozen=True, slots=True)
class Layout:
    """The names and shapes of a call's tensors, in order, and whether they were torch."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    torch: bool

    @property
    def total(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    def digest(self) -> bytes:
        """What every peer of a call must agree on (names, shapes; not torch-ness)."""
        encoded = msgspec.msgpack.encode([list(self.names), [list(s) for s in self.shapes]])
        return hashlib.sha256(encoded).digest()


def _is_torch(value: object) -> bool:
    return type(value).__module__.partition(".")[0] == "torch"


def flatten(tensors: Mapping[str, Any], group: str = "") -> tuple[Layout, np.ndarray]:
    """``tensors`` (numpy or torch, any float dtype) as one fresh float32 vector, in
    sorted-name order (every peer orders alike whatever its dict's order). A large vector
    is pooled memory (``tensorswap._alloc``): a fresh one cost ~3 ms/MiB in page faults."""
    layout, arrays = inputs_of(tensors, group)
    flat = empty(layout.total, np.float32)
    fill(arrays, flat, 0, layout.total)
    return layout, flat


def inputs_of(tensors: Mapping[str, Any], group: str = "") -> tuple[Layout, list[np.ndarray]]:
    """The layout of ``tensors`` and their values as numpy arrays, in ``flatten``'s order
    (nothing copied: ``fill`` copies them, a range at a time)."""
    if not tensors:
        raise GroupMismatch(group, "an all_reduce of no tensors")
    names = tuple(sorted(tensors))
    arrays = []
    torch = False
    for name in names:
        value = tensors[name]
        if _is_torch(value):
            torch = True
            value = value.detach().cpu().numpy()
        array = np.asarray(value)
        if array.dtype.kind != "f":
            raise GroupMismatch(group, f"tensor {name!r} is {array.dtype}, not floating point")
        arrays.append(array)
    layout = Layout(names, tuple(tuple(int(d) for d in a.shape) for a in arrays), torch)
    if layout.total == 0:
        raise GroupMismatch(group, "an all_reduce of empty tensors")
    return layout, arrays


def fill(arrays: Sequence[np.ndarray], flat: np.ndarray, start: int, stop: int) -> None:
    """Copy values ``[start, stop)`` of the arrays laid end to end (C order each) into
    ``flat[start:stop]``, as float32."""
    offset = 0
    for array in arrays:
        end = offset + array.size
        lo, hi = max(start, offset), min(stop, end)
        if lo < hi:
            values = array.reshape(-1) if array.flags.c_contiguous else array.flat
            flat[lo:hi] = values[lo - offset : hi - offset]
        offset = end
        if offset >= stop:
            return


def unflatten(layout: Layout, flat: np.ndarray) -> dict[str, Any]:
    """The dict ``flatten`` was given, as float32 views of ``flat`` (torch for torch in)."""
    out: dict[str, Any] = {}
    offset = 0
    for name, shape in zip(layout.names, layout.shapes, strict=True):
        size = math.prod(shape)
        out[name] = flat[offset : offset + size].reshape(shape)
        offset += size
    if layout.torch:
        import torch

        out = {name: torch.from_numpy(array) for name, array in out.items()}
    return out


def chunk_bounds(total: int, size: int) -> list[tuple[int, int]]:
    """Element ranges of the chunks of a ``total``-element vector in a group of ``size``:
    about one per peer for small inputs; for large ones about PIPELINE_CHUNKS a slice (a
    reducer folds and passes on each as soon as its inputs are in), at least
    MIN_PIPELINE_ELEMS and at most MAX_CHUNK_ELEMS each."""
    per_slice = -(-total // max(1, size))
    pipelined = max(-(-per_slice // PIPELINE_CHUNKS), min(MIN_PIPELINE_ELEMS, per_slice))
    step = max(1, min(MAX_CHUNK_ELEMS, pipelined))
    return [(start, min(total, start + step)) for start in range(0, total, step)]


def slice_range(chunks: int, slices: int, index: int) -> range:
    """The chunks of slice ``index`` when ``chunks`` are cut into ``slices`` slices."""
    return range(index * chunks // slices, (index + 1) * chunks // slices)
