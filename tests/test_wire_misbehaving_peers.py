"""Hostile or broken peers: each must end in a typed error, bounded in time and memory."""

from __future__ import annotations

import asyncio
import collections
import contextlib

import msgspec
import numpy as np
import pytest

from helpers.net import read_error
from tensorswap.cid import Cid
from tensorswap.codec import TensorBlock
from tensorswap.errors import TensorSwapError
from tensorswap.store import MemoryStore, ModelUpdate, put_tensor, put_update
from tensorswap.wire import AppRequest, BlockClient, BlockServer, memory_pair
from tensorswap.wire.auth import HANDSHAKE_MESSAGE_BYTES, server_handshake
from tensorswap.wire.connection import FrameConnection, Timeouts, WireLimits, prepare_block
from tensorswap.wire.errors import (
    ConnectionFailed,
    FrameTooLarge,
    PeerTimeout,
    ProtocolViolation,
    RemoteError,
    ServerBusy,
    StreamEnded,
)
from tensorswap.wire.frames import FrameHeader, FrameKind, crc32c
from tensorswap.wire.messages import (
    MAX_CIDS_PER_MESSAGE,
    Get,
    Got,
    Offer,
    Welcome,
    decode_message,
    parse_cids,
    wire_cids,
)
from tensorswap.wire.transport import Transport

KEY = b"hostile test key"


def nested_hello(depth: int = 100_000) -> bytes:
    """A HELLO map whose third, unknown (so ignored) field is an array nested ``depth`` deep."""
    hello = msgspec.msgpack.encode({"protocol": 1, "nonce": b"0" * 32})
    assert hello[0] == 0x82  # a fixmap of 2: make it 3
    return b"\x83" + hello[1:] + b"\xa1z" + b"\x91" * depth + b"\xc0"


def raw_frame(kind: FrameKind, payload: bytes, stream_id: int = 0) -> bytes:
    return FrameHeader(kind, len(payload), crc32c(payload), stream_id).pack() + payload


# ── deeply nested msgpack ────────────────────────────────────────────────────
def test_deeply_nested_message_is_a_protocol_violation() -> None:
    with pytest.raises(ProtocolViolation, match="HELLO"):
        decode_message(FrameKind.HELLO, nested_hello())


async def test_deeply_nested_hello_is_answered_with_an_error_and_counted() -> None:
    server = BlockServer(MemoryStore(), key=KEY)
    a, b = memory_pair(capacity=1 << 20)
    serving = asyncio.ensure_future(server.handle(b))
    conn = FrameConnection(a, timeouts=Timeouts(read=5))
    await conn.receive_message(Welcome)
    body = nested_hello(HANDSHAKE_MESSAGE_BYTES - 100)  # deep, yet within the size limit
    assert len(body) <= HANDSHAKE_MESSAGE_BYTES
    await a.send(raw_frame(FrameKind.HELLO, body))
    error = await read_error(conn)
    assert error.code == "protocol_violation"
    await serving  # returned, not raised
    assert server.stats.failed_connections == 1
    assert isinstance(server.errors[-1], ProtocolViolation)
    await a.aclose()


# ── failures the server must report ──────────────────────────────────────────
async def test_an_unexpected_handler_exception_is_reported_as_internal() -> None:
    async def buggy(request: AppRequest) -> bytes:
        raise KeyError(request.app)

    server = BlockServer(MemoryStore(), handlers={"app": buggy})
    a, b = memory_pair()
    serving = asyncio.ensure_future(server.handle(b))
    client = await BlockClient.open(a)
    with pytest.raises(RemoteError) as info:
        await client.request("app", b"")
    assert info.value.code == "internal"
    await serving  # returned, not raised
    assert server.stats.failed_connections == 1
    assert isinstance(server.errors[-1], KeyError)
    await client.aclose()


async def test_an_idle_client_is_told_it_timed_out() -> None:
    server = BlockServer(MemoryStore(), timeouts=Timeouts(idle=0.2))
    a, b = memory_pair()
    serving = asyncio.ensure_future(server.handle(b))
    client = await BlockClient.open(a)
    conn = FrameConnection(a, timeouts=Timeouts(read=5))
    error = await read_error(conn)
    assert error.code == "timeout"
    await serving
    assert isinstance(server.errors[-1], PeerTimeout)
    await b.aclose()  # as the listener does once handle returns
    with pytest.raises(StreamEnded):
        await conn.receive_frame()
    await client.aclose()


async def test_a_handshake_timeout_is_reported_too() -> None:
    server = BlockServer(MemoryStore(), timeouts=Timeouts(handshake=0.2))
    a, b = memory_pair()
    serving = asyncio.ensure_future(server.handle(b))
    conn = FrameConnection(a, timeouts=Timeouts(read=5))
    await conn.receive_message(Welcome)  # then no Hello
    error = await read_error(conn)
    assert error.code == "timeout"
    await serving
    await a.aclose()


