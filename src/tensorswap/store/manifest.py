"""Tensor and model-update manifests (the format), and the one way chunks are cut and listed."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Literal

import msgspec
import numpy as np

from tensorswap.cid import Cid, Multicodec, byte_view
from tensorswap.codec import DType, Encoding, decode_block
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
    "TensorManifest",
    "TensorRef",
    "UpdateManifest",
    "chunk_bounds",
    "chunk_starts",
    "decode_chunk",
    "decode_manifest",
    "encode_manifest",
    "is_manifest",
    "manifest_closure",
    "manifest_kind",
    "read_manifest",
    "tensor_manifest",
    "update_manifest",
    "values_per_chunk",
]

MANIFEST_MAGIC = b"TSMF\x01"
"""First bytes of every manifest block: ``TSMF`` and format version 1."""
DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024
"""Default chunk size: tensors are cut every ``DEFAULT_CHUNK_BYTES // itemsize`` values."""
MAX_NDIM = 64
_MAX_U64 = 2**64 - 1
_MAX_EXTENT = 2**63 - 1  # numpy's largest array extent (npy_intp)
_COMPRESSIONS = ("", "lz4", "zstd")
Compression = Literal["lz4", "zstd"] | None


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


# ── the one way chunks are cut and manifests built ───────────────────────────
def values_per_chunk(itemsize: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """How many values of ``itemsize`` bytes one chunk of ``chunk_bytes`` holds (at least 1)."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    return max(1, chunk_bytes // itemsize)


def chunk_starts(size: int, itemsize: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> range:
    """The flat offsets where a tensor of ``size`` values is cut into chunks: every producer
    of tensor blocks (``put_tensor``, the wire's chunker, a round's result) cuts here, so
    equal values give equal chunk CIDs."""
    return range(0, size, values_per_chunk(itemsize, chunk_bytes))


def chunk_bounds(
    size: int, itemsize: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> tuple[int, ...]:
    """``chunk_starts`` followed by ``size``: ``(0, c, 2c, ..., size)`` (``(0,)`` when empty)."""
    if not size:
        return (0,)
    return (*chunk_starts(size, itemsize, chunk_bytes), size)


def tensor_manifest(
    name: str,
    dtype: DType | str,
    shape: tuple[int, ...],
    chunks: Iterable[ChunkRef],
    *,
    num_samples: int = 0,
    metadata: Mapping[str, str] | None = None,
    encoding: Encoding | str = Encoding.DENSE,
    compression: str = "",
) -> TensorManifest:
    """The manifest listing ``chunks`` (in order) of a tensor cut at ``chunk_starts``."""
    return TensorManifest(
        name=name,
        dtype=DType.parse(dtype).value if isinstance(dtype, str) else dtype.value,
        shape=tuple(shape),
        num_samples=num_samples,
        encoding=Encoding(encoding).value,
        compression=compression or "",
        chunks=tuple(chunks),
        metadata=dict(metadata or {}),
    )


def update_manifest(
    name: str,
    num_samples: int,
    tensors: Iterable[tuple[str, Cid]],
    metadata: Mapping[str, str] | None = None,
) -> UpdateManifest:
    """The model-update manifest linking each ``(name, tensor manifest CID)`` in order."""
    return UpdateManifest(
        name=name,
        num_samples=num_samples,
        tensors=tuple(TensorRef(n, cid.to_bytes()) for n, cid in tensors),
        metadata=dict(metadata or {}),
    )


def decode_chunk(
    buf: memoryview, manifest: TensorManifest, index: int, cid: Cid | None = None
) -> np.ndarray:
    """The values of chunk ``index`` of ``manifest`` from its block's bytes ``buf``.

    Checked against the manifest: the block's length, a decode bounded by the chunk's value
    count (and ``MAX_DECODED_VALUES``), its dtype and shape; MalformedManifest otherwise.
    """
    chunk = manifest.chunks[index]
    dtype = DType.parse(manifest.dtype)
    if buf.nbytes != chunk.nbytes:
        raise MalformedManifest(
            f"chunk {index} ({chunk.cid}) is {buf.nbytes} bytes, manifest says {chunk.nbytes}",
            cid,
        )
    try:
        # The manifest's value count bounds what the block's header may make the decoder
        # build: a small topk or compressed chunk cannot claim a huge shape.
        piece = decode_block(buf, max_values=min(chunk.values, MAX_DECODED_VALUES))
    except CodecError as exc:
        reason = f"chunk {index} ({chunk.cid}) holds no valid block of {chunk.values} values"
        raise MalformedManifest(f"{reason}: {exc}", cid) from exc
    if piece.dtype is not dtype or piece.shape != (chunk.values,):
        raise MalformedManifest(
            f"chunk {index} ({chunk.cid}) of {manifest.name!r} holds {piece.dtype} "
            f"{list(piece.shape)}, manifest says {dtype} [{chunk.values}]",
            cid,
        )
    return piece.values


def read_manifest(store: BlockStore, cid: Cid, *, verify: bool | None = None) -> Manifest:
    """Fetch and decode the manifest ``cid`` (BlockNotFound if absent, MalformedManifest)."""
    if cid.codec is not Multicodec.TENSORSWAP_MANIFEST:
        raise MalformedManifest("not a manifest CID (codec is not tensorswap-manifest)", cid)
    return decode_manifest(store.get(cid, verify=verify), cid)


def manifest_kind(manifest: Manifest) -> str:
    """``"tensor"`` or ``"update"``."""
    return "tensor" if isinstance(manifest, TensorManifest) else "update"


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
