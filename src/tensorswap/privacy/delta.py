"""A peer's delta from the task's model, read chunk by chunk from the peer's own store.

A DP peer submits ``model - base`` (``base``: the global model its task trained from, which
it pulled into its store to start). Reading ``base`` back whole (``get_update``) would verify
every chunk and then copy them into one fresh model-sized array per tensor, only to subtract
it; here each chunk is verified and read as a view of its block, and the subtraction writes
straight into the delta: the one model-sized array made is the delta itself.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from tensorswap.cid import Cid
from tensorswap.errors import BlockNotFound
from tensorswap.store import (
    BlockStore,
    TensorManifest,
    UpdateManifest,
    decode_chunk,
    read_manifest,
)

__all__ = ["delta_from_store", "flat_delta_from_store"]


def _base_tensors(store: BlockStore, base: Cid) -> list[tuple[str, TensorManifest]] | None:
    """The tensors of the update ``base`` in its order (manifests re-hashed), or None."""
    manifest = read_manifest(store, base, verify=True)
    if not isinstance(manifest, UpdateManifest):
        return None
    out = []
    for ref in manifest.tensors:
        tensor = read_manifest(store, ref.cid, verify=True)
        if not isinstance(tensor, TensorManifest):
            return None
        out.append((ref.name, tensor))
    return out


def _subtract_into(
    store: BlockStore, tensor: TensorManifest, mine: np.ndarray, out: np.ndarray
) -> bool:
    """``out = mine - base`` for the flat ``mine`` and ``out`` of one tensor, chunk by chunk
    (each block re-hashed, read as a view); False if the chunks do not cover ``mine``."""
    at = 0
    for i, chunk in enumerate(tensor.chunks):
        view = decode_chunk(store.get(chunk.cid, verify=True), tensor, i)
        end = at + view.size
        if end > mine.size:
            return False
        np.subtract(mine[at:end], view, out=out[at:end], dtype=out.dtype)
        at = end
    return at == mine.size


def delta_from_store(
    store: BlockStore, base: Cid, model: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray] | None:
    """``model[k] - base[k]`` for every tensor of ``model``, in the model's dtypes (the base
    cast to each, as ``model[k] - base[k].astype(model[k].dtype)``), with the update ``base``
    read from ``store``, every block re-hashed. None when that cannot be done here: a block
    of ``base`` is not in the store, or a tensor of ``model`` is not in ``base`` with its
    shape (the caller then takes the delta the general way, which names the problem)."""
    try:
        tensors = _base_tensors(store, base)
        if tensors is None:
            return None
        by_name = dict(tensors)
        out = {}
        for name, values in model.items():
            mine, tensor = np.asarray(values), by_name.get(name)
            if tensor is None or tuple(tensor.shape) != mine.shape:
                return None
            delta = np.empty(mine.size, mine.dtype)
            if not _subtract_into(store, tensor, mine.reshape(-1), delta):
                return None
            out[name] = delta.reshape(mine.shape)
        return out
    except BlockNotFound:
        return None


def flat_delta_from_store(
    store: BlockStore, base: Cid, model: Mapping[str, np.ndarray]
) -> np.ndarray | None:
    """``model - base`` as one float32 vector in ``base``'s tensor order, each tensor
    raveled (what a secure peer masks), read like ``delta_from_store``; None when the names
    or shapes differ or a block is missing (the caller's general path names the problem)."""
    try:
        tensors = _base_tensors(store, base)
        if tensors is None or {name for name, _ in tensors} != set(model):
            return None
        out = np.empty(sum(t.size for _, t in tensors), np.float32)
        at = 0
        for name, tensor in tensors:
            mine = np.asarray(model[name])
            if tuple(tensor.shape) != mine.shape:
                return None
            part = out[at : at + mine.size]
            if not _subtract_into(store, tensor, mine.reshape(-1), part):
                return None
            at += mine.size
        return out
    except BlockNotFound:
        return None
