"""Chunk a tensor exactly as ``store.put_tensor`` does, framed for the wire without copies."""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import blake3
import numpy as np

from tensorswap.cid import Cid, HashFunction, Multicodec, byte_view
from tensorswap.codec import TensorBlock, encode_block
from tensorswap.store.manifest import (
    ChunkRef,
    chunk_starts,
    encode_manifest,
    tensor_manifest,
    update_manifest,
)
from tensorswap.wire.connection import PreparedBlock, prepare_block
from tensorswap.wire.frames import Compression, CompressionChoice, choose_compression, crc32c

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["PreparedChunk", "TensorChunker", "manifest_chunk", "update_manifest_chunk"]


@dataclass(frozen=True, slots=True)
class PreparedChunk:
    """One block ready to offer and send: its CID, manifest entry and frame."""

    cid: Cid
    ref: ChunkRef | None
    frame: PreparedBlock


_SLICE = 256 * 1024  # hashed and checksummed together while the slice is in the L2 cache


def _digest_and_crc(
    parts: tuple[Buffer, ...], hash: HashFunction, crc: bool = True
) -> tuple[bytes, int | None]:
    """The hash digest and the CRC32C of ``parts`` joined, in one pass over the memory (the
    digest alone, and None, without ``crc``)."""
    hasher = blake3.blake3() if hash is HashFunction.BLAKE3 else hashlib.sha256()
    if not crc:
        for part in parts:
            hasher.update(byte_view(part))
        return hasher.digest(), None
    value = 0
    for part in parts:
        view = byte_view(part)
        for start in range(0, view.nbytes, _SLICE):
            piece = view[start : start + _SLICE]
            hasher.update(piece)
            value = crc32c(piece, value)
    return hasher.digest(), value


@dataclass(frozen=True, slots=True)
class _Template:
    """The bytes around the values in a chunk block of ``n`` values (dense, uncompressed)."""

    head: bytes
    tail: bytes


@functools.lru_cache(maxsize=64)
def _template(dtype: np.dtype, n: int) -> _Template | None:
    """Find where the values sit in ``encode_block`` of n values: encode twice, diff.

    Returns None if the encoding does not hold the values verbatim in one place (then the
    caller encodes each chunk instead). Cached: chunk sizes repeat across tensors.
    """
    nbytes = n * dtype.itemsize
    zeros = np.zeros(n, dtype=dtype)
    ones = np.full(nbytes, 0xFF, dtype=np.uint8).view(dtype)
    a = memoryview(encode_block(TensorBlock("", zeros))).cast("B")
    b = memoryview(encode_block(TensorBlock("", ones))).cast("B")
    if a.nbytes != b.nbytes:
        return None
    if n == 0:
        return _Template(bytes(a), b"") if a == b else None
    differ = np.flatnonzero(np.frombuffer(a, np.uint8) != np.frombuffer(b, np.uint8))
    start, end = int(differ[0]), int(differ[-1]) + 1
    if end - start != nbytes or bytes(a[start:end]) != bytes(nbytes):
        return None
    return _Template(bytes(a[:start]), bytes(a[end:]))


class TensorChunker:
    """Cuts ``tensor`` into the chunk blocks ``put_tensor(store, tensor, chunk_bytes=...,
    hash=...)`` stores (dense encoding, no Arrow compression), so the root CIDs are equal.

    Each chunk block is the codec's header, the tensor's own values and a trailer; it is
    hashed and checksummed part by part and framed with the values as a view of the
    tensor, so no chunk is copied (unless it is compressed). ``prepare`` is CPU-bound and
    thread-safe, meant for worker threads; the tensor must not change until it is sent.
    Without ``crc`` the frames carry no CRC32C (for a peer that accepted lean blocks).
    """

    def __init__(
        self,
        tensor: TensorBlock,
        *,
        chunk_bytes: int,
        hash: HashFunction = HashFunction.BLAKE3,
        compression: CompressionChoice = Compression.NONE,
        crc: bool = True,
    ) -> None:
        self.tensor = tensor
        self.crc = crc
        self.hash = HashFunction(hash)
        self.compression = compression
        self._flat = tensor.flat()
        self.starts = chunk_starts(self._flat.size, tensor.dtype.itemsize, chunk_bytes)
        self._per_chunk = self.starts.step
        sizes = {min(self._per_chunk, self._flat.size - s) for s in self.starts}
        self._templates = {n: _template(self._flat.dtype, n) for n in sizes}

    def prepare(self, start: int) -> PreparedChunk:
        values = self._flat[start : start + self._per_chunk]
        template = self._templates[values.size]
        if template is None:
            parts: tuple[Buffer, ...] = (encode_block(TensorBlock("", values)),)
        else:
            parts = (template.head, values.view(np.uint8).data, template.tail)
        digest, crc = _digest_and_crc(parts, self.hash, self.crc)
        cid = Cid(Multicodec.RAW, self.hash, digest)
        sample = values.view(np.uint8).data
        compression = choose_compression(sample, self.compression)
        frame = prepare_block(cid, parts, compression, data_crc=crc, crc=self.crc)
        return PreparedChunk(cid, ChunkRef(cid.to_bytes(), values.size, frame.raw_len), frame)

    def manifest(self, refs: list[ChunkRef]) -> PreparedChunk:
        """The tensor manifest block listing ``refs`` (in order)."""
        tensor = self.tensor
        manifest = tensor_manifest(
            tensor.name,
            tensor.dtype,
            tensor.shape,
            refs,
            num_samples=tensor.num_samples,
            metadata=tensor.metadata,
        )
        return manifest_chunk(encode_manifest(manifest), self.hash)


def manifest_chunk(data: bytes, hash: HashFunction = HashFunction.BLAKE3) -> PreparedChunk:
    """A manifest block ready to send."""
    cid = Cid.of(data, codec=Multicodec.TENSORSWAP_MANIFEST, hash=hash)
    return PreparedChunk(cid, None, prepare_block(cid, data))


def update_manifest_chunk(
    name: str,
    num_samples: int,
    tensors: list[tuple[str, Cid]],
    metadata: dict[str, str],
    hash: HashFunction = HashFunction.BLAKE3,
) -> PreparedChunk:
    """The update manifest block ``put_update`` would store for these tensor manifests."""
    manifest = update_manifest(name, num_samples, tensors, metadata)
    return manifest_chunk(encode_manifest(manifest), hash)