# ── sends are bounded too ────────────────────────────────────────────────────
async def test_a_client_that_never_reads_its_get_answer_is_dropped() -> None:
    store = MemoryStore()
    cid = store.put(bytes(range(256)) * 4096)  # 1 MiB, far above what the pipe buffers
    server = BlockServer(store, timeouts=Timeouts(read=0.2, idle=30))
    a, b = memory_pair(capacity=64 * 1024)
    serving = asyncio.ensure_future(server.handle(b))
    client = await BlockClient.open(a)
    await client.conn.send_message(Get(cids=wire_cids([cid] * 20)), 1)  # then never read
    await serving  # returns: the stalled send timed out
    error = server.errors[-1]
    assert isinstance(error, PeerTimeout)
    assert "sending a BLOCK frame" in str(error)
    a.abort()


async def test_after_a_send_stopped_mid_frame_the_connection_refuses_to_send() -> None:
    a, b = memory_pair(capacity=1024)
    conn = FrameConnection(a, timeouts=Timeouts(read=0.2))
    block = prepare_block(Cid.of(b"x" * 4096), b"x" * 4096)
    with pytest.raises(PeerTimeout):
        await conn.send_prepared(block)
    with pytest.raises(ConnectionFailed):  # an ERROR now would land inside the block
        await conn.send_error("timeout", "too slow")
    a.abort()
    b.abort()


async def test_an_oversized_outgoing_message_is_refused_before_sending() -> None:
    a, b = memory_pair()
    conn = FrameConnection(a, limits=WireLimits(max_message_bytes=64))
    with pytest.raises(FrameTooLarge):
        await conn.send_message(Offer(cids=[b"\x01" * 36] * 4))
    assert a.bytes_sent == 0
    await conn.send_message(Offer(cids=[]))  # still in sync
    assert a.bytes_sent > 0
    await a.aclose()
    await b.aclose()


# ── a hostile server answering GET ───────────────────────────────────────────
DATA = b"a block from a hostile server" * 8
DATA_CID = Cid.of(DATA)


async def fake_get_server(transport: Transport, answer: list[bytes | Got]) -> None:
    """Handshake, read one GET, answer with ``answer`` (block bytes or a Got), then wait."""
    conn = FrameConnection(transport, timeouts=Timeouts(read=5))
    await server_handshake(conn, None)
    _, stream = await conn.receive_message(Get)
    for item in answer:
        if isinstance(item, Got):
            await conn.send_message(item, stream)
        else:
            await conn.send_prepared(prepare_block(Cid.of(item), item, stream_id=stream))
    with contextlib.suppress(TensorSwapError):
        await conn.receive_frame(timeout=None)  # until the client closes


@pytest.mark.parametrize(
    "answer",
    [
        pytest.param([Got(missing=[])], id="got-nothing-sent-nothing-missing"),
        pytest.param([DATA, Got(missing=wire_cids([DATA_CID]))], id="sent-and-missing"),
        pytest.param([DATA, DATA, Got(missing=[])], id="sent-twice"),
        pytest.param([DATA, Got(missing=wire_cids([DATA_CID, DATA_CID]))], id="missing-twice"),
        pytest.param([b"not asked for", Got(missing=[])], id="not-asked-for"),
        pytest.param([Got(missing=wire_cids([Cid.of(b"other")]))], id="missing-not-asked"),
    ],
)
async def test_a_get_answer_that_does_not_match_the_request_is_refused(
    answer: list[bytes | Got],
) -> None:
    a, b = memory_pair(capacity=1 << 20)
    serving = asyncio.ensure_future(fake_get_server(b, answer))
    into = MemoryStore()
    async with await BlockClient.open(a, timeouts=Timeouts(read=5)) as client:
        with pytest.raises(ProtocolViolation):
            await client.get_blocks([DATA_CID], into)
    await serving
    await b.aclose()


async def test_pull_does_not_report_success_for_a_block_never_sent() -> None:
    a, b = memory_pair(capacity=1 << 20)
    serving = asyncio.ensure_future(fake_get_server(b, [Got(missing=[])]))
    into = MemoryStore()
    async with await BlockClient.open(a, timeouts=Timeouts(read=5)) as client:
        with pytest.raises(ProtocolViolation):
            await client.pull(DATA_CID, into)
    assert not into.has(DATA_CID)
    await serving
    await b.aclose()


async def test_a_block_requested_twice_is_asked_for_once() -> None:
    store = MemoryStore()
    cid = store.put(DATA)
    absent = Cid.of(b"absent")
    server = BlockServer(store)
    a, b = memory_pair(capacity=1 << 20)
    serving = asyncio.ensure_future(server.handle(b))
    into = MemoryStore()
    async with await BlockClient.open(a) as client:
        assert await client.get_blocks([cid, absent, cid, absent], into) == [absent]
    await serving
    assert server.stats.blocks_served == 1
    assert into.has(cid)


