"""One conformance suite for every Transport: in-memory, TCP and TLS over loopback.

Every test taking ``pair`` runs on each implementation; what only TCP has (the listener's cap,
copy-free paths) follows at the end, and the listener's eviction rule in test_transport_listener.
"""

from __future__ import annotations

import asyncio
import contextlib
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from helpers.net import CertFiles, Pair, make_cert, receive_all, transport_pair
from tensorswap.transport import (
    DIRECT_RECEIVE_BYTES,
    DIRECT_SEND_BYTES,
    ConnectionFailed,
    PeerTimeout,
    TcpListener,
    TcpTransport,
    Transport,
    TransportClosed,
    UnexpectedEof,
    connect_tcp,
    memory_pair,
    serve_tcp,
)
from tensorswap.wire.auth import client_ssl_context, server_ssl_context


@pytest.fixture(params=["memory", "tcp", "tls"])
async def pair(request: pytest.FixtureRequest, cert_files: CertFiles) -> AsyncIterator[Pair]:
    async with transport_pair(request.param, capacity=64 * 1024, tls=cert_files) as ends:
        yield ends


async def test_parts_arrive_in_order_whole(pair: Pair) -> None:
    a, b = pair
    parts = [b"head", memoryview(b"x" * 100_000), bytearray(b"tail")]
    async with asyncio.TaskGroup() as tg:
        tg.create_task(a.send(*parts))
        got = await receive_all(b, 100_008)
    assert got == b"head" + b"x" * 100_000 + b"tail"
    assert a.bytes_sent == 100_008
    assert b.bytes_received == 100_008


async def test_frames_of_small_parts_and_a_large_body_arrive_whole_in_order(pair: Pair) -> None:
    """Each send is a header, a prefix and a body large enough to go to the kernel
    directly (TCP: the small parts go with it in one sendmsg, whatever of them the kernel
    does not take then after it); back to back, so later ones meet full socket buffers."""
    a, b = pair
    frames = []
    for i in range(6):
        body = bytes([i]) * (2 * DIRECT_SEND_BYTES + 17 * i)
        frames.append((bytes([100 + i]) * 32, bytearray(bytes([200 + i]) * 45), body))
    expected = b"".join(b"".join(bytes(p) for p in frame) for frame in frames)

    async def send_all() -> None:
        for frame in frames:
            await a.send(*frame)

    async with asyncio.TaskGroup() as tg:
        tg.create_task(send_all())
        got = await receive_all(b, len(expected))
    assert got == expected
    assert a.bytes_sent == len(expected)


