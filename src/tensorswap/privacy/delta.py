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

__all__ = ["delta_from_store"]


def delta_from_store(
    store: BlockStore, base: Cid, model: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray] | None:
    """``model[k] - base[k]`` for every tensor of ``model``, in the model's dtypes (the base
    cast to each, as ``model[k] - base[k].astype(model[k].dtype)``), with the update ``base``
    read from ``store``, every block re-hashed. None when that cannot be done here: a block
    of ``base`` is not in the store, or a tensor of ``model`` is not in ``base`` with its
    shape (the caller then takes the delta the general way, which names the problem)."""
    try:
        manifest = read_manifest(store, base, verify=True)
        if not isinstance(manifest, UpdateManifest):
            return None
        refs = {ref.name: ref.cid for ref in manifest.tensors}
        out = {}
        for name, values in model.items():
            mine = np.asarray(values)
            ref = refs.get(name)
            if ref is None:
                return None
            tensor = read_manifest(store, ref, verify=True)
            if not isinstance(tensor, TensorManifest) or tuple(tensor.shape) != mine.shape:
                return None
            flat, delta = mine.reshape(-1), np.empty(mine.size, mine.dtype)
            at = 0
            for i, chunk in enumerate(tensor.chunks):
                view = decode_chunk(store.get(chunk.cid, verify=True), tensor, i)
                end = at + view.size
                if end > flat.size:
                    return None
                np.subtract(flat[at:end], view, out=delta[at:end], dtype=mine.dtype)
                at = end
            if at != flat.size:
                return None
            out[name] = delta.reshape(mine.shape)
        return out
    except BlockNotFound:
        return None
