"""Checking a cut-through announcement: a peer's update manifests, before any of its chunks."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from tensorswap.aggregate import AggregatorSpec, NonFinitePolicy
from tensorswap.aggregate.validate import FLOAT_DTYPE_NAMES
from tensorswap.cid import Cid, Multicodec
from tensorswap.codec import DType
from tensorswap.rounds.core.errors import UnknownUpdate, UpdateMismatch
from tensorswap.rounds.core.state import LayerSpec, Layout, RoundInfo
from tensorswap.rounds.engine.screen import check_layout
from tensorswap.store import (
    ChunkRef,
    MalformedManifest,
    TensorManifest,
    UpdateManifest,
    chunk_bounds,
    decode_manifest,
)

__all__ = ["MAX_ANNOUNCED_BLOCKS", "AnnounceVerdict", "Announced", "parse_announce", "unscreened"]

MAX_ANNOUNCED_BLOCKS = 4096
"""Manifest blocks one announcement may carry (one per tensor, and the update's)."""


@dataclass(frozen=True, slots=True)
class AnnounceVerdict:
    """Whether an announcement takes part in its round's cut-through, and why not; the
    coordinator's result chunk size (an update cut otherwise cannot take part)."""

    ok: bool
    reason: str = ""
    chunk_bytes: int = 0


@dataclass(frozen=True, slots=True)
class Announced:
    """A checked announcement: whose update, its weight, layout, tensors and chunking."""

    peer: str
    cid: Cid
    num_samples: int
    layout: Layout
    tensors: tuple[TensorManifest, ...]
    bounds: tuple[tuple[int, ...], ...]
    closure: list[Cid]
    """Every block of the update (manifests and chunks)."""
    nbytes: int = 0
    """The manifest bytes announced (what the coordinator's cap on them counts)."""
    firsts: tuple[int, ...] = ()
    """Each tensor's first chunk's place among all the update's chunks."""

    def position(self, piece: tuple[int, int]) -> int:
        """Piece ``(tensor index, chunk index)``'s place among all the update's chunks."""
        return self.firsts[piece[0]] + piece[1]

    def refs(self) -> Iterator[tuple[tuple[int, int], ChunkRef]]:
        """``((tensor index, chunk index), chunk)`` for every chunk, in manifest order."""
        for t, tensor in enumerate(self.tensors):
            for c, chunk in enumerate(tensor.chunks):
                yield (t, c), chunk

    def chunks(self) -> Iterator[tuple[tuple[int, int], Cid]]:
        """``((tensor index, chunk index), chunk CID)`` for every chunk, in manifest order."""
        for t, tensor in enumerate(self.tensors):
            for c, chunk in enumerate(tensor.chunks):
                yield (t, c), chunk.cid


def parse_announce(
    info: RoundInfo, peer: str, cid: Cid, blocks: Mapping[Cid, bytes], chunk_bytes: int
) -> Announced:
    """The announcement of ``peer``'s update ``cid`` from its manifest ``blocks``, checked.

    Each block must hash to its CID (HashMismatch); the root must be an update manifest
    linking tensor manifests that are all given (UnknownUpdate), of float dtypes and of the
    round's layout (UpdateMismatch), each cut where the coordinator cuts its results
    (``chunk_bytes``: else the result's pieces could not be its chunks; UpdateMismatch)."""
    key = info.round_id.as_key()
    if len(blocks) > MAX_ANNOUNCED_BLOCKS:
        raise UpdateMismatch(key, peer, f"{len(blocks)} manifest blocks announced")
    for block_cid, data in blocks.items():
        if block_cid.codec is not Multicodec.TENSORSWAP_MANIFEST:
            raise UpdateMismatch(key, peer, f"announced block {block_cid} is not a manifest")
        block_cid.verify(data, f"{peer!r}'s announcement")  # HashMismatch
    root = _decode(blocks, cid, key, peer)
    if not isinstance(root, UpdateManifest):
        raise UpdateMismatch(key, peer, f"{cid} is not a model update manifest")
    tensors, layers, bounds = [], [], []
    closure: list[Cid] = []
    for ref in root.tensors:
        tensor = _decode(blocks, ref.cid, key, peer)
        if not isinstance(tensor, TensorManifest) or tensor.name != ref.name:
            raise UpdateMismatch(key, peer, f"entry {ref.name!r} links no tensor of that name")
        if tensor.dtype not in FLOAT_DTYPE_NAMES:
            raise UpdateMismatch(key, peer, f"layer {ref.name!r} is {tensor.dtype}")
        itemsize = DType.parse(tensor.dtype).numpy.itemsize
        want = chunk_bounds(tensor.size, itemsize, chunk_bytes)
        got = [0]
        for chunk in tensor.chunks:
            got.append(got[-1] + chunk.values)
        if tuple(got) != want and not (tensor.size == 0 and not tensor.chunks):
            detail = f"tensor {ref.name!r} is not cut in chunks of {chunk_bytes} bytes"
            raise UpdateMismatch(key, peer, detail)
        tensors.append(tensor)
        layers.append(LayerSpec(ref.name, tensor.dtype, tuple(tensor.shape)))
        bounds.append(want)
        closure.append(ref.cid)
        closure.extend(tensor.links())
    layout = tuple(layers)
    check_layout(info, layout, peer)
    closure.append(cid)
    nbytes = sum(len(data) for data in blocks.values())
    firsts = tuple(itertools.accumulate((len(t.chunks) for t in tensors[:-1]), initial=0))
    return Announced(
        peer, cid, root.num_samples, layout, tuple(tensors), tuple(bounds), closure, nbytes, firsts
    )


def _decode(
    blocks: Mapping[Cid, bytes], cid: Cid, key: str, peer: str
) -> TensorManifest | UpdateManifest:
    data = blocks.get(cid)
    if data is None:
        raise UnknownUpdate(key, peer, str(cid), "its manifest was not announced")
    try:
        return decode_manifest(memoryview(data), cid)
    except MalformedManifest as exc:
        raise UpdateMismatch(key, peer, f"not a valid manifest: {exc.reason}") from exc


def unscreened(spec: AggregatorSpec) -> AggregatorSpec:
    """``spec`` with its non-finite values propagated: every chunk was counted on arrival
    (the submit refuses a non-finite update), and a NaN or Inf in a folded piece abandons
    the round (``CutThrough._fold``), so the barrier decides; no peer is left out of one
    piece only, and the values are scanned once, not twice."""
    return AggregatorSpec(
        spec.kind, dtype=spec.dtype, max_norm=None, non_finite=NonFinitePolicy.PROPAGATE
    )
