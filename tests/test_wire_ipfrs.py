"""ipfrs-compatible gradient streams (seed 001): bytes, reassembly, typed errors, TCP."""

from __future__ import annotations

import asyncio
import contextlib
import random
import struct
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.memory import traced
from helpers.net import Pair
from tensorswap.codec.ipfrs import encode_ipfrs_gradient
from tensorswap.errors import WireError
from tensorswap.wire.errors import (
    ChecksumMismatch,
    ChunkIndexOutOfRange,
    DuplicateChunk,
    FrameTooLarge,
    IncompleteStream,
    InvalidChunkPayload,
    PeerTimeout,
    StreamEnded,
    TotalChunksMismatch,
    UnexpectedEof,
)
from tensorswap.wire.ipfrs import (
    DEFAULT_CHUNK_SIZE,
    GradientChunk,
    GradientReassembler,
    GradientStreamSession,
    IpfrsFrameHeader,
    IpfrsLimits,
    chunk_count,
)
from tensorswap.wire.transport import Transport, memory_pair


def gradient(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def expected_wire_bytes(values: np.ndarray, chunk_size: int) -> bytes:
    """The stream as the seed writes it, built independently of the module under test."""
    parts = [values[i : i + chunk_size] for i in range(0, values.size, chunk_size)] or [values]
    out = bytearray()
    for index, part in enumerate(parts):
        payload = encode_ipfrs_gradient(part)
        out += struct.pack("<IIII", index, len(parts), len(payload), zlib.crc32(payload))
        out += payload
    return bytes(out)


# ── chunking ─────────────────────────────────────────────────────────────────
def test_chunk_count_follows_ipfrs() -> None:
    assert chunk_count(1_000_000, DEFAULT_CHUNK_SIZE) == 16
    assert chunk_count(0, DEFAULT_CHUNK_SIZE) == 1
    assert chunk_count(65_536, 65_536) == 1
    assert chunk_count(65_537, 65_536) == 2
    assert chunk_count(5, 0) == 5


def test_chunk_size_zero_becomes_one_and_negative_is_refused() -> None:
    assert GradientStreamSession("s", 0).chunk_size == 1
    with pytest.raises(ValueError):
        GradientStreamSession("s", -1)


def test_encode_gradient_chunks_are_ipfrs_files_with_crc32() -> None:
    values = gradient(1000)
    chunks = GradientStreamSession("sess", 300).encode_gradient(values)
    assert [c.chunk_index for c in chunks] == [0, 1, 2, 3]
    assert {c.total_chunks for c in chunks} == {4}
    assert {c.session_id for c in chunks} == {"sess"}
    for chunk, start in zip(chunks, range(0, 1000, 300), strict=True):
        assert bytes(chunk.payload) == encode_ipfrs_gradient(values[start : start + 300])
        assert chunk.checksum == zlib.crc32(bytes(chunk.payload))
        assert chunk.verify_checksum()


def test_empty_gradient_is_one_chunk_of_zero_values() -> None:
    session = GradientStreamSession("s")
    chunks = session.encode_gradient(np.empty(0, np.float32))
    assert len(chunks) == 1
    assert (chunks[0].chunk_index, chunks[0].total_chunks) == (0, 1)
    assert bytes(chunks[0].payload) == encode_ipfrs_gradient(np.empty(0, np.float32))
    assert session.decode_chunks(chunks).size == 0


def test_frame_header_layout_is_little_endian_u32s() -> None:
    header = IpfrsFrameHeader(1, 2, 3, 0xDEADBEEF)
    assert header.pack() == b"\x01\0\0\0\x02\0\0\0\x03\0\0\0\xef\xbe\xad\xde"
    assert IpfrsFrameHeader.unpack(header.pack()) == header


# ── reassembly ───────────────────────────────────────────────────────────────
def test_decode_accepts_any_order() -> None:
    values = gradient(5000, 1)
    session = GradientStreamSession("s", 512)
    chunks = session.encode_gradient(values)
    random.Random(3).shuffle(chunks)
    out = session.decode_chunks(chunks)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, values)


def _chunks(n: int = 1000, size: int = 300) -> list[GradientChunk]:
    return GradientStreamSession("s", size).encode_gradient(gradient(n))


def _replace(chunk: GradientChunk, **changes: object) -> GradientChunk:
    fields = {
        "session_id": chunk.session_id,
        "chunk_index": chunk.chunk_index,
        "total_chunks": chunk.total_chunks,
        "payload": chunk.payload,
        "checksum": chunk.checksum,
    }
    fields.update(changes)
    return GradientChunk(**fields)  # type: ignore[arg-type]


