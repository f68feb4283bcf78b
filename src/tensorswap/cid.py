"""CIDv1 content identifiers: multicodec + multihash, base32 string form, strict parsing."""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Self

import blake3

from tensorswap.errors import HashMismatch, InvalidCid

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "CID_VERSION",
    "MULTITHREAD_HASH_BYTES",
    "Cid",
    "HashFunction",
    "Multicodec",
    "byte_view",
    "decode_varint",
    "encode_varint",
    "hash_digest",
]

CID_VERSION = 1
"""The only CID version tensorswap reads or writes."""

MULTITHREAD_HASH_BYTES = 256 * 1024
"""Buffers at least this large are hashed with multi-threaded blake3 (measured break-even)."""

_MAX_VARINT_BYTES = 9  # the multiformats unsigned-varint spec caps varints at 9 bytes (63 bits)
_MULTIBASE_BASE32 = "b"  # multibase prefix: rfc4648 base32, lower-case, no padding
_CACHED = 16384  # CIDs whose string form and parse are remembered (a few MiB at most)
_B32_ALPHABET = frozenset("abcdefghijklmnopqrstuvwxyz234567")
_B32_BAD_LENGTHS = frozenset({1, 3, 6})  # len % 8 that no byte string encodes to


class Multicodec(IntEnum):
    """What the addressed bytes are (the CID's content type)."""

    RAW = 0x55
    """Opaque bytes: tensor chunks and any other leaf block."""
    TENSORSWAP_MANIFEST = 0x300001
    """A tensorswap manifest (tensor or model update); private-use range 0x300000-0x3fffff."""
    TENSORSWAP_MASKED = 0x300002
    """A SecAgg+ masked vector (little-endian uint32 words, uniform on their own): a leaf
    block that a coordinator holds in memory only (a restart fails a secure round anyway)."""


