"""Tensors and model updates in a block store: cut into chunk blocks, listed by manifests."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from tensorswap import _alloc
from tensorswap._pool import receive_buffers
from tensorswap.cid import Cid, HashFunction, Multicodec
from tensorswap.codec import DType, Encoding, TensorBlock, as_numpy, encode_block
from tensorswap.codec.arrow import MAX_DECODED_VALUES, encode_block_into, encoded_size
from tensorswap.store.manifest import (
    DEFAULT_CHUNK_BYTES,
    ChunkRef,
    Compression,
    MalformedManifest,
    TensorManifest,
    UpdateManifest,
    chunk_starts,
    decode_chunk,
    encode_manifest,
    manifest_kind,
    read_manifest,
    tensor_manifest,
    update_manifest,
)

if TYPE_CHECKING:
    from tensorswap.store.base import BlockStore

__all__ = [
    "PARALLEL_MIN_BYTES",
    "ModelUpdate",
    "get_tensor",
    "get_update",
    "put_tensor",
    "put_update",
]

PARALLEL_MIN_BYTES = 16 * 1024 * 1024
"""Tensors at least this large are chunked, hashed and copied on one thread per core."""
_MAX_U64 = 2**64 - 1
_T = TypeVar("_T")
_R = TypeVar("_R")


def put_tensor(
    store: BlockStore,
    block: TensorBlock,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    hash: HashFunction = HashFunction.BLAKE3,
    encoding: Encoding | str = Encoding.DENSE,
    compression: Compression = None,
    workers: int | None = None,
) -> Cid:
    """Store ``block`` as chunk blocks plus a tensor manifest; return the manifest's CID.

    Chunks hold ``chunk_bytes // itemsize`` values each (the last one fewer); each is the
    codec's encoding of an unnamed 1-D block of those values, so equal values give equal
    chunk CIDs whatever tensor they belong to. Blocks already held are not stored twice.
    The same tensor with the same parameters always gives the same CID. The manifest is put
    after all its chunks, so a store that shows the manifest holds the chunks too.
    ``workers`` threads encode and hash chunks (None: one per core for big tensors).
    """
    enc = Encoding(encoding)
    flat = block.flat()
    starts = chunk_starts(flat.size, block.dtype.itemsize, chunk_bytes)
    per_chunk = starts.step
    threads = _thread_count(workers, len(starts), block.nbytes)

    def put_chunk(start: int) -> ChunkRef:
        piece = TensorBlock("", flat[start : start + per_chunk])
        data = _encode(piece, enc, compression)
        # Parallel workers hash single-threaded: blake3's own pool would only contend.
        cid = store.put(data, hash=hash, adopt=True, threads=1 if threads > 1 else None)
        return ChunkRef(cid.to_bytes(), piece.size, len(data))

    refs = _map(put_chunk, starts, threads)
    manifest = tensor_manifest(
        block.name,
        block.dtype,
        block.shape,
        refs,
        num_samples=block.num_samples,
        metadata=block.metadata,
        encoding=enc,
        compression=compression or "",
    )
    return store.put(encode_manifest(manifest), codec=Multicodec.TENSORSWAP_MANIFEST, hash=hash)


def get_tensor(
    store: BlockStore, cid: Cid, *, verify: bool | None = None, workers: int | None = None
) -> TensorBlock:
    """Load the tensor whose manifest is ``cid``.

    A tensor of one chunk is returned as a zero-copy (read-only) view of that chunk's block;
    otherwise one writable array is allocated and each chunk is decoded in place and copied
    once into its slice. Every chunk is fetched and checked before the output is allocated.
    ``workers`` threads fetch and copy chunks (None: one per core for big tensors).
    """
    manifest = read_manifest(store, cid, verify=verify)
    if not isinstance(manifest, TensorManifest):
        raise MalformedManifest(f"expected a tensor manifest, got {manifest_kind(manifest)}", cid)
    return _load_tensor(store, manifest, cid, verify, workers)


def _load_tensor(
    store: BlockStore,
    manifest: TensorManifest,
    cid: Cid,
    verify: bool | None,
    workers: int | None,
) -> TensorBlock:
    dtype = DType.parse(manifest.dtype)
    chunks = manifest.chunks
    # Before anything is fetched or allocated; the extent (zero dims aside) bounds the size
    # and what the shape itself asks of numpy, as in the codec.
    if manifest.extent > MAX_DECODED_VALUES:
        raise MalformedManifest(
            f"tensor shape {list(manifest.shape[:8])} of {manifest.extent} values (zero dims "
            f"aside) exceeds the {MAX_DECODED_VALUES} a load allows",
            cid,
        )
    threads = _thread_count(workers, len(chunks), sum(c.nbytes for c in chunks))
    # Each distinct chunk is fetched (and, where the store verifies, hashed) once: a tensor of
    # zeros lists one chunk many times.
    distinct = {chunk.cid_bytes: chunk for chunk in chunks}
    fetched = _map(lambda chunk: store.get(chunk.cid, verify=verify), distinct.values(), threads)
    by_cid = dict(zip(distinct, fetched, strict=True))
    buffers = [by_cid[chunk.cid_bytes] for chunk in chunks]
    exact = manifest.encoding == Encoding.DENSE and not manifest.compression
    for i, (chunk, buf) in enumerate(zip(manifest.chunks, buffers, strict=True)):
        # An uncompressed dense chunk holds all its values: the output size is bounded by
        # bytes actually held, never by a count alone.
        if buf.nbytes != chunk.nbytes or (exact and buf.nbytes < chunk.values * dtype.itemsize):
            raise MalformedManifest(f"chunk {i} ({chunk.cid}) is {buf.nbytes} bytes", cid)
    if len(buffers) == 1:
        values = decode_chunk(buffers[0], manifest, 0, cid)
    elif not exact and buffers:
        # Compressed or lossy chunks: decode (and so check) every one before allocating.
        indices = range(len(chunks))
        decode = lambda i: decode_chunk(buffers[i], manifest, i, cid)  # noqa: E731
        try:
            values = np.concatenate(_map(decode, indices, threads))
        except MemoryError as exc:
            raise MalformedManifest(f"cannot allocate {manifest.size} values", cid) from exc
    else:  # uncompressed dense chunks, or none at all (a tensor of zero values)
        try:
            values = _alloc.empty(manifest.size, dtype.numpy)  # recycled pages: see _alloc
        except MemoryError as exc:
            raise MalformedManifest(f"cannot allocate {manifest.size} values", cid) from exc
        offsets = [0, *itertools.accumulate(chunk.values for chunk in chunks)]

        def fill(i: int) -> None:
            piece = decode_chunk(buffers[i], manifest, i, cid)
            np.copyto(values[offsets[i] : offsets[i + 1]], piece)

        _map(fill, range(len(chunks)), threads)
    return TensorBlock(
        manifest.name, values.reshape(manifest.shape), manifest.num_samples, manifest.metadata
    )


def _encode(piece: TensorBlock, enc: Encoding, compression: Compression) -> memoryview:
    """``piece``'s chunk block: a large dense one encoded into a slab of the process's pool
    (warm pages, page-aligned for a direct write; back to the pool once the store has copied
    it or let it go), anything else by ``encode_block``."""
    if enc is Encoding.DENSE and not compression and piece.nbytes >= _alloc.POOL_MIN_BYTES:
        slab = receive_buffers().take(encoded_size(piece))
        return slab[: encode_block_into(piece, slab)]
    return memoryview(encode_block(piece, encoding=enc, compression=compression))


def _thread_count(requested: int | None, tasks: int, nbytes: int) -> int:
    if requested is not None:
        if requested < 1:
            raise ValueError(f"workers must be positive, got {requested}")
        return max(1, min(requested, tasks))
    if tasks < 2 or nbytes < PARALLEL_MIN_BYTES:
        return 1
    return max(1, min(tasks, os.cpu_count() or 1))


def _map(fn: Callable[[_T], _R], items: Iterable[_T], threads: int) -> list[_R]:
    """``[fn(x) for x in items]``, on ``threads`` threads that are all joined before returning."""
    if threads <= 1:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(threads, thread_name_prefix="tensorswap-store") as pool:
        return list(pool.map(fn, items))


# ── model updates ────────────────────────────────────────────────────────────
@dataclass(frozen=True, eq=False)
class ModelUpdate:
    """Named tensors (numpy; torch accepted) from one client, with its sample count."""

    tensors: Mapping[str, np.ndarray]
    num_samples: int = 0
    metadata: Mapping[str, str] = field(default_factory=dict)
    name: str = ""

    def __post_init__(self) -> None:
        converted = {str(k): as_numpy(v) for k, v in self.tensors.items()}
        object.__setattr__(self, "tensors", MappingProxyType(converted))
        object.__setattr__(self, "metadata", MappingProxyType(dict(self.metadata)))
        if isinstance(self.num_samples, bool) or not isinstance(self.num_samples, int):
            raise TypeError(f"num_samples must be an int, got {type(self.num_samples).__name__}")
        if not 0 <= self.num_samples <= _MAX_U64:
            raise ValueError(f"num_samples must be in [0, 2**64-1], got {self.num_samples}")


def put_update(
    store: BlockStore,
    update: ModelUpdate,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    hash: HashFunction = HashFunction.BLAKE3,
    encoding: Encoding | str = Encoding.DENSE,
    compression: Compression = None,
    workers: int | None = None,
) -> Cid:
    """Store every tensor (see ``put_tensor``) and an update manifest listing them; its CID.

    Tensors keep the mapping's order. A tensor already stored (same name, values and
    parameters) adds no block: only changed chunks and the small manifests are new.
    """
    refs = []
    for name, values in update.tensors.items():
        tensor_cid = put_tensor(
            store,
            TensorBlock(name, values),
            chunk_bytes=chunk_bytes,
            hash=hash,
            encoding=encoding,
            compression=compression,
            workers=workers,
        )
        refs.append((name, tensor_cid))
    manifest = update_manifest(update.name, update.num_samples, refs, update.metadata)
    return store.put(encode_manifest(manifest), codec=Multicodec.TENSORSWAP_MANIFEST, hash=hash)


def get_update(
    store: BlockStore, cid: Cid, *, verify: bool | None = None, workers: int | None = None
) -> ModelUpdate:
    """Load the model update whose manifest is ``cid`` (each tensor as in ``get_tensor``)."""
    manifest = read_manifest(store, cid, verify=verify)
    if not isinstance(manifest, UpdateManifest):
        raise MalformedManifest(f"expected an update manifest, got {manifest_kind(manifest)}", cid)
    tensors = {}
    for ref in manifest.tensors:
        tensor = get_tensor(store, ref.cid, verify=verify, workers=workers)
        if tensor.name != ref.name:
            raise MalformedManifest(f"entry {ref.name!r} links tensor {tensor.name!r}", cid)
        tensors[ref.name] = tensor.values
    return ModelUpdate(tensors, manifest.num_samples, manifest.metadata, manifest.name)