async def test_large_payload_both_ways(pair: Pair) -> None:
    a, b = pair
    big = bytes(range(256)) * (4 * DIRECT_RECEIVE_BYTES // 256 + 3)
    async with asyncio.TaskGroup() as tg:
        tg.create_task(a.send(big))
        assert await receive_all(b, len(big)) == big
    async with asyncio.TaskGroup() as tg:
        tg.create_task(b.send(big[:1000]))
        assert await receive_all(a, 1000) == big[:1000]


async def test_the_nowait_fast_paths_keep_order_and_counts(pair: Pair) -> None:
    a, b = pair
    sent_now = a.send_nowait(b"one", memoryview(b"two"))  # False where there is no fast path
    if not sent_now:
        await a.send(b"one", memoryview(b"two"))
    await a.send(b"three")
    first = bytearray(3)
    got = b.receive_nowait(first)  # what was read ahead already, never a wait
    assert 0 <= got <= 3
    if got < 3:
        got += await b.receive_into(memoryview(first)[got:])
    assert bytes(first) == b"one"
    assert await receive_all(b, 8) == b"twothree"
    assert a.bytes_sent == 11 and b.bytes_received == 11
    assert b.receive_nowait(bytearray(4)) == 0  # nothing left


async def test_readable_waits_without_consuming_and_buffered_counts_what_nowait_takes(
    pair: Pair,
) -> None:
    a, b = pair
    waiting = asyncio.ensure_future(b.readable())
    await asyncio.sleep(0)
    waiting.cancel()  # a cancelled wait for bytes costs nothing
    await asyncio.wait([waiting])
    await a.send(b"abcdef")
    await b.readable()
    await b.readable()  # bytes there: at once, still nothing taken
    ahead = b.buffered()
    assert 0 <= ahead <= 6
    first = bytearray(6)
    assert b.receive_nowait(first) == ahead  # exactly what buffered() said
    got = ahead + await b.receive_into(memoryview(first)[ahead:])
    assert got == 6 and bytes(first) == b"abcdef"
    assert b.buffered() == 0 and b.bytes_received == 6
    await a.aclose()
    await b.readable()  # EOF is readable too


async def test_many_small_reads_after_one_send(pair: Pair) -> None:
    a, b = pair
    payload = bytes(range(200))
    await a.send(payload)
    pieces = [await receive_all(b, 8) for _ in range(25)]
    assert b"".join(pieces) == payload


async def test_eof_returns_short_count(pair: Pair) -> None:
    a, b = pair
    await a.send(b"abc")
    await a.send_eof()
    buf = bytearray(10)
    assert await b.receive_into(buf) == 3
    assert buf[:3] == b"abc"
    assert await b.receive_into(bytearray(5)) == 0


async def test_receive_exactly_names_the_shortfall(pair: Pair) -> None:
    a, b = pair
    await a.send(b"12345")
    await a.aclose()
    with pytest.raises(UnexpectedEof) as info:
        await b.receive_exactly(bytearray(8), "thing")
    assert (info.value.what, info.value.received, info.value.expected) == ("thing", 5, 8)


async def test_use_after_close_is_transport_closed(pair: Pair) -> None:
    a, _ = pair
    await a.aclose()
    await a.aclose()  # idempotent
    with pytest.raises(TransportClosed):
        await a.send(b"x")
    with pytest.raises(TransportClosed):
        await a.receive_into(bytearray(1))


async def test_abort_is_seen_by_the_peer(pair: Pair) -> None:
    a, b = pair
    a.abort()
    try:
        got = await b.receive_into(bytearray(4))
    except ConnectionFailed:
        return
    assert got == 0


async def test_half_close_still_allows_a_reply(pair: Pair, request: pytest.FixtureRequest) -> None:
    a, b = pair
    if "tls" in request.node.callspec.id:
        pytest.skip("TLS cannot half-close")
    await a.send(b"ping")
    await a.send_eof()
    assert await receive_all(b, 4) == b"ping"
    assert await b.receive_into(bytearray(1)) == 0
    await b.send(b"pong")
    assert await receive_all(a, 4) == b"pong"


async def test_cancelled_receive_leaves_transport_usable_for_close(pair: Pair) -> None:
    _, b = pair
    task = asyncio.ensure_future(b.receive_into(bytearray(DIRECT_RECEIVE_BYTES * 2)))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await b.aclose()


async def test_busy_marks_nest_and_leave_the_stream_alone(pair: Pair) -> None:
    a, b = pair
    with a.busy(), a.busy():
        await a.send(b"in a message")
    with b.busy():
        assert await receive_all(b, 12) == b"in a message"


async def test_memory_send_is_bounded_by_capacity() -> None:
    a, b = memory_pair(capacity=1024)
    sender = asyncio.ensure_future(a.send(b"x" * 5000))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not sender.done()
    assert a.bytes_sent == 1024
    assert await receive_all(b, 5000) == b"x" * 5000
    await sender
    await a.aclose()
    await b.aclose()


async def test_connect_refused_is_connection_failed() -> None:
    async def nothing(_: Transport) -> None:
        return None

    listener = await serve_tcp(nothing)
    port = listener.port
    await listener.aclose()
    with pytest.raises(ConnectionFailed):
        await connect_tcp("127.0.0.1", port, timeout=5)


async def test_a_host_name_idna_refuses_is_connection_failed() -> None:
    with pytest.raises(ConnectionFailed, match="connect"):
        await connect_tcp("a" * 64 + ".invalid", 9, timeout=5)  # a label over 63 characters


async def test_tls_with_untrusted_certificate_fails(tmp_path: Path) -> None:
    cert, key = make_cert(tmp_path)
    (tmp_path / "other").mkdir()
    other, _ = make_cert(tmp_path / "other")

    async def nothing(_: Transport) -> None:
        return None

    async with await serve_tcp(nothing, ssl=server_ssl_context(cert, key)) as listener:
        with pytest.raises(ConnectionFailed):
            await connect_tcp("127.0.0.1", listener.port, ssl=client_ssl_context(other))


async def test_connect_timeout_covers_a_stalled_tls_handshake(
    cert_files: CertFiles,
) -> None:
    release = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await release.wait()  # accepts TCP, never answers the TLS ClientHello
        writer.close()
        await writer.wait_closed()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    async with server:
        port = server.sockets[0].getsockname()[1]
        with pytest.raises(PeerTimeout) as info:
            await connect_tcp("127.0.0.1", port, ssl=client_ssl_context(cert_files[0]), timeout=0.1)
        assert info.value.what == "connect"
        release.set()


async def test_abort_during_a_large_send_fails_the_send(pair: Pair) -> None:
    a, _ = pair
    big = bytes(64 * 1024 * 1024)  # more than the socket buffers hold: the send must wait
    sending = asyncio.ensure_future(a.send(big))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not sending.done()
    a.abort()
    with pytest.raises((ConnectionFailed, TransportClosed)):
        await asyncio.wait_for(sending, 5)


# ── what a connection costs the server ───────────────────────────────────────
async def test_a_listener_aborts_connections_beyond_max_connections() -> None:
    started: asyncio.Queue[Transport] = asyncio.Queue()
    release = asyncio.Event()

    async def handler(transport: Transport) -> None:
        await started.put(transport)
        await release.wait()

    async with await serve_tcp(handler, max_connections=2) as listener:
        first = await connect_tcp("127.0.0.1", listener.port)
        second = await connect_tcp("127.0.0.1", listener.port)
        await started.get()
        await started.get()
        third = await connect_tcp("127.0.0.1", listener.port)
        with contextlib.suppress(ConnectionFailed):  # a reset, or else EOF:
            assert await third.receive_into(bytearray(1)) == 0  # aborted by the server
        assert listener.refused == 1
        assert listener.connections == 2
        await third.aclose()
        release.set()
        await first.aclose()
        await second.aclose()


def test_max_connections_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_connections"):
        TcpListener(max_connections=0)


async def test_idle_connections_cost_no_receive_buffer_and_no_duplicate_socket() -> None:
    accepted: asyncio.Queue[Transport] = asyncio.Queue()
    release = asyncio.Event()

    async def handler(transport: Transport) -> None:
        await accepted.put(transport)
        await release.wait()

    async with await serve_tcp(handler) as listener:
        tracemalloc.start()
        try:
            before, _ = tracemalloc.get_traced_memory()
            clients = [await connect_tcp("127.0.0.1", listener.port) for _ in range(20)]
            servers = [await accepted.get() for _ in clients]
            after, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert after - before < 20 * 64 * 1024  # not 20 read-ahead buffers of 256 KiB
        server = servers[0]
        assert isinstance(server, TcpTransport)
        assert not server.direct_open  # no duplicate socket until a large send
        await clients[0].send(b"hello")
        assert await receive_all(server, 5) == b"hello"
        big = bytes(DIRECT_SEND_BYTES)
        sent = asyncio.ensure_future(server.send(big))
        assert await receive_all(clients[0], len(big)) == big
        await sent
        assert server.direct_open  # made by the first direct send
        release.set()
        for client in clients:
            await client.aclose()