class HashFunction(IntEnum):
    """Multihash function codes and their digest sizes."""

    SHA2_256 = 0x12
    BLAKE3 = 0x1E

    @property
    def digest_size(self) -> int:
        """Digest length in bytes (32 for both functions)."""
        return 32

    @property
    def label(self) -> str:
        """The multicodec table name: ``"sha2-256"`` or ``"blake3"``."""
        return _HASH_LABELS[self]

    @classmethod
    def parse(cls, value: str | int | HashFunction) -> HashFunction:
        """Look a hash function up by label (``"blake3"``, ``"sha2-256"``), name or code."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            key = value.strip().lower()
            for member, label in _HASH_LABELS.items():
                if key in (label, member.name.lower(), label.replace("2-", "")):
                    return member
            raise ValueError(f"unknown hash function {value!r}; known: {sorted(_LABEL_SET)}")
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"unknown multihash code {value!r}") from None


_HASH_LABELS = {HashFunction.SHA2_256: "sha2-256", HashFunction.BLAKE3: "blake3"}
_LABEL_SET = frozenset(_HASH_LABELS.values())


def hash_digest(
    data: Buffer, hash: HashFunction = HashFunction.BLAKE3, *, threads: int | None = None
) -> bytes:
    """The raw digest of ``data`` (any C-contiguous buffer; never copied).

    ``threads`` caps blake3's worker threads: None picks by size (all cores from
    ``MULTITHREAD_HASH_BYTES`` up), 1 hashes on the calling thread (best when the caller
    already hashes several buffers in parallel). Raises ValueError (from
    ``memoryview.cast``) for a non-contiguous buffer.
    """
    view = byte_view(data)
    if hash is HashFunction.BLAKE3:
        if threads is None:
            threads = blake3.blake3.AUTO if view.nbytes >= MULTITHREAD_HASH_BYTES else 1
        return blake3.blake3(view, max_threads=threads).digest()
    if hash is HashFunction.SHA2_256:
        return hashlib.sha256(view).digest()
    raise ValueError(f"unsupported hash function {hash!r}")


def byte_view(data: Buffer) -> memoryview:
    """A flat unsigned-byte view of ``data`` (zero-copy; blake3 insists on format 'B')."""
    view = data if isinstance(data, memoryview) else memoryview(data)
    if view.format == "B" and view.ndim == 1:
        return view
    return view.cast("B")


def encode_varint(value: int) -> bytes:
    """Unsigned LEB128 varint, minimal, as the multiformats spec requires."""
    if value < 0 or value >= 1 << 63:
        raise ValueError(f"varint out of range: {value}")
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def decode_varint(data: bytes, offset: int = 0) -> tuple[int, int]:
    """Read a minimal unsigned varint at ``offset``; return ``(value, next_offset)``.

    Raises ValueError for a truncated, over-long (more than 9 bytes) or non-minimal varint.
    """
    value = 0
    shift = 0
    for i in range(_MAX_VARINT_BYTES):
        pos = offset + i
        if pos >= len(data):
            raise ValueError("truncated varint")
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            if byte == 0 and i > 0:
                raise ValueError("non-minimal varint")
            return value, pos + 1
        shift += 7
    raise ValueError("varint longer than 9 bytes")


@functools.lru_cache(maxsize=_CACHED)
def _text_of(codec: int, hash: int, digest: bytes) -> str:
    """The base32 string form (cached: servers name the same blocks again and again)."""
    raw = encode_varint(CID_VERSION) + encode_varint(codec) + encode_varint(hash)
    raw += encode_varint(len(digest)) + digest
    return _MULTIBASE_BASE32 + base64.b32encode(raw).decode("ascii").rstrip("=").lower()


@dataclass(frozen=True, slots=True, order=True)
class Cid:
    """A CIDv1: ``<varint 1><varint codec><varint hash code><varint digest length><digest>``.

    Immutable, hashable and totally ordered (by codec, hash code, digest). ``str(cid)`` is the
    multibase base32 form (``b`` + lower-case rfc4648 base32 without padding); ``bytes(cid)``
    and ``cid.to_bytes()`` are the binary form.
    """

    codec: Multicodec
    hash: HashFunction
    digest: bytes

    def __post_init__(self) -> None:
        try:
            codec = Multicodec(self.codec)
        except ValueError:
            raise InvalidCid(self.codec, f"unknown multicodec 0x{self.codec:x}") from None
        try:
            hash_fn = HashFunction(self.hash)
        except ValueError:
            raise InvalidCid(self.hash, f"unknown multihash code 0x{self.hash:x}") from None
        digest = bytes(self.digest)
        if len(digest) != hash_fn.digest_size:
            raise InvalidCid(
                digest,
                f"{hash_fn.label} digest must be {hash_fn.digest_size} bytes, got {len(digest)}",
            )
        object.__setattr__(self, "codec", codec)
        object.__setattr__(self, "hash", hash_fn)
        object.__setattr__(self, "digest", digest)

    @classmethod
    def of(
        cls,
        data: Buffer,
        codec: Multicodec = Multicodec.RAW,
        hash: HashFunction = HashFunction.BLAKE3,
        *,
        threads: int | None = None,
    ) -> Self:
        """The CID of ``data`` (any C-contiguous buffer, hashed in place without copying).

        ``threads``: as for ``hash_digest`` (None: automatic by size).
        """
        hash_fn = HashFunction(hash)
        return cls(Multicodec(codec), hash_fn, hash_digest(data, hash_fn, threads=threads))

    @classmethod
    def parse(cls, value: str | bytes | bytearray | memoryview | Cid) -> Self:
        """Parse the string form (``str``) or the binary form (bytes-like); strict. A
        ``Cid`` of this class is returned as it is (code written when records held strings
        keeps working).

        Raises InvalidCid for a wrong multibase, bad base32, CIDv0, a version other than 1,
        a bad varint, an unknown codec or hash code, a wrong digest length or trailing bytes.
        """
        if isinstance(value, cls):
            return value
        if cls is Cid and isinstance(value, str | bytes):
            return _parse_cached(value)  # type: ignore[return-value]
        if isinstance(value, str):
            return cls._parse_binary(_base32_decode(value), value)
        if isinstance(value, bytes | bytearray | memoryview):
            raw = bytes(value)
            return cls._parse_binary(raw, raw)
        raise InvalidCid(value, f"expected str or bytes, got {type(value).__name__}")

    @classmethod
    def _parse_binary(cls, raw: bytes, shown: object) -> Self:
        if len(raw) == 34 and raw[:2] == b"\x12\x20":
            raise InvalidCid(shown, "CIDv0 is not supported; use CIDv1")
        try:
            version, pos = decode_varint(raw, 0)
            codec_code, pos = decode_varint(raw, pos)
            hash_code, pos = decode_varint(raw, pos)
            digest_len, pos = decode_varint(raw, pos)
        except ValueError as exc:
            raise InvalidCid(shown, str(exc)) from None
        if version != CID_VERSION:
            raise InvalidCid(shown, f"unsupported CID version {version}")
        try:
            codec = Multicodec(codec_code)
        except ValueError:
            raise InvalidCid(shown, f"unknown multicodec 0x{codec_code:x}") from None
        try:
            hash_fn = HashFunction(hash_code)
        except ValueError:
            raise InvalidCid(shown, f"unknown multihash code 0x{hash_code:x}") from None
        if digest_len != hash_fn.digest_size:
            raise InvalidCid(shown, f"{hash_fn.label} digest length {digest_len} != 32")
        end = pos + digest_len
        if len(raw) < end:
            raise InvalidCid(shown, f"digest truncated: {len(raw) - pos} of {digest_len} bytes")
        if len(raw) > end:
            raise InvalidCid(shown, f"{len(raw) - end} trailing bytes after the digest")
        return cls(codec, hash_fn, raw[pos:end])

    def to_bytes(self) -> bytes:
        """The binary CID."""
        return (
            encode_varint(CID_VERSION)
            + encode_varint(self.codec)
            + encode_varint(self.hash)
            + encode_varint(len(self.digest))
            + self.digest
        )

    def __bytes__(self) -> bytes:
        return self.to_bytes()

    def __str__(self) -> str:
        return _text_of(self.codec, self.hash, self.digest)

    def __repr__(self) -> str:
        return f"Cid({str(self)!r})"

    def matches(self, data: Buffer) -> bool:
        """Whether ``data`` hashes to this CID's digest."""
        return hash_digest(data, self.hash) == self.digest

    def verify(self, data: Buffer, context: str = "") -> None:
        """Return if ``data`` hashes to this CID; raise HashMismatch (naming both) otherwise."""
        actual = hash_digest(data, self.hash)
        if actual != self.digest:
            raise HashMismatch(self, Cid(self.codec, self.hash, actual), context)


