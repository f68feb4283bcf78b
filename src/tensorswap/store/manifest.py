"""Tensor and model-update manifests: tensors split into chunk blocks, addressed by one CID."""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Literal, TypeVar

import msgspec
import numpy as np

from tensorswap import _alloc
from tensorswap.cid import Cid, HashFunction, Multicodec, byte_view
from tensorswap.codec import DType, Encoding, TensorBlock, as_numpy, decode_block, encode_block
from tensorswap.codec.arrow import MAX_DECODED_VALUES
from tensorswap.errors import CodecError, InvalidCid, StoreError

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from tensorswap.store.base import BlockStore

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "MANIFEST_MAGIC",
    "ChunkRef",
    "MalformedManifest",
    "Manifest",
    "ModelUpdate",
    "TensorManifest",
    "TensorRef",
    "UpdateManifest",
    "decode_manifest",
    "encode_manifest",
    "get_tensor",
    "get_update",
    "is_manifest",
    "manifest_closure",
    "manifest_kind",
    "put_tensor",
    "put_update",
    "read_manifest",
]

MANIFEST_MAGIC = b"TSMF\x01"
"""First bytes of every manifest block: ``TSMF`` and format version 1."""
DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024
"""Default chunk size: tensors are cut every ``DEFAULT_CHUNK_BYTES // itemsize`` values."""
MAX_NDIM = 64
PARALLEL_MIN_BYTES = 16 * 1024 * 1024
"""Tensors at least this large are chunked, hashed and copied on one thread per core."""
_MAX_U64 = 2**64 - 1
_MAX_EXTENT = 2**63 - 1  # numpy's largest array extent (npy_intp)
_COMPRESSIONS = ("", "lz4", "zstd")
Compression = Literal["lz4", "zstd"] | None
_T = TypeVar("_T")
_R = TypeVar("_R")


class MalformedManifest(StoreError, ValueError):
    """A manifest block (or a chunk it lists) is not what the manifest format requires."""

    def __init__(self, reason: str, cid: Cid | None = None) -> None:
        self.reason = reason
        self.cid = cid
        where = f" {cid}" if cid is not None else ""
        super().__init__(f"malformed manifest{where}: {reason}")


