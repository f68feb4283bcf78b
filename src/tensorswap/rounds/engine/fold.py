"""Reading stored updates as chunk-sized pieces, zero-copy, for the streaming accumulator.

A FedAvg or mean round folds each contribution as a dict of pieces (one per stored chunk)
rather than of whole tensors: an accumulator sees the same values, weights, norms and
finiteness checks either way, but pieces are read straight from the memory-mapped chunk
blocks, so folding a contribution copies nothing. The first contribution fixes where the
pieces are cut; a later one stored with other chunk sizes is loaded whole and sliced the
same way (one copy, still correct).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator, Mapping

import numpy as np

from tensorswap.aggregate import AggregatorSpec, StreamingAccumulator
from tensorswap.codec import DType
from tensorswap.rounds.core.state import Layout
from tensorswap.rounds.engine._chunks import ChunkDecoder
from tensorswap.rounds.engine.updates import UpdateFacts, count_nonfinite, new_accumulator
from tensorswap.store import BlockStore, TensorManifest, get_tensor

__all__ = [
    "Bounds",
    "ChunkSource",
    "RoundWork",
    "assemble",
    "chunk_sources",
    "count_nonfinite_chunks",
    "load_chunk",
    "load_pieces",
    "piece_key",
    "same_chunks",
]

Bounds = dict[str, tuple[int, ...]]
"""Per tensor, the flat offsets where pieces start, then its size: ``(0, c0, c0 + c1, ..., n)``."""


CHUNKS = ChunkDecoder()
"""How every round's chunks are decoded (the layouts of small chunks remembered)."""


def piece_key(name: str, start: int) -> str:
    """The accumulator key of tensor ``name``'s piece starting at flat offset ``start``."""
    return f"{start}@{name}"


ChunkSource = tuple[TensorManifest, int]
"""A stored chunk: the manifest of its tensor and its index there."""


def _own_bounds(tensor: TensorManifest) -> tuple[int, ...]:
    """The flat offsets where ``tensor``'s stored chunks start, then its size."""
    if tensor.size == 0:
        return (0,)
    return (0, *itertools.accumulate(chunk.values for chunk in tensor.chunks))


def load_pieces(
    store: BlockStore, facts: UpdateFacts, bounds: Bounds | None
) -> tuple[dict[str, np.ndarray], Bounds, int]:
    """The checked update ``facts`` as flat pieces, the bounds they follow, its num_samples.

    With ``bounds`` None the update's own chunks are the pieces. Every chunk is re-hashed as
    it is read (whatever the store's default): an aggregate never folds bytes whose hash was
    not checked on this read. A chunk that fails raises CorruptBlock (a directory store has
    quarantined it); one that does not decode to what its manifest says, MalformedManifest.
    """
    pieces: dict[str, np.ndarray] = {}
    used: Bounds = {}
    for tensor_cid, tensor in facts.tensors:
        name = tensor.name
        own = _own_bounds(tensor)
        want = own if bounds is None else bounds.get(name, own)
        used[name] = want
        if want == own:
            for i in range(len(tensor.chunks)):
                pieces[piece_key(name, own[i])] = _chunk_values(store, tensor, i)
        else:
            flat = get_tensor(store, tensor_cid, verify=True).flat()
            for start, stop in itertools.pairwise(want):
                pieces[piece_key(name, start)] = flat[start:stop]
    return pieces, used, facts.num_samples


def chunk_sources(facts: UpdateFacts, bounds: Bounds) -> dict[str, ChunkSource]:
    """Piece key -> stored chunk, for the pieces of ``facts`` that are whole chunks of it when
    cut at ``bounds`` (all of them unless it was stored with other chunk sizes)."""
    sources: dict[str, ChunkSource] = {}
    for _, tensor in facts.tensors:
        own = _own_bounds(tensor)
        if bounds.get(tensor.name) == own:
            for i in range(len(tensor.chunks)):
                sources[piece_key(tensor.name, own[i])] = (tensor, i)
    return sources