def test_incomplete_stream_names_received_and_total() -> None:
    chunks = _chunks()
    with pytest.raises(IncompleteStream) as info:
        GradientStreamSession().decode_chunks(chunks[:2])
    assert (info.value.received, info.value.total) == (2, 4)


def test_empty_chunk_list_is_incomplete_not_an_empty_gradient() -> None:
    with pytest.raises(IncompleteStream) as info:
        GradientStreamSession().decode_chunks([])
    assert (info.value.received, info.value.total) == (0, None)


def test_checksum_mismatch_names_chunk_expected_actual() -> None:
    chunks = _chunks()
    bad = bytearray(chunks[2].payload)
    bad[-20] ^= 0xFF
    chunks[2] = _replace(chunks[2], payload=bytes(bad))
    with pytest.raises(ChecksumMismatch) as info:
        GradientStreamSession().decode_chunks(chunks)
    err = info.value
    assert (err.chunk_index, err.expected, err.actual) == (2, chunks[2].checksum, zlib.crc32(bad))


def test_total_chunks_mismatch() -> None:
    chunks = _chunks()
    chunks[1] = _replace(chunks[1], total_chunks=5)
    with pytest.raises(TotalChunksMismatch) as info:
        GradientStreamSession().decode_chunks(chunks)
    assert (info.value.chunk_index, info.value.expected, info.value.actual) == (1, 4, 5)


def test_duplicate_chunk() -> None:
    chunks = _chunks()
    with pytest.raises(DuplicateChunk) as info:
        GradientStreamSession().decode_chunks([*chunks, chunks[1]])
    assert info.value.chunk_index == 1


def test_index_out_of_range() -> None:
    chunks = _chunks()
    chunks[3] = _replace(chunks[3], chunk_index=4)
    with pytest.raises(ChunkIndexOutOfRange) as info:
        GradientStreamSession().decode_chunks(chunks)
    assert (info.value.chunk_index, info.value.total) == (4, 4)


def test_payload_that_is_not_a_gradient_file() -> None:
    junk = b"ARROW1 but not really a file" * 3
    chunk = GradientChunk("s", 0, 1, junk, zlib.crc32(junk))
    with pytest.raises(InvalidChunkPayload) as info:
        GradientStreamSession().decode_chunks([chunk])
    assert info.value.chunk_index == 0
    assert isinstance(info.value.__cause__, Exception)


# ── streams ──────────────────────────────────────────────────────────────────
async def _feed(data: bytes, *, eof: bool = True) -> Transport:
    """A transport whose peer wrote ``data`` (then EOF)."""
    a, b = memory_pair(capacity=max(len(data), 1))
    await a.send(data)
    if eof:
        await a.aclose()
    return b


async def test_stream_bytes_are_exactly_the_seeds() -> None:
    values = gradient(1000, 2)
    a, b = memory_pair(capacity=1 << 20)
    assert await GradientStreamSession("s", 300).stream_to(values, a) == 4
    await a.aclose()
    wire = bytearray(1 << 20)
    got = await b.receive_into(wire)
    assert bytes(wire[:got]) == expected_wire_bytes(values, 300)


async def test_round_trip_over_tcp(loopback_pair: Pair) -> None:
    client, server = loopback_pair
    values = gradient(1_000_000, 4)
    session = GradientStreamSession("s")
    async with asyncio.TaskGroup() as tg:
        sent = tg.create_task(session.stream_to(values, client))
        received = await session.receive_from(server)
    assert sent.result() == 16
    np.testing.assert_array_equal(received, values)


async def test_round_trip_over_asyncio_streams() -> None:
    values = gradient(70_000, 5)
    session = GradientStreamSession("s")
    result: asyncio.Future[np.ndarray] = asyncio.get_running_loop().create_future()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            result.set_result(await session.receive_from(reader))
        finally:
            writer.close()
            await writer.wait_closed()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    async with server:
        port = server.sockets[0].getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await session.stream_to(values, writer) == 2
        np.testing.assert_array_equal(await result, values)
        writer.close()
        await writer.wait_closed()


async def test_out_of_order_frames_over_tcp(loopback_pair: Pair) -> None:
    client, server = loopback_pair
    values = gradient(2000, 6)
    chunks = GradientStreamSession("s", 256).encode_gradient(values)
    for chunk in reversed(chunks):
        await client.send(chunk.header.pack(), chunk.payload)
    np.testing.assert_array_equal(await GradientStreamSession().receive_from(server), values)