@functools.lru_cache(maxsize=_CACHED)
def _parse_cached(value: str | bytes) -> Cid:
    """``Cid.parse`` of an immutable value, cached (a failure is not: it raises each time)."""
    if isinstance(value, str):
        return Cid._parse_binary(_base32_decode(value), value)
    return Cid._parse_binary(value, value)


def _base32_decode(text: str) -> bytes:
    if not text:
        raise InvalidCid(text, "empty string")
    if text[0] != _MULTIBASE_BASE32:
        if text.startswith("Qm"):
            raise InvalidCid(text, "CIDv0 is not supported; use CIDv1")
        raise InvalidCid(text, f"unsupported multibase prefix {text[0]!r}; expected 'b'")
    body = text[1:]
    if not body or not _B32_ALPHABET.issuperset(body):
        raise InvalidCid(text, "not lower-case base32 (rfc4648, no padding)")
    if len(body) % 8 in _B32_BAD_LENGTHS:
        raise InvalidCid(text, "impossible base32 length")
    padded = body.upper() + "=" * (-len(body) % 8)
    try:
        raw = base64.b32decode(padded)
    except (binascii.Error, ValueError) as exc:
        raise InvalidCid(text, f"bad base32: {exc}") from None
    # Reject non-canonical encodings (non-zero pad bits), so one CID has one string.
    if base64.b32encode(raw).decode("ascii").rstrip("=") != body.upper():
        raise InvalidCid(text, "non-canonical base32 (non-zero padding bits)")
    return raw
