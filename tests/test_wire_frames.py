"""The tensorswap frame: header bytes, validation, control messages, block frames, fuzzing."""

from __future__ import annotations

import asyncio
import contextlib
import struct

import google_crc32c
import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.memory import traced
from tensorswap.cid import Cid, Multicodec
from tensorswap.errors import WireError
from tensorswap.wire.connection import FrameConnection, Timeouts, WireLimits, prepare_block
from tensorswap.wire.errors import (
    ChecksumMismatch,
    FrameTooLarge,
    PeerTimeout,
    ProtocolViolation,
    RemoteError,
    StreamEnded,
    UnexpectedEof,
)
from tensorswap.wire.frames import (
    HEADER_SIZE,
    MAGIC,
    Compression,
    FrameHeader,
    FrameKind,
    compress,
    crc32c,
    crc32c_combine,
    decompress,
    pack_block_prefix,
    parse_block_prefix,
)
from tensorswap.wire.messages import (
    MESSAGE_TYPES,
    Error,
    Offer,
    Want,
    decode_message,
    encode_message,
    parse_cids,
    wire_cids,
)
from tensorswap.wire.transport import memory_pair

BIG = 1 << 40


def unpack(raw: bytes, limit: int = 1 << 20) -> FrameHeader:
    return FrameHeader.unpack(raw, max_payload=limit, max_block_payload=limit)


def test_crc32c_known_vector_and_buffers() -> None:
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    data = np.arange(1000, dtype=np.float32)
    assert crc32c(data) == google_crc32c.value(data.tobytes())
    assert crc32c(b"6789", crc32c(b"12345")) == 0xE3069283


@given(st.binary(max_size=300), st.binary(max_size=300))
def test_crc32c_combine_joins_two_checksums(a: bytes, b: bytes) -> None:
    assert crc32c_combine(crc32c(a), crc32c(b), len(b)) == crc32c(a + b)


def test_crc32c_combine_over_a_block_sized_gap() -> None:
    a, b = b"prefix", np.arange(1 << 20, dtype=np.uint32).tobytes()  # 4 MiB
    assert crc32c_combine(crc32c(a), crc32c(b), len(b)) == crc32c(a + b)


def test_header_layout_is_documented_bytes() -> None:
    header = FrameHeader(FrameKind.BLOCK, 0x0102030405, 0xAABBCCDD, 7, int(Compression.ZSTD))
    raw = header.pack()
    assert len(raw) == HEADER_SIZE == 32
    assert raw[:3] == MAGIC == b"TSW"
    assert raw[3] == 1 and raw[4] == FrameKind.BLOCK and raw[5] == 1
    assert raw[6:8] == b"\0\0"
    assert struct.unpack_from("<QQI", raw, 8) == (7, 0x0102030405, 0xAABBCCDD)
    assert struct.unpack_from("<I", raw, 28)[0] == google_crc32c.value(raw[:28])
    assert unpack(raw, BIG) == header
    assert header.compression is Compression.ZSTD


def _with(raw: bytes, offset: int, value: bytes, fix_crc: bool = True) -> bytes:
    out = bytearray(raw)
    out[offset : offset + len(value)] = value
    if fix_crc:
        out[28:32] = struct.pack("<I", google_crc32c.value(bytes(out[:28])))
    return bytes(out)


GOOD = FrameHeader(FrameKind.OFFER, 10, 0).pack()


@pytest.mark.parametrize(
    ("offset", "value", "fix_crc", "needle"),
    [
        (0, b"XSW", True, "magic"),
        (3, b"\x02", True, "version"),
        (4, b"\x63", True, "kind"),
        (6, b"\x01", True, "reserved"),
        (5, b"\x04", True, "flag"),
        (5, b"\x01", True, "OFFER frame with flags"),
        (16, b"\x01", False, "header CRC32C"),
    ],
)
def test_bad_headers_are_protocol_violations(
    offset: int, value: bytes, fix_crc: bool, needle: str
) -> None:
    with pytest.raises(ProtocolViolation, match=needle):
        unpack(_with(GOOD, offset, value, fix_crc))


def test_unknown_compression_is_refused() -> None:
    raw = FrameHeader(FrameKind.BLOCK, 10, 0, flags=3).pack()
    with pytest.raises(ProtocolViolation, match="compression"):
        unpack(raw)


