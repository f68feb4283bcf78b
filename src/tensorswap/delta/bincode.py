"""bincode 1.x encoding of DWE fragments, byte-identical to axiom_engine, with a size cap."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from tensorswap.delta.fragment import KNOWN_SCHEMAS, DweFragment, DweLayerDelta
from tensorswap.errors import DeltaError

#: The crate's ``MAX_DWE_FRAGMENT_BYTES``: the default cap on one fragment's bincode bytes.
MAX_DWE_FRAGMENT_BYTES = 8 * 1024 * 1024
#: Default cap on the layer entries of one received fragment. Each entry becomes a few Python
#: objects (~400 bytes) however few of its 24 bytes it spends, so 8 MiB of empty layers took 140 MB
#: and 2-3 s of the listener's event loop; ``split_fragment`` never packs more into one part.
MAX_DWE_LAYERS = 4096
#: Largest cap a frame can announce: the length prefix is a u32.
MAX_FRAME_LIMIT = 0xFFFF_FFFF
#: Bytes of the length prefix in front of each fragment on a TCP stream.
FRAME_PREFIX_BYTES = 4
#: Bytes of an ``Option<String>`` hmac field holding a 64-hex-digit HMAC-SHA256.
HMAC_FIELD_BYTES = 1 + 8 + 64

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_U64X2 = struct.Struct("<QQ")
_F32 = np.dtype("<f4")
#: Most dims a layer entry may carry: numpy's 64, plus a slice entry's offset. A deeper shape
#: can never match a state, and each dim decodes to a Python int (8 bytes became ~44).
MAX_DWE_DIMS = 65
# Smallest encoded layer: layer_index, shape length, values length (all u64).
_MIN_LAYER_BYTES = 24


class FragmentTooLarge(DeltaError):
    """A fragment (or an announced frame length) exceeds the configured cap."""

    def __init__(self, size: int, limit: int, what: str = "fragment") -> None:
        self.size = size
        self.limit = limit
        self.what = what
        super().__init__(f"{what} too large: {size} > {limit} bytes")


class MalformedFragment(DeltaError):
    """Bytes that are not a valid bincode ``DweFragment``; nothing was allocated for them."""

    def __init__(self, reason: str, offset: int) -> None:
        self.reason = reason
        self.offset = offset
        super().__init__(f"malformed DWE fragment at byte {offset}: {reason}")


class TruncatedFragment(MalformedFragment):
    """A length or count in the fragment points past the end of the bytes."""

    def __init__(self, what: str, offset: int, needed: int, available: int) -> None:
        self.what = what
        self.needed = needed
        self.available = available
        super().__init__(f"{what} needs {needed} bytes, {available} available (truncated)", offset)


def check_limit(max_bytes: int) -> int:
    """Validate a size cap: 1 <= max_bytes <= 2**32 - 1 (what a u32 length prefix can carry)."""
    if not 1 <= max_bytes <= MAX_FRAME_LIMIT:
        raise ValueError(f"max_bytes must be in [1, {MAX_FRAME_LIMIT}], got {max_bytes}")
    return max_bytes


def _string(text: str) -> bytes:
    raw = text.encode("utf-8")
    return _U64.pack(len(raw)) + raw


def _layer_header(layer: DweLayerDelta) -> bytes:
    ndim = len(layer.shape)
    return struct.pack(f"<QQ{ndim}QQ", layer.layer_index, ndim, *layer.shape, layer.value_count)


def signed_pieces(fragment: DweFragment) -> Iterator[bytes | memoryview]:
    """The bincode of ``(schema, session_id, sequence, layers, state_hash)`` as ordered pieces.

    This is the whole axiom_engine 0.1.5 encoding, and exactly the bytes later axiom versions
    authenticate with HMAC. Value pieces are zero-copy views of the layers' arrays.
    """
    yield _string(fragment.schema) + _string(fragment.session_id)
    yield _U64.pack(fragment.sequence) + _U64.pack(len(fragment.layers))
    for layer in fragment.layers:
        yield _layer_header(layer)
        yield layer.values.data.cast("B")
    yield _string(fragment.state_hash)


def _hmac_piece(fragment: DweFragment, hmac_field: bool) -> bytes:
    if fragment.hmac is not None:
        return b"\x01" + _string(fragment.hmac)
    return b"\x00" if hmac_field else b""


def encoded_size(fragment: DweFragment, *, hmac_field: bool = False) -> int:
    """Exact length of :func:`encode_fragment`'s output, computed without encoding any values."""
    size = 8 + len(fragment.schema.encode("utf-8")) + 8 + len(fragment.session_id.encode("utf-8"))
    size += 8 + 8 + 8 + len(fragment.state_hash.encode("utf-8"))
    for layer in fragment.layers:
        size += 8 + 8 + 8 * len(layer.shape) + 8 + 4 * layer.value_count
    return size + len(_hmac_piece(fragment, hmac_field))


