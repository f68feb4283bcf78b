"""Storing a round's aggregate straight from its chunk-sized pieces (no whole-tensor copies)."""

from __future__ import annotations

import functools
import itertools
import os
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from tensorswap import _alloc
from tensorswap.cid import Cid, Multicodec
from tensorswap.codec import DType, TensorBlock, encode_block_into, encoded_size
from tensorswap.rounds.core.state import LayerSpec, Layout
from tensorswap.rounds.engine.fold import Bounds, piece_key
from tensorswap.store import (
    DEFAULT_CHUNK_BYTES,
    BlockStore,
    ChunkRef,
    chunk_bounds,
    encode_manifest,
    tensor_manifest,
    update_manifest,
)

__all__ = ["put_chunk_block", "put_manifests", "put_pieces"]

_WORKERS = 4  # threads encoding, hashing and writing chunks (at most one per core)


def put_pieces(
    store: BlockStore,
    pieces: Mapping[str, np.ndarray],
    bounds: Bounds,
    layout: Layout,
    *,
    num_samples: int,
    metadata: Mapping[str, str],
    name: str,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Cid | None:
    """Store the aggregate as ``put_update(..., chunk_bytes=chunk_bytes)`` would, reading
    each piece once; its CID.

    Applies when every tensor's pieces are cut where ``put_update`` cuts chunks of
    ``chunk_bytes`` or at some of those cuts (a piece then holds several chunks: views of
    it, no copies) and already have the layout's dtype: then each chunk is encoded into one
    reused buffer, hashed and stored (a few in parallel, each thread with its own buffer),
    and the manifests follow in order, giving the CID ``put_update`` gives for the
    assembled tensors, without assembling them. Returns None (nothing stored) when it does
    not apply (a piece that ends inside a chunk); the caller assembles instead.
    """
    plans = []
    for layer in layout:
        dtype = DType.parse(layer.dtype)
        size = int(np.prod(layer.shape, dtype=np.int64))
        want = chunk_bounds(size, dtype.itemsize, chunk_bytes)
        got = tuple(bounds.get(layer.name, (0, size)))
        if got[-1:] != want[-1:] or not set(got) <= set(want):
            return None
        pieces_of = [pieces[piece_key(layer.name, start)] for start in got[:-1]]
        if any(piece.dtype != dtype.numpy or piece.ndim != 1 for piece in pieces_of):
            return None
        row, at = [], 0  # each chunk, a view of the piece that holds it
        for start, stop in itertools.pairwise(want):
            while got[at + 1] <= start:
                at += 1
            row.append(pieces_of[at][start - got[at] : stop - got[at]])
        plans.append((layer, dtype, row))
    refs = []
    workers = max(1, min(_WORKERS, os.cpu_count() or 1))
    with ThreadPoolExecutor(workers, thread_name_prefix="tensorswap-result") as pool:
        for layer, _, row in plans:
            put = functools.partial(put_chunk_block, store)
            chunks = list(pool.map(put, row))  # in order: the manifest lists them so
            refs.append((layer.name, _put_tensor_manifest(store, layer, chunks)))
    update = update_manifest(name, num_samples, refs, metadata)
    return store.put(encode_manifest(update), codec=Multicodec.TENSORSWAP_MANIFEST)


_local = threading.local()  # one encoding buffer per thread, reused


def put_chunk_block(store: BlockStore, piece: np.ndarray) -> ChunkRef:
    """Store one flat piece of a result as a chunk block, encoded as ``put_update`` encodes
    a chunk of the same values (so equal values give the same CID); its reference."""
    block = TensorBlock("", piece)
    need = encoded_size(block)
    buffer: np.ndarray | None = getattr(_local, "buffer", None)
    if buffer is None or buffer.nbytes < need:  # pooled: page-aligned, written directly
        buffer = _local.buffer = _alloc.empty(need, np.uint8)
    length = encode_block_into(block, buffer)
    data = memoryview(buffer)[:length]  # type: ignore[arg-type]
    # copied out by the store, so the buffer is reused; workers hash single-threaded
    cid = store.put(data, threads=1)
    return ChunkRef(cid.to_bytes(), piece.size, length)


def _put_tensor_manifest(store: BlockStore, layer: LayerSpec, chunks: list[ChunkRef]) -> Cid:
    dtype = DType.parse(layer.dtype)
    manifest = tensor_manifest(layer.name, dtype, tuple(layer.shape), chunks)
    return store.put(encode_manifest(manifest), codec=Multicodec.TENSORSWAP_MANIFEST)


def put_manifests(
    store: BlockStore,
    layout: Layout,
    chunks: Mapping[tuple[int, int], ChunkRef],
    num_samples: int,
    metadata: Mapping[str, str],
    name: str,
) -> Cid:
    """Store the manifests of a result whose chunks are stored already (``chunks``: by
    tensor index in ``layout`` and chunk index): what ``put_pieces`` stores after them."""
    refs = []
    for t, layer in enumerate(layout):
        row: list[ChunkRef] = []
        while (t, len(row)) in chunks:
            row.append(chunks[(t, len(row))])
        refs.append((layer.name, _put_tensor_manifest(store, layer, row)))
    update = update_manifest(name, num_samples, refs, metadata)
    return store.put(encode_manifest(update), codec=Multicodec.TENSORSWAP_MANIFEST)