# ── wire structs ─────────────────────────────────────────────────────────────
class ChunkRef(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """One chunk of a tensor: its binary CID, how many values it holds, its block length."""

    cid_bytes: bytes
    values: int
    nbytes: int

    def __post_init__(self) -> None:
        Cid.parse(self.cid_bytes)  # InvalidCid (a ValueError) makes msgspec reject the input

    @property
    def cid(self) -> Cid:
        """The chunk's CID."""
        return Cid.parse(self.cid_bytes)


class TensorRef(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """One tensor of a model update: its name and its tensor manifest's binary CID."""

    name: str
    cid_bytes: bytes

    def __post_init__(self) -> None:
        Cid.parse(self.cid_bytes)

    @property
    def cid(self) -> Cid:
        """The tensor manifest's CID."""
        return Cid.parse(self.cid_bytes)


class TensorManifest(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="kind", tag="tensor"
):
    """A tensor: its chunks, in order, concatenate to its flat (C-order) values."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    num_samples: int
    encoding: str
    compression: str
    chunks: tuple[ChunkRef, ...]
    metadata: dict[str, str]

    @property
    def size(self) -> int:
        """Number of values (1 for a 0-d tensor)."""
        return math.prod(self.shape)

    @property
    def extent(self) -> int:
        """The product of the non-zero dims: what an array of this shape must be able to
        address even when it holds no value (numpy refuses a shape whose extent is too big)."""
        return math.prod(d for d in self.shape if d)

    def links(self) -> list[Cid]:
        """The chunk CIDs, in order."""
        return [chunk.cid for chunk in self.chunks]


class UpdateManifest(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="kind", tag="update"
):
    """A model update: named tensor manifests (in the order given) plus num_samples."""

    name: str
    num_samples: int
    tensors: tuple[TensorRef, ...]
    metadata: dict[str, str]

    def links(self) -> list[Cid]:
        """The tensor manifest CIDs, in order."""
        return [ref.cid for ref in self.tensors]


Manifest = TensorManifest | UpdateManifest


_encoder = msgspec.msgpack.Encoder(order="deterministic")
_decoder: msgspec.msgpack.Decoder[Manifest] = msgspec.msgpack.Decoder(Manifest)


def encode_manifest(manifest: Manifest) -> bytes:
    """The manifest block: ``MANIFEST_MAGIC`` + deterministic msgpack (equal in, equal out)."""
    _validate(manifest)
    return MANIFEST_MAGIC + _encoder.encode(manifest)


def is_manifest(data: Buffer) -> bool:
    """Whether ``data`` starts with the manifest magic (a cheap sniff, not a validation)."""
    return byte_view(data)[: len(MANIFEST_MAGIC)] == MANIFEST_MAGIC


def decode_manifest(data: Buffer, cid: Cid | None = None) -> Manifest:
    """Decode and validate a manifest block; MalformedManifest for anything else.

    Every count and length is bounded by the buffer (msgspec) and every field is checked
    (known dtype and encoding, sane shape, chunk value counts summing to the shape's size,
    link CIDs of the right codec, unique tensor names) before a manifest is returned.
    """
    view = byte_view(data)
    if view.nbytes < len(MANIFEST_MAGIC) or view[: len(MANIFEST_MAGIC)] != MANIFEST_MAGIC:
        raise MalformedManifest(f"does not start with {MANIFEST_MAGIC!r}", cid)
    try:
        manifest = _decoder.decode(view[len(MANIFEST_MAGIC) :])
    except (msgspec.DecodeError, InvalidCid, RecursionError) as exc:
        # RecursionError: msgpack nested too deeply (msgspec skips unknown values by recursion)
        raise MalformedManifest(str(exc), cid) from None
    _validate(manifest, cid)
    return manifest


def _validate(manifest: Manifest, cid: Cid | None = None) -> None:
    def bad(reason: str) -> MalformedManifest:
        return MalformedManifest(reason, cid)

    if not 0 <= manifest.num_samples <= _MAX_U64:
        raise bad(f"num_samples {manifest.num_samples} out of range")
    if isinstance(manifest, UpdateManifest):
        names = [ref.name for ref in manifest.tensors]
        if len(set(names)) != len(names):
            raise bad("duplicate tensor names")
        for ref in manifest.tensors:
            if ref.cid.codec is not Multicodec.TENSORSWAP_MANIFEST:
                raise bad(f"tensor {ref.name!r} links {ref.cid}, not a manifest CID")
        return
    try:
        DType.parse(manifest.dtype)
        Encoding(manifest.encoding)
    except (CodecError, ValueError) as exc:
        raise bad(str(exc)) from None
    if manifest.compression not in _COMPRESSIONS:
        raise bad(f"unknown compression {manifest.compression!r}")
    if len(manifest.shape) > MAX_NDIM or any(d < 0 for d in manifest.shape):
        raise bad(f"invalid shape {list(manifest.shape[:8])}")
    if manifest.extent > _MAX_EXTENT:  # no array has it, even with a zero dim (zero values)
        raise bad(f"shape {list(manifest.shape[:8])} spans more values than an array can")
    total = 0
    for i, chunk in enumerate(manifest.chunks):
        if chunk.cid.codec is not Multicodec.RAW:
            raise bad(f"chunk {i} links {chunk.cid}, not a raw CID")
        if not 0 < chunk.values <= _MAX_U64 or not 0 <= chunk.nbytes <= _MAX_U64:
            raise bad(f"chunk {i} has {chunk.values} values in {chunk.nbytes} bytes")
        total += chunk.values
    if total != manifest.size:
        raise bad(f"chunks hold {total} values, shape {list(manifest.shape)} needs {manifest.size}")


# ── tensors ──────────────────────────────────────────────────────────────────
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
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    enc = Encoding(encoding)
    flat = block.flat()
    per_chunk = max(1, chunk_bytes // block.dtype.itemsize)
    starts = range(0, flat.size, per_chunk)
    threads = _thread_count(workers, len(starts), block.nbytes)

    def put_chunk(start: int) -> ChunkRef:
        piece = TensorBlock("", flat[start : start + per_chunk])
        data = encode_block(piece, encoding=enc, compression=compression)
        # Parallel workers hash single-threaded: blake3's own pool would only contend.
        cid = store.put(data, hash=hash, adopt=True, threads=1 if threads > 1 else None)
        return ChunkRef(cid.to_bytes(), piece.size, data.size)

    refs = _map(put_chunk, starts, threads)
    manifest = TensorManifest(
        name=block.name,
        dtype=block.dtype.value,
        shape=block.shape,
        num_samples=block.num_samples,
        encoding=enc.value,
        compression=compression or "",
        chunks=tuple(refs),
        metadata=dict(block.metadata),
    )
    return store.put(encode_manifest(manifest), codec=Multicodec.TENSORSWAP_MANIFEST, hash=hash)


def read_manifest(store: BlockStore, cid: Cid, *, verify: bool | None = None) -> Manifest:
    """Fetch and decode the manifest ``cid`` (BlockNotFound if absent, MalformedManifest)."""
    if cid.codec is not Multicodec.TENSORSWAP_MANIFEST:
        raise MalformedManifest("not a manifest CID (codec is not tensorswap-manifest)", cid)
    return decode_manifest(store.get(cid, verify=verify), cid)


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
        values = _decode_chunk(buffers[0], manifest, 0, dtype, cid)
    elif not exact and buffers:
        # Compressed or lossy chunks: decode (and so check) every one before allocating.
        indices = range(len(chunks))
        decode = lambda i: _decode_chunk(buffers[i], manifest, i, dtype, cid)  # noqa: E731
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
            piece = _decode_chunk(buffers[i], manifest, i, dtype, cid)
            np.copyto(values[offsets[i] : offsets[i + 1]], piece)

        _map(fill, range(len(chunks)), threads)
    return TensorBlock(
        manifest.name, values.reshape(manifest.shape), manifest.num_samples, manifest.metadata
    )


def _decode_chunk(
    buf: memoryview, manifest: TensorManifest, index: int, dtype: DType, cid: Cid
) -> np.ndarray:
    chunk = manifest.chunks[index]
    try:
        # The manifest's value count bounds what the block's header may make the decoder
        # build: a small topk or compressed chunk cannot claim a huge shape.
        piece = decode_block(buf, max_values=min(chunk.values, MAX_DECODED_VALUES))
    except CodecError as exc:
        reason = f"chunk {index} ({chunk.cid}) holds no valid block of {chunk.values} values"
        raise MalformedManifest(f"{reason}: {exc}", cid) from exc
    if piece.dtype is not dtype or piece.shape != (chunk.values,):
        raise MalformedManifest(
            f"chunk {index} ({chunk.cid}) holds {piece.dtype} {list(piece.shape)}, "
            f"manifest says {dtype} [{chunk.values}]",
            cid,
        )
    return piece.values


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


def manifest_kind(manifest: Manifest) -> str:
    """``"tensor"`` or ``"update"``."""
    return "tensor" if isinstance(manifest, TensorManifest) else "update"


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
        refs.append(TensorRef(name, tensor_cid.to_bytes()))
    manifest = UpdateManifest(
        name=update.name,
        num_samples=update.num_samples,
        tensors=tuple(refs),
        metadata=dict(update.metadata),
    )
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


# ── reachability ─────────────────────────────────────────────────────────────
def manifest_closure(
    store: BlockStore,
    root: Cid,
    *,
    verify: bool | None = None,
    seen: set[Cid] | None = None,
) -> list[Cid]:
    """Every block ``root`` needs: itself, the manifests it links and all their chunks.

    Depth-first in manifest order, each CID once, ``root`` first; a raw ``root`` is its own
    closure. Manifests are read from ``store`` (BlockNotFound if one is missing); chunks are
    listed, not fetched. Use ``store.missing(closure)`` to find what a transfer must send.
    ``seen`` (shared across calls for several roots) skips blocks already listed, and gains
    the ones listed now: each block and each manifest decoding is visited once overall.
    """
    seen = set() if seen is None else seen
    order: list[Cid] = []
    stack = [root]
    while stack:
        cid = stack.pop()
        if cid in seen:
            continue
        seen.add(cid)
        order.append(cid)
        if cid.codec is Multicodec.TENSORSWAP_MANIFEST:
            manifest = read_manifest(store, cid, verify=verify)
            stack.extend(reversed(manifest.links()))
    return order
