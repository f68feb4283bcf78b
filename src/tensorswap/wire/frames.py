"""The tensorswap frame: a 32-byte header (magic, version, kind, flags, ids, CRC32C) + payload."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Literal, Self

import google_crc32c
import numpy as np
import pyarrow as pa

from tensorswap.cid import Cid
from tensorswap.errors import InvalidCid
from tensorswap.wire.errors import FrameTooLarge, ProtocolViolation

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "BLOCK_PREFIX_MAX",
    "HEADER_SIZE",
    "MAGIC",
    "NO_PAYLOAD_CRC",
    "PROTOCOL_VERSION",
    "BlockPrefix",
    "Compression",
    "CompressionChoice",
    "FrameHeader",
    "FrameKind",
    "choose_compression",
    "compress",
    "crc32c",
    "crc32c_combine",
    "decompress",
    "pack_block_prefix",
    "parse_block_prefix",
]

MAGIC = b"TSW"
PROTOCOL_VERSION = 1
HEADER_SIZE = 32
_HEADER = struct.Struct("<3sBBBHQQII")
_HEADER_CRC_OFFSET = 28
_COMPRESSION_MASK = 0x03
NO_PAYLOAD_CRC = 0x04
"""BLOCK flags bit 2: the payload carries no CRC32C (``payload_crc`` is 0); only between peers
that both accepted it at the handshake (``lean_blocks``), since the block's CID is checked."""
_BLOCK_FLAGS = _COMPRESSION_MASK | NO_PAYLOAD_CRC
_BLOCK_RAW_LEN = struct.Struct("<Q")
_MAX_CID_BYTES = 255
BLOCK_PREFIX_MAX = 1 + _MAX_CID_BYTES + _BLOCK_RAW_LEN.size
"""The largest possible block-frame prefix (CID length byte, CID, raw length)."""

assert _HEADER.size == HEADER_SIZE


class FrameKind(IntEnum):
    """What a frame carries. Every kind but BLOCK is a control message (see ``messages``)."""

    WELCOME = 1
    """server -> client, first frame: protocol, server nonce, whether a key is required."""
    HELLO = 2
    """client -> server: protocol, client nonce, HMAC proof when keyed."""
    READY = 3
    """server -> client: handshake accepted, the server's HMAC proof when keyed."""
    ERROR = 4
    """either way: a typed refusal (code, message); the sender closes afterwards."""
    OFFER = 5
    """client -> server: CIDs the client could send; answered by WANT."""
    WANT = 6
    """server -> client: the offered CIDs the server lacks, in offer order."""
    BLOCK = 7
    """either way: one store block (CID + bytes, compression in the flags)."""
    COMMIT = 8
    """client -> server: all blocks sent; roots to check complete; answered by COMMITTED."""
    COMMITTED = 9
    """server -> client: every block received is stored; roots complete; counts."""
    GET = 10
    """client -> server: send me these blocks; answered by BLOCK frames then GOT."""
    GOT = 11
    """server -> client: end of a GET answer, naming the CIDs the server does not hold."""
    REQUEST = 12
    """client -> server: an application request (app name + opaque body); answered by REPLY."""
    REPLY = 13
    """server -> client: the answer to a REQUEST, from the handler registered for its app."""


class Compression(IntEnum):
    """Block payload compression, bits 0-1 of the flags byte (chosen per block by the sender)."""

    NONE = 0
    ZSTD = 1
    LZ4 = 2


_CODECS: dict[Compression, str] = {Compression.ZSTD: "zstd", Compression.LZ4: "lz4"}

CompressionChoice = Compression | Literal["auto"]
"""Per-block compression: a fixed codec, or "auto" (zstd where a sample shrinks by 15%+)."""
_POOL = pa.system_memory_pool()
"""Decompressed blocks come from malloc: freed large buffers go back to the OS at once."""
_AUTO_SAMPLE = 64 * 1024
_AUTO_RATIO = 0.85


def crc32c(data: Buffer, value: int = 0) -> int:
    """CRC32C (Castagnoli) of ``data``, continuing from ``value``; any buffer, never copied."""
    if not isinstance(data, bytes):
        data = pa.py_buffer(data)  # google-crc32c takes only buffers without a release hook
    return int(google_crc32c.extend(value, data))