def _encode_into(fragment: DweFragment, out: memoryview, hmac_field: bool) -> int:
    pos = 0
    for piece in signed_pieces(fragment):
        end = pos + len(piece) if isinstance(piece, bytes) else pos + piece.nbytes
        out[pos:end] = piece
        pos = end
    tail = _hmac_piece(fragment, hmac_field)
    out[pos : pos + len(tail)] = tail
    return pos + len(tail)


def encode_fragment(
    fragment: DweFragment, *, hmac_field: bool = False, max_bytes: int = MAX_DWE_FRAGMENT_BYTES
) -> memoryview:
    """Serialize ``fragment`` to bincode 1.x exactly as the Rust crate does.

    Without an hmac the output is byte-identical to axiom_engine 0.1.5; with one, an
    ``Option<String>`` follows ``state_hash`` (``hmac_field=True`` also writes a ``None`` tag, for
    later axiom versions). The size is checked against ``max_bytes`` before anything is allocated
    (:class:`FragmentTooLarge`); values are copied with one memory copy per layer into a fresh,
    writable byte buffer (numpy-allocated: no zero-fill, huge pages), returned as a memoryview.
    """
    return _encode(fragment, hmac_field, check_limit(max_bytes), prefix=False)


def encode_frame(
    fragment: DweFragment, *, hmac_field: bool = False, max_bytes: int = MAX_DWE_FRAGMENT_BYTES
) -> memoryview:
    """A 4-byte little-endian length prefix followed by :func:`encode_fragment`, in one buffer."""
    return _encode(fragment, hmac_field, check_limit(max_bytes), prefix=True)


def _encode(fragment: DweFragment, hmac_field: bool, max_bytes: int, *, prefix: bool) -> memoryview:
    size = encoded_size(fragment, hmac_field=hmac_field)
    if size > max_bytes:
        raise FragmentTooLarge(size, max_bytes)
    start = FRAME_PREFIX_BYTES if prefix else 0
    # numpy's allocator skips bytearray's zero-fill and asks for huge pages: 4x faster at 8 MiB.
    buf = np.empty(start + size, dtype=np.uint8).data
    if prefix:
        _U32.pack_into(buf, 0, size)
    written = _encode_into(fragment, buf[start:], hmac_field)
    if written != size:  # a bug in encoded_size, never peer input
        raise RuntimeError(f"encoded {written} bytes, expected {size}")
    return buf


def read_frame_length(prefix: bytes | bytearray | memoryview, max_bytes: int) -> int:
    """Parse a 4-byte LE length prefix, refusing one above ``max_bytes`` before any allocation."""
    if len(prefix) != FRAME_PREFIX_BYTES:
        raise TruncatedFragment("length prefix", 0, FRAME_PREFIX_BYTES, len(prefix))
    (length,) = _U32.unpack(prefix)
    if length > max_bytes:
        raise FragmentTooLarge(length, max_bytes, "incoming fragment")
    return int(length)


class _Reader:
    """Bounds-checked cursor over a buffer; every length is checked before it is used."""

    def __init__(self, data: memoryview) -> None:
        self.data = data
        self.pos = 0
        self.end = len(data)

    @property
    def remaining(self) -> int:
        return self.end - self.pos

    def need(self, what: str, nbytes: int) -> None:
        if nbytes > self.remaining:
            raise TruncatedFragment(what, self.pos, nbytes, self.remaining)

    def u64(self, what: str) -> int:
        self.need(what, 8)
        (value,) = _U64.unpack_from(self.data, self.pos)
        self.pos += 8
        return int(value)

    def string(self, what: str) -> str:
        start, end = self.pos + 8, self.end
        if start > end:
            raise TruncatedFragment(f"{what} length", self.pos, 8, end - self.pos)
        (length,) = _U64.unpack_from(self.data, self.pos)
        if length > end - start:
            raise TruncatedFragment(what, start, length, end - start)
        self.pos = start + length
        try:
            return str(self.data[start : self.pos], "utf-8")
        except UnicodeDecodeError as exc:
            raise MalformedFragment(f"{what} is not valid UTF-8", start) from exc


@dataclass(frozen=True, eq=False)
class DecodedFragment:
    """A decoded fragment with the region its HMAC covers and whether an hmac field was present."""

    fragment: DweFragment
    signed: memoryview
    has_hmac_field: bool