# ── counts of CIDs ───────────────────────────────────────────────────────────
def test_a_message_with_too_many_cids_is_refused_before_parsing() -> None:
    cid = Cid.of(b"x").to_bytes()
    assert len(parse_cids([cid] * MAX_CIDS_PER_MESSAGE, "Offer")) == MAX_CIDS_PER_MESSAGE
    with pytest.raises(FrameTooLarge, match="Offer CID count"):
        parse_cids([cid] * (MAX_CIDS_PER_MESSAGE + 1), "Offer")


async def test_an_offer_above_the_documented_count_is_answered_frame_too_large() -> None:
    server = BlockServer(MemoryStore())
    a, b = memory_pair(capacity=1 << 20)
    serving = asyncio.ensure_future(server.handle(b))
    client = await BlockClient.open(a)
    offer = Offer(cids=wire_cids([Cid.of(b"x")]) * (MAX_CIDS_PER_MESSAGE + 1))
    await client.conn.send_message(offer, 1)
    error = await read_error(client.conn)
    assert error.code == "frame_too_large"
    await serving
    await client.aclose()


class CountingStore(MemoryStore):
    """Counts the reads of each block."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: collections.Counter[Cid] = collections.Counter()

    def get(self, cid: Cid, *, verify: bool | None = None) -> memoryview:
        self.reads[cid] += 1
        return super().get(cid, verify=verify)


async def test_a_commit_repeating_one_root_walks_its_closure_once() -> None:
    store = CountingStore()
    values = np.arange(4096, dtype=np.float32)
    root = put_tensor(store, TensorBlock("w", values), chunk_bytes=1024)
    other = put_update(store, ModelUpdate({"w": values}, 1), chunk_bytes=1024)  # links root
    committed: list[Cid] = []
    server = BlockServer(store, on_root=committed.append)
    a, b = memory_pair(capacity=1 << 20)
    serving = asyncio.ensure_future(server.handle(b))
    async with await BlockClient.open(a) as client:
        store.reads.clear()
        answer = await client.commit([root] * 5000 + [other, root])
    await serving
    assert store.reads[root] == 1  # read once, although named 5001 times and linked by other
    assert max(store.reads.values()) == 1
    assert committed == [root, other]
    assert server.stats.roots_committed == 2
    assert len(answer.roots) == 5002  # echoed as sent


# ── the handshake is small and bounded in time ───────────────────────────────
async def test_a_huge_hello_is_refused_before_anything_is_allocated() -> None:
    server = BlockServer(MemoryStore(), key=KEY)
    a, b = memory_pair()
    serving = asyncio.ensure_future(server.handle(b))
    conn = FrameConnection(a, timeouts=Timeouts(read=5))
    await conn.receive_message(Welcome)
    await a.send(FrameHeader(FrameKind.HELLO, 16 * 1024 * 1024, 0).pack())  # no payload
    error = await read_error(conn)
    assert error.code == "frame_too_large"
    await serving
    failure = server.errors[-1]
    assert isinstance(failure, FrameTooLarge)
    assert failure.limit == HANDSHAKE_MESSAGE_BYTES
    await a.aclose()


async def test_the_handshake_timeout_bounds_a_hello_whose_payload_never_comes() -> None:
    server = BlockServer(MemoryStore(), key=KEY, timeouts=Timeouts(handshake=0.2, read=30))
    a, b = memory_pair()
    serving = asyncio.ensure_future(server.handle(b))
    conn = FrameConnection(a, timeouts=Timeouts(read=5))
    await conn.receive_message(Welcome)
    await a.send(FrameHeader(FrameKind.HELLO, 100, 0).pack())  # then silence
    error = await read_error(conn)
    assert error.code == "timeout"
    await serving
    failure = server.errors[-1]
    assert isinstance(failure, PeerTimeout)
    assert failure.seconds == 0.2  # the handshake's timeout, not the read timeout
    await a.aclose()


async def test_a_client_refuses_a_huge_welcome() -> None:
    a, b = memory_pair()
    await b.send(FrameHeader(FrameKind.WELCOME, 1024 * 1024, 0).pack())
    with pytest.raises(FrameTooLarge):
        await BlockClient.open(a, timeouts=Timeouts(handshake=5))
    await b.aclose()


# ── connections ──────────────────────────────────────────────────────────────
async def test_a_server_serves_at_most_max_connections_clients() -> None:
    async with await BlockServer(MemoryStore(), max_connections=1).start() as server:
        assert server.listener is not None
        server.listener.clock = lambda: 0.0  # time stands still: no connection idles long enough
        async with await BlockClient.connect("127.0.0.1", server.port) as client:
            with pytest.raises(ServerBusy):  # ERROR busy in place of the Welcome
                await BlockClient.connect("127.0.0.1", server.port)
            assert await client.missing([]) == []  # the first one is still served
        assert server.listener.refused == 1
    with pytest.raises(ValueError, match="max_connections"):
        BlockServer(MemoryStore(), max_connections=0)