def _frame(index: int, total: int, payload: bytes) -> bytes:
    return struct.pack("<IIII", index, total, len(payload), zlib.crc32(payload)) + payload


async def test_chunks_of_another_layout_are_decoded_in_full() -> None:
    # Same lengths as the files this module writes, other bytes around the values (the
    # index column, which readers ignore): the receiver must notice and decode them.
    values = gradient(1000, 7)
    parts = [values[i : i + 300] for i in range(0, 1000, 300)]
    wire = b""
    for index, part in enumerate(parts):
        payload = bytearray(encode_ipfrs_gradient(part))
        payload[200] ^= 0x5A  # inside the index column
        wire += _frame(index, len(parts), bytes(payload))
    got = await GradientStreamSession("s", 300).receive_from(await _feed(wire))
    np.testing.assert_array_equal(got, values)


async def test_a_corrupted_value_of_a_chunk_received_in_place_is_a_checksum_mismatch() -> None:
    values = gradient(1000, 8)
    chunks = GradientStreamSession("s", 300).encode_gradient(values)
    payload = bytearray(chunks[1].payload)
    payload[-400] ^= 1  # a value byte, not the footer
    wire = b"".join(
        c.header.pack() + bytes(c.payload)
        if c.chunk_index != 1
        else struct.pack("<IIII", 1, 4, len(payload), c.checksum) + bytes(payload)
        for c in chunks
    )
    with pytest.raises(ChecksumMismatch) as info:
        await GradientStreamSession("s", 300).receive_from(await _feed(wire))
    assert (info.value.chunk_index, info.value.expected) == (1, chunks[1].checksum)
    assert info.value.actual == zlib.crc32(payload)


@pytest.mark.parametrize("receiver_chunk_size", [100, 300, 1000, DEFAULT_CHUNK_SIZE])
async def test_receiver_with_another_chunk_size_still_reassembles(
    receiver_chunk_size: int,
) -> None:
    values = gradient(2500, 9)
    a, b = memory_pair(capacity=1 << 22)
    await GradientStreamSession("s", 300).stream_to(values, a)
    await a.aclose()
    got = await GradientStreamSession("s", receiver_chunk_size).receive_from(b)
    np.testing.assert_array_equal(got, values)


async def test_eof_before_first_frame_is_stream_ended() -> None:
    with pytest.raises(StreamEnded):
        await GradientStreamSession().receive_from(await _feed(b""))


async def test_eof_inside_header_is_unexpected_eof() -> None:
    with pytest.raises(UnexpectedEof) as info:
        await GradientStreamSession().receive_from(await _feed(b"\0" * 7))
    assert (info.value.received, info.value.expected) == (7, 16)


async def test_eof_inside_payload_is_unexpected_eof() -> None:
    wire = expected_wire_bytes(gradient(100), 100)
    with pytest.raises(UnexpectedEof) as info:
        await GradientStreamSession().receive_from(await _feed(wire[:-10]))
    assert info.value.expected == len(wire) - 16
    assert info.value.received == len(wire) - 26


async def test_eof_between_frames_is_incomplete() -> None:
    values = gradient(1000)
    wire = expected_wire_bytes(values, 500)
    first = 16 + struct.unpack_from("<I", wire, 8)[0]
    with pytest.raises(IncompleteStream) as info:
        await GradientStreamSession().receive_from(await _feed(wire[:first]))
    assert (info.value.received, info.value.total) == (1, 2)


async def test_stream_checksum_is_checked_per_frame() -> None:
    chunk = _chunks(100, 100)[0]
    bad = chunk.header.pack()[:12] + struct.pack("<I", chunk.checksum ^ 1) + bytes(chunk.payload)
    with pytest.raises(ChecksumMismatch) as info:
        await GradientStreamSession().receive_from(await _feed(bad))
    assert info.value.chunk_index == 0


async def test_stream_duplicate_chunk() -> None:
    two = _replace(_chunks(100, 100)[0], total_chunks=2)
    frame = two.header.pack() + bytes(two.payload)
    with pytest.raises(DuplicateChunk):
        await GradientStreamSession().receive_from(await _feed(frame * 2))


async def test_receive_stops_after_the_last_chunk() -> None:
    chunk = _chunks(100, 100)[0]
    frame = chunk.header.pack() + bytes(chunk.payload)
    stream = await _feed(frame * 2)  # two one-chunk gradients back to back
    session = GradientStreamSession()
    first = await session.receive_from(stream)
    second = await session.receive_from(stream)
    np.testing.assert_array_equal(first, second)
    with pytest.raises(StreamEnded):
        await session.receive_from(stream)