def test_payload_length_bounded_per_kind() -> None:
    control = FrameHeader(FrameKind.OFFER, 2000, 0).pack()
    block = FrameHeader(FrameKind.BLOCK, 2000, 0).pack()
    with pytest.raises(FrameTooLarge) as info:
        FrameHeader.unpack(control, max_payload=1000, max_block_payload=5000)
    assert (info.value.length, info.value.limit) == (2000, 1000)
    assert FrameHeader.unpack(block, max_payload=1000, max_block_payload=5000).payload_len == 2000


def test_message_registry_is_complete() -> None:
    assert set(MESSAGE_TYPES) == set(FrameKind) - {FrameKind.BLOCK}


def test_message_round_trip_and_bad_payloads() -> None:
    cids = [Cid.of(b"a"), Cid.of(b"b", codec=Multicodec.TENSORSWAP_MANIFEST)]
    kind, payload = encode_message(Offer(cids=wire_cids(cids)))
    assert kind is FrameKind.OFFER
    decoded = decode_message(kind, payload)
    assert isinstance(decoded, Offer)
    assert parse_cids(decoded.cids) == cids
    with pytest.raises(ProtocolViolation):
        decode_message(FrameKind.OFFER, b"\xc1")
    with pytest.raises(ProtocolViolation):
        decode_message(FrameKind.OFFER, msgspec.msgpack.encode({"cids": "nope"}))
    with pytest.raises(ProtocolViolation, match="invalid CID"):
        parse_cids([b"\x01\x55\x1e\x20short"])
    with pytest.raises(ProtocolViolation):
        decode_message(FrameKind.BLOCK, payload)


def test_unknown_fields_from_newer_peers_are_ignored() -> None:
    payload = msgspec.msgpack.encode({"cids": [], "future": 1})
    assert decode_message(FrameKind.WANT, payload) == Want(cids=[])


def test_block_prefix_round_trip_and_bounds() -> None:
    cid = Cid.of(b"block")
    prefix = pack_block_prefix(cid, 5)
    assert prefix[0] == len(cid.to_bytes())
    parsed = parse_block_prefix(memoryview(prefix + b"block"), max_raw_len=5)
    assert (parsed.cid, parsed.raw_len, parsed.size) == (cid, 5, len(prefix))
    with pytest.raises(FrameTooLarge):
        parse_block_prefix(memoryview(prefix), max_raw_len=4)
    with pytest.raises(ProtocolViolation):
        parse_block_prefix(memoryview(prefix[:10]), max_raw_len=5)
    with pytest.raises(ProtocolViolation, match="invalid CID"):
        parse_block_prefix(memoryview(b"\x03abc" + bytes(8)), max_raw_len=5)


# ── frames over a transport ──────────────────────────────────────────────────
async def connections(
    limits: WireLimits | None = None, timeouts: Timeouts | None = None
) -> tuple[FrameConnection, FrameConnection]:
    a, b = memory_pair(capacity=1 << 22)
    return (
        FrameConnection(a, limits=limits, timeouts=timeouts),
        FrameConnection(b, limits=limits, timeouts=timeouts),
    )


@pytest.mark.parametrize("compression", list(Compression))
async def test_block_frames_round_trip(compression: Compression) -> None:
    left, right = await connections()
    data = np.zeros(100_000, dtype=np.float32)
    data[::100] = 1.0
    cid = Cid.of(data)
    sent = await left.send_block(cid, data, compression)
    frame = await right.receive_frame()
    block = right.parse_block(frame)
    assert block.cid == cid
    assert bytes(block.data) == data.tobytes()
    assert block.wire_bytes == sent
    assert block.compression is compression
    if compression is not Compression.NONE:
        assert sent < data.nbytes / 10


def test_incompressible_block_is_sent_plain() -> None:
    data = np.random.default_rng(0).bytes(10_000)
    block = prepare_block(Cid.of(data), data, Compression.ZSTD)
    assert block.header[5] == 0
    assert block.wire_bytes > len(data)


async def test_corrupted_payload_is_checksum_mismatch() -> None:
    left, right = await connections()
    kind, payload = encode_message(Offer(cids=[]))
    header = FrameHeader(kind, len(payload), crc32c(payload) ^ 1)
    await left.transport.send(header.pack(), payload)
    with pytest.raises(ChecksumMismatch) as info:
        await right.receive_frame()
    assert info.value.algorithm == "crc32c"
    assert info.value.expected == crc32c(payload) ^ 1