def _decode_layer(reader: _Reader, index: int) -> DweLayerDelta:
    # The hot loop of decoding: straight-line unpacks, labels built only when failing.
    data, pos, end = reader.data, reader.pos, reader.end
    if end - pos < 16:
        raise TruncatedFragment(f"layers[{index}] header", pos, 16, end - pos)
    layer_index, ndim = _U64X2.unpack_from(data, pos)
    pos += 16
    if ndim > (end - pos - 8) // 8:  # the dims and the values length must fit
        raise TruncatedFragment(f"layers[{index}].shape", pos, 8 * ndim + 8, end - pos)
    if ndim > MAX_DWE_DIMS:
        raise MalformedFragment(
            f"layers[{index}] has {ndim} dims, more than the {MAX_DWE_DIMS} allowed", pos - 8
        )
    shape = struct.unpack_from(f"<{ndim}Q", data, pos) if ndim else ()
    pos += 8 * ndim
    (count,) = _U64.unpack_from(data, pos)
    pos += 8
    if count > (end - pos) // 4:
        raise TruncatedFragment(f"layers[{index}].values", pos, 4 * count, end - pos)
    values = np.frombuffer(data, dtype=_F32, count=count, offset=pos)
    reader.pos = pos + 4 * count
    return DweLayerDelta.from_decoded(layer_index, shape, values)


def decode_fragment_signed(
    data: bytes | bytearray | memoryview,
    *,
    max_bytes: int = MAX_DWE_FRAGMENT_BYTES,
    max_layers: int = MAX_DWE_LAYERS,
) -> DecodedFragment:
    """Decode bincode bytes into a fragment, keeping a view of the HMAC-covered prefix.

    Accepts the 0.1.5 layout (nothing after ``state_hash``) and the later one (an
    ``Option<String>`` hmac); trailing bytes after that are refused. Every count is bounded by
    the bytes actually present before anything is allocated, and the values are zero-copy
    read-only float32 views of ``data`` (keep ``data`` unchanged while the fragment lives).
    More than ``max_layers`` layer entries are refused before any is decoded.
    """
    view = memoryview(data).cast("B")
    if len(view) > check_limit(max_bytes):
        raise FragmentTooLarge(len(view), max_bytes)
    reader = _Reader(view)
    schema = reader.string("schema")
    session_id = reader.string("session_id")
    sequence = reader.u64("sequence")
    count = reader.u64("layers length")
    reader.need("layers", count * _MIN_LAYER_BYTES)
    if count > max_layers:
        raise MalformedFragment(f"{count} layers, more than the {max_layers} allowed", reader.pos)
    layers = tuple(_decode_layer(reader, index) for index in range(count))
    state_hash = reader.string("state_hash")
    signed_end = reader.pos
    hmac_hex: str | None = None
    has_field = reader.remaining > 0
    if has_field:
        reader.need("hmac tag", 1)
        tag = view[reader.pos]
        reader.pos += 1
        if tag == 1:
            hmac_hex = reader.string("hmac")
        elif tag != 0:
            raise MalformedFragment(f"invalid Option tag {tag} for hmac", reader.pos - 1)
    if reader.remaining:
        raise MalformedFragment(f"{reader.remaining} trailing bytes", reader.pos)
    fragment = DweFragment(schema, session_id, sequence, layers, state_hash, hmac_hex)
    return DecodedFragment(fragment, view[:signed_end], has_field)


def decode_fragment(
    data: bytes | bytearray | memoryview,
    *,
    max_bytes: int = MAX_DWE_FRAGMENT_BYTES,
    max_layers: int = MAX_DWE_LAYERS,
) -> DweFragment:
    """Decode bincode bytes into a :class:`DweFragment` (see :func:`decode_fragment_signed`)."""
    return decode_fragment_signed(data, max_bytes=max_bytes, max_layers=max_layers).fragment


def decode_fragment_file(
    data: bytes | bytearray | memoryview, *, max_bytes: int = MAX_DWE_FRAGMENT_BYTES
) -> DweFragment:
    """Recognise and decode a fragment file: a 4-byte LE length + bincode, or bare bincode.

    The framed form is taken when the prefix equals the remaining length. Raises
    :class:`MalformedFragment` (or :class:`FragmentTooLarge`) when the bytes are not a fragment.
    """
    view = memoryview(data).cast("B")
    if len(view) >= FRAME_PREFIX_BYTES:
        (length,) = _U32.unpack_from(view, 0)
        if length == len(view) - FRAME_PREFIX_BYTES:
            return decode_fragment(view[FRAME_PREFIX_BYTES:], max_bytes=max_bytes)
    return decode_fragment(view, max_bytes=max_bytes)


_SCHEMA_BYTES = frozenset(schema.encode() for schema in KNOWN_SCHEMAS)


def _starts_with_schema(view: memoryview) -> bool:
    if len(view) < 8:
        return False
    (length,) = _U64.unpack_from(view, 0)
    return length <= 64 and bytes(view[8 : 8 + length]) in _SCHEMA_BYTES


def looks_like_fragment_file(data: bytes | bytearray | memoryview) -> bool:
    """Cheap sniff: the bytes (framed or bare) start with a known DWE schema string.

    Reads at most the first 100 bytes; a True answer still needs :func:`decode_fragment_file`.
    """
    view = memoryview(data).cast("B")
    return _starts_with_schema(view) or _starts_with_schema(view[FRAME_PREFIX_BYTES:])
