"""The aggregate stored from its pieces is the update put_update would store."""

from __future__ import annotations

import itertools

import numpy as np

from tensorswap.rounds.core import LayerSpec
from tensorswap.rounds.engine.fold import Bounds, assemble, piece_key
from tensorswap.rounds.engine.result import put_pieces
from tensorswap.store import DEFAULT_CHUNK_BYTES, MemoryStore, ModelUpdate, put_update

PER = DEFAULT_CHUNK_BYTES // 4
LAYOUT = (
    LayerSpec("big", "float32", (5, (PER * 5) // 2 // 5)),  # 2.5 chunks
    LayerSpec("small", "float32", (3, 4)),
    LayerSpec("empty", "float32", (0,)),
)


def cut(layout: tuple[LayerSpec, ...], seed: int = 0) -> tuple[dict[str, np.ndarray], Bounds]:
    rng = np.random.default_rng(seed)
    pieces: dict[str, np.ndarray] = {}
    bounds: Bounds = {}
    for layer in layout:
        size = int(np.prod(layer.shape))
        edges = (0, *range(PER, size, PER), size) if size else (0,)
        bounds[layer.name] = edges
        for start, stop in itertools.pairwise(edges):
            pieces[piece_key(layer.name, start)] = rng.standard_normal(stop - start).astype(
                np.float32
            )
    return pieces, bounds


def test_same_cid_as_put_update_of_the_assembled_tensors() -> None:
    pieces, bounds = cut(LAYOUT)
    meta = {"round": "1-a", "strategy": "fedavg"}
    fast, slow = MemoryStore(), MemoryStore()
    cid = put_pieces(fast, pieces, bounds, LAYOUT, num_samples=9, metadata=meta, name="1-a")
    values = assemble(dict(pieces), bounds, LAYOUT)
    assert cid == put_update(slow, ModelUpdate(values, 9, meta, name="1-a"))
    assert set(fast) == set(slow)


def test_pieces_cut_elsewhere_or_of_another_dtype_are_left_to_the_caller() -> None:
    pieces, bounds = cut(LAYOUT)
    odd = dict(bounds, small=(0, 5, 12))
    store = MemoryStore()
    kwargs = {"num_samples": 1, "metadata": {}, "name": ""}
    assert put_pieces(store, pieces, odd, LAYOUT, **kwargs) is None  # type: ignore[arg-type]
    wide = {k: v.astype(np.float64) for k, v in pieces.items()}
    assert put_pieces(store, wide, bounds, LAYOUT, **kwargs) is None  # type: ignore[arg-type]
    assert store.size().blocks == 0