def same_chunks(
    common: Mapping[str, ChunkSource], sources: Mapping[str, ChunkSource]
) -> dict[str, ChunkSource]:
    """The pieces of ``common`` that ``sources`` holds as the very same chunk (same CID)."""
    same: dict[str, ChunkSource] = {}
    for key, (tensor, index) in common.items():
        other = sources.get(key)
        if (
            other is not None
            and other[0].chunks[other[1]].cid_bytes == tensor.chunks[index].cid_bytes
        ):
            same[key] = (tensor, index)
    return same


def load_chunk(store: BlockStore, source: ChunkSource) -> np.ndarray:
    """The values of one stored chunk, re-hashed as it is read and checked against its
    manifest (CorruptBlock, MalformedManifest)."""
    tensor, index = source
    return _chunk_values(store, tensor, index)


def _chunk_values(store: BlockStore, tensor: TensorManifest, index: int) -> np.ndarray:
    """Chunk ``index`` of ``tensor``, re-hashed as it is read, decoded as the store decodes
    (small chunks through their remembered layout, ``rounds.engine._chunks``)."""
    return CHUNKS.decode(store.get(tensor.chunks[index].cid, verify=True), tensor, index)


def count_nonfinite_chunks(store: BlockStore, facts: UpdateFacts) -> Iterator[tuple[str, int]]:
    """Per tensor of ``facts``, its name and how many of its values are NaN or infinite,
    read chunk by chunk (each re-hashed, then let go): memory stays one chunk."""
    for _, tensor in facts.tensors:
        chunks = range(len(tensor.chunks))
        yield tensor.name, sum(count_nonfinite(_chunk_values(store, tensor, i)) for i in chunks)


def assemble(
    pieces: dict[str, np.ndarray], bounds: Bounds, layout: Layout
) -> dict[str, np.ndarray]:
    """Whole tensors in the round's layout (names, dtypes, shapes) from aggregated pieces.

    Each piece is removed from ``pieces`` once copied, so its memory can go before the
    next tensor is built; values are cast to the layout's dtype.
    """
    out: dict[str, np.ndarray] = {}
    for layer in layout:
        size = int(np.prod(layer.shape, dtype=np.int64))
        values = np.empty(size, dtype=DType.parse(layer.dtype).numpy)
        edges = bounds.get(layer.name, (0, size))
        for start, stop in itertools.pairwise(edges):
            piece = pieces.pop(piece_key(layer.name, start))
            np.copyto(values[start:stop], piece, casting="unsafe")  # narrowing is intended
        out[layer.name] = values.reshape(layer.shape)
    return out


def describe(bounds: Mapping[str, tuple[int, ...]]) -> str:
    """``name: k pieces`` per tensor, for logs."""
    return ", ".join(f"{name}: {max(len(b) - 1, 0)} pieces" for name, b in bounds.items())


class RoundWork:
    """One round's streaming fold: its sums, who is in them, where pieces are cut, and the
    chunks every folded contribution shares. Its lock serializes every change to the round."""

    __slots__ = ("acc", "bounds", "folded", "lock", "same")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.acc: StreamingAccumulator | None = None
        self.folded: set[str] = set()
        self.bounds: Bounds | None = None
        # pieces that every folded contribution stored as the very same chunk (None: no fold yet)
        self.same: dict[str, ChunkSource] | None = None

    def reset(self, spec: AggregatorSpec | None = None) -> None:
        """Empty sums (a new accumulator for ``spec``, or none at all)."""
        self.acc = None if spec is None else new_accumulator(spec)
        self.folded = set()
        self.bounds = None
        self.same = None

    def fold(
        self,
        pieces: dict[str, np.ndarray],
        bounds: Bounds,
        num_samples: int,
        facts: UpdateFacts,
        scale: float = 1.0,
    ) -> None:
        """Add one contribution's pieces (``load_pieces``) to the sums, times ``scale``."""
        assert self.acc is not None
        self.acc.add(pieces, num_samples, scale=scale)
        self.bounds = bounds
        sources = chunk_sources(facts, bounds)
        self.same = sources if self.same is None else same_chunks(self.same, sources)
