"""Folding one piece of a cut-through round's result, as the barrier path folds it."""

from __future__ import annotations

import numpy as np

from tensorswap.aggregate import AggregatorSpec, NonFinitePolicy
from tensorswap.codec import DType
from tensorswap.rounds.core.state import Layout
from tensorswap.rounds.engine._cut_parse import Announced, unscreened
from tensorswap.rounds.engine.fold import load_chunk, piece_key
from tensorswap.rounds.engine.result import put_chunk_block
from tensorswap.rounds.engine.updates import count_nonfinite, new_accumulator
from tensorswap.store import BlockStore, ChunkRef

__all__ = ["fold_piece"]


def fold_piece(
    store: BlockStore,
    spec: AggregatorSpec,
    layout: Layout | None,
    piece: tuple[int, int],
    inputs: list[tuple[Announced, np.ndarray | None]],
) -> ChunkRef:
    """The result's chunk for ``piece`` (tensor index, chunk index) stored, as the barrier
    path computes and encodes it, from each peer's announcement and its values (held on
    arrival, or read back re-hashed: None), in the order given (peer names); ValueError
    when a value is not finite (the barrier path then decides)."""
    t, c = piece
    tensors = [(got, got.tensors[t]) for got, _ in inputs]
    values = [
        held if held is not None else load_chunk(store, (tensor, c))
        for (_, tensor), (_, held) in zip(tensors, inputs, strict=True)
    ]
    first = tensors[0][1].chunks[c].cid_bytes
    if all(tensor.chunks[c].cid_bytes == first for _, tensor in tensors):
        result = values[0]  # every peer's chunk is the same block: its bits, as barrier
    else:
        acc = new_accumulator(unscreened(spec))
        key = piece_key(tensors[0][1].name, 0)
        for (got, _), piece_values in zip(tensors, values, strict=True):
            acc.add({key: piece_values}, got.num_samples)
        result = acc.result(consume=True).values[key]
    if spec.non_finite is not NonFinitePolicy.PROPAGATE and count_nonfinite(result):
        raise ValueError(f"piece {c} of tensor {t} of the result is not finite")
    assert layout is not None
    want = DType.parse(layout[t].dtype).numpy
    if result.dtype != want:
        cast = np.empty(result.size, dtype=want)
        np.copyto(cast, result, casting="unsafe")  # as the barrier's assemble narrows
        result = cast
    return put_chunk_block(store, result)