# CRC combination (as zlib's crc32_combine, for the reflected Castagnoli polynomial): lets a
# sender checksum a block's data while hashing it, before the prefix (which holds the hash)
# is known, then join the two CRCs without reading the data again.
_CRC32C_POLY = 0x82F63B78


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC polynomial (reflected bit order)."""
    m = 1 << 31
    p = 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _CRC32C_POLY if b & 1 else b >> 1


_X2N = [1 << 30]  # x^(2^k) mod p for k = 0..63
for _ in range(63):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC32C of ``A + B`` from ``crc1 = crc32c(A)``, ``crc2 = crc32c(B)``, ``len(B)``."""
    shift = 1 << 31  # x^0
    n, k = len2, 3  # multiply crc1 by x^(8 * len2)
    while n:
        if n & 1:
            shift = _multmodp(_X2N[k & 63], shift)
        n >>= 1
        k += 1
    return _multmodp(shift, crc1) ^ crc2


@dataclass(frozen=True, slots=True)
class FrameHeader:
    """The fixed 32-byte frame header, little-endian (layout in ``docs/protocol.md``)::

    0  3  magic  b"TSW"           16  8  payload_len  u64
    3  1  version (1)              24  4  payload_crc  u32  CRC32C of the payload
    4  1  kind  (FrameKind)        28  4  header_crc   u32  CRC32C of bytes 0..28
    5  1  flags (bits 0-1: Compression; bit 2: NO_PAYLOAD_CRC; bits 3-7 zero)
    6  2  reserved, zero
    8  8  stream_id  u64 (request id chosen by the client, echoed by the server)
    """

    kind: FrameKind
    payload_len: int
    payload_crc: int
    stream_id: int = 0
    flags: int = 0

    @property
    def compression(self) -> Compression:
        return Compression(self.flags & _COMPRESSION_MASK)

    @property
    def lean(self) -> bool:
        """A BLOCK frame without a payload CRC32C (``NO_PAYLOAD_CRC``)."""
        return bool(self.flags & NO_PAYLOAD_CRC)

    def pack(self) -> bytes:
        head = _HEADER.pack(
            MAGIC,
            PROTOCOL_VERSION,
            self.kind,
            self.flags,
            0,
            self.stream_id,
            self.payload_len,
            self.payload_crc,
            0,
        )
        return head[:_HEADER_CRC_OFFSET] + struct.pack("<I", crc32c(head[:_HEADER_CRC_OFFSET]))

    @classmethod
    def unpack(cls, data: Buffer, *, max_payload: int, max_block_payload: int) -> Self:
        """Parse and validate 32 header bytes; the payload length is bounded before use.

        Raises ProtocolViolation (bad magic, version, header CRC, kind, flags or reserved
        bits) or FrameTooLarge (payload_len above ``max_block_payload`` for BLOCK frames,
        ``max_payload`` for the others).
        """
        raw = bytes(data)
        if len(raw) != HEADER_SIZE:
            raise ProtocolViolation(f"frame header must be {HEADER_SIZE} bytes, got {len(raw)}")
        magic, version, kind, flags, reserved, stream_id, length, pcrc, hcrc = _HEADER.unpack(raw)
        if magic != MAGIC:
            raise ProtocolViolation(f"bad frame magic {magic!r}, expected {MAGIC!r}")
        if version != PROTOCOL_VERSION:
            raise ProtocolViolation(f"unsupported frame version {version}")
        actual = crc32c(raw[:_HEADER_CRC_OFFSET])
        if actual != hcrc:
            raise ProtocolViolation(f"header CRC32C {hcrc:#010x} != computed {actual:#010x}")
        try:
            frame_kind = FrameKind(kind)
        except ValueError:
            raise ProtocolViolation(f"unknown frame kind {kind}") from None
        if reserved:
            raise ProtocolViolation(f"reserved header bytes are {reserved:#06x}, must be zero")
        if flags & ~_BLOCK_FLAGS:
            raise ProtocolViolation(f"reserved flag bits set: {flags:#04x}")
        if frame_kind is FrameKind.BLOCK:
            try:
                Compression(flags & _COMPRESSION_MASK)
            except ValueError:
                raise ProtocolViolation(f"unknown compression {flags & 3}") from None
            if flags & NO_PAYLOAD_CRC and pcrc:
                raise ProtocolViolation(f"BLOCK without a CRC32C has payload_crc {pcrc:#010x}")
            limit = max_block_payload
        else:
            if flags:
                raise ProtocolViolation(f"{frame_kind.name} frame with flags {flags:#04x}")
            limit = max_payload
        if length > limit:
            raise FrameTooLarge(f"{frame_kind.name} payload_len", length, limit)
        return cls(frame_kind, length, pcrc, stream_id, flags)


