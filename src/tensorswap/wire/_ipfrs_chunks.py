"""ipfrs chunks (seed 001): the 16-byte frame header and its limits, chunk files, reassembly."""

from __future__ import annotations

import functools
import struct
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Self

import numpy as np

from tensorswap.codec.ipfrs import decode_ipfrs_gradient, encode_ipfrs_gradient
from tensorswap.errors import CodecError
from tensorswap.wire.errors import (
    ChecksumMismatch,
    ChunkIndexOutOfRange,
    DuplicateChunk,
    FrameTooLarge,
    IncompleteStream,
    InvalidChunkPayload,
    TotalChunksMismatch,
)

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "FRAME_HEADER_SIZE",
    "GradientChunk",
    "GradientReassembler",
    "IpfrsFrameHeader",
    "IpfrsLimits",
    "chunk_count",
    "crc32",
]

DEFAULT_CHUNK_SIZE = 65_536
"""Values per chunk in ipfrs (65,536 float32, about 256 KiB of values)."""
FRAME_HEADER_SIZE = 16
_FRAME = struct.Struct("<IIII")


def crc32(data: Buffer) -> int:
    """CRC-32 (IEEE 802.3, as zlib and crc32fast compute it) of ``data``."""
    return zlib.crc32(data) & 0xFFFFFFFF