async def test_eof_at_boundary_inside_header_and_inside_payload() -> None:
    left, right = await connections()
    await left.transport.aclose()
    with pytest.raises(StreamEnded):
        await right.receive_frame()
    left, right = await connections()
    await left.transport.send(GOOD[:20])
    await left.transport.aclose()
    with pytest.raises(UnexpectedEof) as info:
        await right.receive_frame()
    assert (info.value.received, info.value.expected) == (20, 32)
    left, right = await connections()
    await left.transport.send(FrameHeader(FrameKind.OFFER, 10, 0).pack(), b"12345")
    await left.transport.aclose()
    with pytest.raises(UnexpectedEof) as info:
        await right.receive_frame()
    assert (info.value.received, info.value.expected) == (5, 10)


async def test_error_message_becomes_remote_error() -> None:
    left, right = await connections()
    await left.send_message(Error(code="nope", message="go away"))
    with pytest.raises(RemoteError) as info:
        await right.receive_message(Want)
    assert (info.value.code, info.value.message) == ("nope", "go away")
    await left.send_message(Offer(cids=[]))
    with pytest.raises(ProtocolViolation, match="unexpected Offer"):
        await right.receive_message(Want)


async def test_stalled_frame_times_out() -> None:
    left, right = await connections(timeouts=Timeouts(read=0.05))
    await left.transport.send(GOOD[:10])
    with pytest.raises(PeerTimeout):
        await right.receive_frame()


frames_strategy = st.lists(
    st.one_of(
        st.binary(max_size=64),
        st.builds(
            lambda kind, flags, length, body: (
                FrameHeader(FrameKind(kind), length, crc32c(body), 0, flags).pack() + body
            ),
            st.sampled_from([int(k) for k in FrameKind]),
            st.sampled_from([0, 1, 2]),
            st.integers(0, 2**64 - 1) | st.integers(0, 200),
            st.binary(max_size=200),
        ),
    ),
    max_size=4,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames_strategy)
def test_fuzzed_frames_raise_only_typed_errors_and_allocate_little(chunks: list[bytes]) -> None:
    data = b"".join(chunks)
    limits = WireLimits(max_block_bytes=4096, max_message_bytes=4096)

    async def run() -> None:
        a, b = memory_pair(capacity=max(len(data), 1))
        await a.send(data)
        await a.aclose()
        conn = FrameConnection(b, limits=limits)
        with contextlib.suppress(WireError):
            for _ in range(8):
                frame = await conn.receive_frame()
                if frame.header.kind is FrameKind.BLOCK:
                    conn.parse_block(frame)
                else:
                    conn.expect(frame, *MESSAGE_TYPES.values())

    with traced() as memory:
        asyncio.run(run())
    assert memory.peak < 2 * 1024 * 1024  # headers claim up to 2**64 bytes; none of it is allocated


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from([Compression.ZSTD, Compression.LZ4]),
    st.integers(0, 5000),
    st.binary(max_size=300),
)
def test_fuzzed_compressed_bodies_raise_protocol_violation(
    compression: Compression, raw_len: int, body: bytes
) -> None:
    prefix = pack_block_prefix(Cid.of(b"x"), raw_len)
    payload = prefix + body
    header = FrameHeader(FrameKind.BLOCK, len(payload), crc32c(payload), 0, int(compression))

    async def run() -> None:
        a, b = memory_pair(capacity=len(payload) + HEADER_SIZE)
        await a.send(header.pack(), payload)
        conn = FrameConnection(b, limits=WireLimits(max_block_bytes=4096))
        frame = await conn.receive_frame()
        with contextlib.suppress(ProtocolViolation):
            conn.parse_block(frame)

    asyncio.run(run())


@pytest.mark.parametrize("compression", [Compression.ZSTD, Compression.LZ4])
@pytest.mark.parametrize("delta", [-1, 1, 4 << 20])
def test_a_raw_len_that_differs_from_the_decompressed_size_is_refused(
    compression: Compression, delta: int
) -> None:
    data = bytes(range(256)) * 4
    packed = compress(data, compression)
    assert bytes(decompress(packed, compression, len(data))) == data
    with pytest.raises(ProtocolViolation, match=r"raw_len|does not decompress"):
        decompress(packed, compression, len(data) + delta)