@dataclass(frozen=True, slots=True)
class BlockPrefix:
    """The start of a BLOCK payload: ``[u8 cid_len][cid][u64 raw_len]``, then the data."""

    cid: Cid
    raw_len: int
    size: int
    """Bytes the prefix occupies (the data starts here)."""


def pack_block_prefix(cid: Cid, raw_len: int) -> bytes:
    """The prefix bytes for a block of ``raw_len`` uncompressed bytes."""
    cid_bytes = cid.to_bytes()
    return bytes([len(cid_bytes)]) + cid_bytes + _BLOCK_RAW_LEN.pack(raw_len)


def parse_block_prefix(payload: memoryview, *, max_raw_len: int) -> BlockPrefix:
    """Parse a BLOCK payload's prefix; ProtocolViolation/FrameTooLarge on anything malformed."""
    if payload.nbytes < 1:
        raise ProtocolViolation("empty BLOCK payload")
    cid_len = payload[0]
    end = 1 + cid_len + _BLOCK_RAW_LEN.size
    if cid_len == 0 or payload.nbytes < end:
        raise ProtocolViolation(f"BLOCK payload of {payload.nbytes} bytes too short for its CID")
    try:
        cid = Cid.parse(payload[1 : 1 + cid_len])
    except InvalidCid as exc:
        raise ProtocolViolation(f"BLOCK frame carries an invalid CID: {exc.reason}") from exc
    (raw_len,) = _BLOCK_RAW_LEN.unpack_from(payload, 1 + cid_len)
    if raw_len > max_raw_len:
        raise FrameTooLarge("BLOCK raw_len", raw_len, max_raw_len)
    return BlockPrefix(cid, raw_len, end)


def compress(data: Buffer, compression: Compression) -> Buffer:
    """``data`` compressed with ``compression`` (NONE returns ``data`` itself)."""
    if compression is Compression.NONE:
        return data
    return pa.Codec(_CODECS[compression]).compress(data, asbytes=False)


def decompress(data: Buffer, compression: Compression, raw_len: int) -> Buffer:
    """Inverse of ``compress``: exactly ``raw_len`` bytes or ProtocolViolation.

    ``raw_len`` must already be bounded by the caller; it is the only allocation made, and
    it is made outside pyarrow's default pool (mimalloc or jemalloc, which keep freed pages):
    from the C allocator, which returns a large buffer to the OS as soon as it is freed, so
    a burst of large (hostile) blocks does not leave the process at its peak.
    """
    if compression is Compression.NONE:
        if memoryview(data).nbytes != raw_len:
            raise ProtocolViolation(
                f"uncompressed BLOCK of {memoryview(data).nbytes} bytes says raw_len {raw_len}"
            )
        return data
    try:
        if compression is Compression.LZ4:
            # pyarrow's LZ4 Codec.decompress returns the size asked for, its tail left
            # uninitialised when the data is shorter: read one byte more than raw_len from a
            # stream instead (into memory of our own), so that both a shorter and a longer
            # content show in the size.
            into = memoryview(np.empty(raw_len + 1, np.uint8))  # type: ignore[arg-type]
            size = _read_lz4(data, into)
            out: Buffer = into[:raw_len]
        else:  # zstd checks the size itself (a mismatch fails to decompress)
            out = pa.Codec(_CODECS[compression]).decompress(
                data, decompressed_size=raw_len, asbytes=False, memory_pool=_POOL
            )
            size = memoryview(out).nbytes
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise ProtocolViolation(f"{compression.name} block does not decompress: {exc}") from exc
    if size != raw_len:
        raise ProtocolViolation(
            f"{compression.name} block decompressed to {size} bytes, raw_len {raw_len}"
        )
    return out


def _read_lz4(data: Buffer, into: memoryview) -> int:
    """Decompress the LZ4 frame ``data`` into ``into``, up to its size; the bytes written."""
    with pa.CompressedInputStream(pa.BufferReader(pa.py_buffer(data)), "lz4") as stream:
        done = 0
        while done < into.nbytes:
            got = stream.readinto(into[done:])
            if not got:
                break
            done += got
    return done


def choose_compression(data: memoryview, choice: CompressionChoice) -> Compression:
    """The codec for one block: ``choice`` itself, or for "auto" zstd if a sample shrinks."""
    if choice != "auto":
        return Compression(choice)
    sample = data[:_AUTO_SAMPLE]
    if sample.nbytes < 512:
        return Compression.NONE
    packed = memoryview(compress(sample, Compression.ZSTD)).nbytes
    return Compression.ZSTD if packed < _AUTO_RATIO * sample.nbytes else Compression.NONE