def chunk_count(n_values: int, chunk_size: int) -> int:
    """Chunks for ``n_values``: ceiling division, and 1 for an empty gradient (ipfrs rule)."""
    size = max(chunk_size, 1)
    return max(1, -(-n_values // size))


@dataclass(frozen=True, slots=True)
class IpfrsLimits:
    """Bounds on what a peer's frame headers may make the receiver allocate."""

    max_payload_len: int = 64 * 1024 * 1024
    """Largest chunk payload (the default 65,536-value chunk is about 512 KiB)."""
    max_total_chunks: int = 1 << 20
    """Largest total_chunks a stream may announce."""
    max_total_bytes: int = 8 * 1024**3
    """Largest sum of payload bytes of one stream."""
    max_in_place_bytes: int = 1024**3
    """Largest result a receiver allocates up front, from the first header, to receive the
    chunks straight into (``total_chunks * chunk_size`` float32). A stream announcing more is
    received chunk by chunk (memory grows with the bytes that really arrive) and joined at
    the end."""


@dataclass(frozen=True, slots=True)
class IpfrsFrameHeader:
    """``[chunk_index u32][total_chunks u32][payload_len u32][crc32 u32]``, little-endian."""

    chunk_index: int
    total_chunks: int
    payload_len: int
    checksum: int

    def pack(self) -> bytes:
        return _FRAME.pack(self.chunk_index, self.total_chunks, self.payload_len, self.checksum)

    @classmethod
    def unpack(cls, data: Buffer, limits: IpfrsLimits | None = None) -> Self:
        """Parse 16 bytes; FrameTooLarge when payload_len or total_chunks exceed ``limits``."""
        lim = limits or IpfrsLimits()
        header = cls(*_FRAME.unpack(bytes(data)))
        if header.payload_len > lim.max_payload_len:
            raise FrameTooLarge("ipfrs payload_len", header.payload_len, lim.max_payload_len)
        if header.total_chunks > lim.max_total_chunks:
            raise FrameTooLarge("ipfrs total_chunks", header.total_chunks, lim.max_total_chunks)
        return header


@dataclass(frozen=True, slots=True, eq=False)
class GradientChunk:
    """One chunk of a gradient stream: a slice of the values as an ipfrs gradient file."""

    session_id: str
    chunk_index: int
    total_chunks: int
    payload: Buffer
    """The Arrow IPC file bytes of this slice (any bytes-like object)."""
    checksum: int
    """CRC-32 (IEEE) of ``payload`` as sent."""

    @staticmethod
    def compute_checksum(data: Buffer) -> int:
        return crc32(data)

    def verify_checksum(self) -> bool:
        return crc32(self.payload) == self.checksum

    @property
    def header(self) -> IpfrsFrameHeader:
        length = memoryview(self.payload).nbytes
        return IpfrsFrameHeader(self.chunk_index, self.total_chunks, length, self.checksum)


@dataclass(frozen=True, slots=True)
class _Template:
    """The ipfrs gradient file of ``n`` values is ``prefix + values + suffix``.

    Everything but the values (magic, schema, record-batch message, validity bitmaps, the
    index column 0..n-1, padding, footer) depends on ``n`` alone, so a sender frames a chunk
    from the gradient's own memory between two cached byte strings, and checksums only the
    values (the prefix's CRC-32 is cached). A receiver that finds the same prefix and
    suffix around the values knows where they are without decoding the file.
    """

    n: int
    prefix: bytes
    suffix: bytes
    prefix_crc: int

    @property
    def nbytes(self) -> int:
        return len(self.prefix) + 4 * self.n + len(self.suffix)

    def crc(self, values: Buffer) -> int:
        """CRC-32 of ``prefix + values + suffix``, reading only ``values``."""
        return zlib.crc32(self.suffix, zlib.crc32(values, self.prefix_crc)) & 0xFFFFFFFF

    def frames_around(self, prefix: memoryview, suffix: memoryview) -> bool:
        """Whether received prefix and suffix bytes are this template's."""
        return _same(prefix, self.prefix) and _same(suffix, self.suffix)


def _same(a: memoryview, b: bytes) -> bool:
    return a.nbytes == len(b) and bool(
        np.array_equal(np.frombuffer(a, np.uint8), np.frombuffer(b, np.uint8))
    )


_TEMPLATE_MAX_VALUES = 1 << 22  # above this, chunks are encoded one by one (cache memory)


@functools.lru_cache(maxsize=8)
def _template(n: int) -> _Template | None:
    """Where the values sit in ``encode_ipfrs_gradient`` of n values (encode twice, diff).

    None if the file does not hold them verbatim in one place, or for chunks of more than
    ``_TEMPLATE_MAX_VALUES`` values (callers then encode each chunk).
    """
    if n > _TEMPLATE_MAX_VALUES:
        return None
    zeros = encode_ipfrs_gradient(np.zeros(n, np.float32))
    ones = encode_ipfrs_gradient(np.full(4 * n, 0xFF, np.uint8).view(np.float32))
    if len(zeros) != len(ones):
        return None
    if n == 0:
        return _Template(0, zeros, b"", crc32(zeros)) if zeros == ones else None
    differ = np.flatnonzero(np.frombuffer(zeros, np.uint8) != np.frombuffer(ones, np.uint8))
    start, end = int(differ[0]), int(differ[-1]) + 1
    if end - start != 4 * n:
        return None
    return _Template(n, zeros[:start], zeros[end:], crc32(zeros[:start]))


class GradientReassembler:
    """Collects the chunks of one stream in any order and checks each as it arrives.

    ``add`` raises, for the chunk at hand: ChunkIndexOutOfRange, TotalChunksMismatch (against
    the first chunk added), DuplicateChunk, ChecksumMismatch or InvalidChunkPayload; a chunk
    that raised is not kept. ``result`` raises IncompleteStream until every chunk is in.
    ``add`` is ``claim`` + ``verify`` + ``accept``; a receiver may run ``verify`` (CRC-32 and
    decoding, thread-safe) in a worker thread between the other two.
    """

    def __init__(self) -> None:
        self.total: int | None = None
        self._claimed: set[int] = set()
        self._parts: dict[int, np.ndarray] = {}
        self._out: np.ndarray | None = None  # the gradient, when chunks are received in place
        self._stride = 0
        self._placed: set[int] = set()

    def place(self, index: int, stride: int, limit: int) -> np.ndarray | None:
        """Where chunk ``index`` of ``stride`` values goes in the result, to receive into.

        The result is allocated on first use, for ``total * stride`` values, only if that
        is at most ``limit`` bytes (and the allocation succeeds) and every chunk so far was
        placed with this stride; otherwise None (receive the chunk apart). The values count
        once ``accept`` ed.
        """
        total = self.total
        if total is None or index >= total - 1:  # the last chunk may be shorter
            return None
        if self._out is None:
            if total * stride * 4 > limit:
                return None
            try:
                self._out = np.empty(total * stride, np.float32)
            except MemoryError:
                return None  # receive the chunks apart, as they come
            self._stride = stride
        elif stride != self._stride:
            return None
        return self._out[index * stride : (index + 1) * stride]

    def accept_placed(self, index: int) -> None:
        """Keep the verified values received in place for a claimed chunk."""
        assert self._out is not None
        stride = self._stride
        self._placed.add(index)
        self._parts[index] = self._out[index * stride : (index + 1) * stride]

    @property
    def received(self) -> int:
        return len(self._parts)

    @property
    def claimed(self) -> int:
        """Chunks whose headers were accepted (verified or not yet)."""
        return len(self._claimed)

    @property
    def complete(self) -> bool:
        return self.total is not None and len(self._parts) == self.total

    def check_header(self, header: IpfrsFrameHeader) -> None:
        """The index/total checks of ``add``, before the payload is read."""
        index, total = header.chunk_index, header.total_chunks
        if index >= total:
            raise ChunkIndexOutOfRange(index, total)
        if self.total is not None and total != self.total:
            raise TotalChunksMismatch(index, self.total, total)
        if index in self._claimed:
            raise DuplicateChunk(index)

    def claim(self, header: IpfrsFrameHeader) -> None:
        """Check and reserve the header's index (the stream's total is fixed by the first)."""
        self.check_header(header)
        self.total = header.total_chunks
        self._claimed.add(header.chunk_index)

    @staticmethod
    def verify(chunk: GradientChunk) -> np.ndarray:
        """The chunk's values after its CRC-32 and payload are checked."""
        actual = crc32(chunk.payload)
        if actual != chunk.checksum:
            raise ChecksumMismatch(chunk.chunk_index, chunk.checksum, actual)
        try:
            return decode_ipfrs_gradient(chunk.payload)
        except CodecError as exc:
            raise InvalidChunkPayload(chunk.chunk_index, str(exc)) from exc

    def accept(self, index: int, values: np.ndarray) -> None:
        """Keep the verified values of a claimed chunk."""
        self._parts[index] = values

    def add(self, chunk: GradientChunk) -> None:
        total = self.total
        self.claim(chunk.header)
        try:
            values = self.verify(chunk)
        except BaseException:
            self._claimed.discard(chunk.chunk_index)
            self.total = total if not self._claimed else self.total
            raise
        self.accept(chunk.chunk_index, values)

    def result(self) -> np.ndarray:
        """The gradient (float32, 1-D), chunks joined in index order."""
        if self.total is None or not self.complete:
            raise IncompleteStream(len(self._parts), self.total)
        if self.total == 1:
            return np.array(self._parts[0], dtype=np.float32)  # own the memory, writable
        last = self._parts[self.total - 1]
        out, stride = self._out, self._stride
        if out is not None and len(self._placed) == self.total - 1 and last.size <= stride:
            start = (self.total - 1) * stride  # every other chunk is in place already
            out[start : start + last.size] = last
            return out[: start + last.size]
        return np.concatenate([self._parts[i] for i in range(self.total)])