async def test_payload_len_above_limit_is_refused_before_reading() -> None:
    header = struct.pack("<IIII", 0, 1, 0xFFFFFFFF, 0)
    limits = IpfrsLimits(max_payload_len=1024)
    with pytest.raises(FrameTooLarge) as info:
        await GradientStreamSession(limits=limits).receive_from(await _feed(header))
    assert (info.value.length, info.value.limit) == (0xFFFFFFFF, 1024)


async def test_total_chunks_above_limit_is_refused() -> None:
    header = struct.pack("<IIII", 0, 1 << 30, 10, 0)
    with pytest.raises(FrameTooLarge) as info:
        await GradientStreamSession().receive_from(await _feed(header + b"\0" * 10))
    assert info.value.what == "ipfrs total_chunks"


async def test_total_bytes_above_limit_is_refused() -> None:
    chunks = _chunks(1000, 100)
    wire = b"".join(c.header.pack() + bytes(c.payload) for c in chunks)
    limits = IpfrsLimits(max_total_bytes=len(chunks[0].payload) * 3)
    with pytest.raises(FrameTooLarge):
        await GradientStreamSession(limits=limits).receive_from(await _feed(wire))


async def test_stalled_peer_times_out() -> None:
    a, b = memory_pair()
    await a.send(b"\0" * 5)  # part of a header, then nothing
    with pytest.raises(PeerTimeout):
        await GradientStreamSession(read_timeout=0.05).receive_from(b)
    await a.aclose()


# ── fuzz ─────────────────────────────────────────────────────────────────────
frame_bytes = st.one_of(
    st.binary(max_size=200),
    st.builds(
        lambda idx, total, length, crc, body: struct.pack("<IIII", idx, total, length, crc) + body,
        st.integers(0, 2**32 - 1) | st.integers(0, 4),
        st.integers(0, 2**32 - 1) | st.integers(0, 4),
        st.integers(0, 2**32 - 1) | st.integers(0, 300),
        st.integers(0, 2**32 - 1),
        st.binary(max_size=300),
    ),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(frame_bytes, max_size=4))
def test_fuzzed_streams_raise_only_typed_errors_and_allocate_little(frames: list[bytes]) -> None:
    data = b"".join(frames)
    limits = IpfrsLimits(max_payload_len=4096, max_total_chunks=64, max_total_bytes=1 << 16)

    async def run() -> None:
        stream = await _feed(data)
        with contextlib.suppress(WireError):
            await GradientStreamSession(limits=limits).receive_from(stream)

    with traced() as memory:
        asyncio.run(run())
    assert memory.peak < 2 * 1024 * 1024  # headers claim up to 4 GiB; nothing of that is allocated


# ── memory reserved in advance ───────────────────────────────────────────────
async def test_one_header_does_not_reserve_the_gradient_it_announces() -> None:
    # a first frame announcing 32,768 full chunks (8 GiB of values), then 100 bytes and EOF
    chunk_file = len(encode_ipfrs_gradient(np.zeros(DEFAULT_CHUNK_SIZE, np.float32)))
    stream = await _feed(struct.pack("<IIII", 0, 32_768, chunk_file, 0) + b"\0" * 100)
    with traced() as memory, pytest.raises(UnexpectedEof):
        await GradientStreamSession().receive_from(stream)
    assert memory.peak < 64 * 1024 * 1024  # not 8 GiB: at most a chunk is allocated per frame


async def test_a_gradient_above_the_in_place_limit_is_received_chunk_by_chunk() -> None:
    values = gradient(10 * 1024 + 5, 3)
    sender = GradientStreamSession("s", 1024)
    receiver = GradientStreamSession("s", 1024, limits=IpfrsLimits(max_in_place_bytes=4096))
    a, b = memory_pair()
    sending = asyncio.ensure_future(sender.stream_to(values, a))
    received = await receiver.receive_from(b)
    await sending
    np.testing.assert_array_equal(received, values)
    await a.aclose()


def test_a_failed_preallocation_falls_back_to_receiving_apart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assembler = GradientReassembler()
    assembler.claim(IpfrsFrameHeader(0, 4, 100, 0))

    def no_memory(*args: object, **kwargs: object) -> np.ndarray:
        raise MemoryError("no memory for the test")

    monkeypatch.setattr(np, "empty", no_memory)
    assert assembler.place(0, 16, 1 << 30) is None
