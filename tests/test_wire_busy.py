"""A BlockServer at its connection cap: idle connections make room, a refused client is told."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import numpy as np
import pytest

from helpers.net import CertFiles, ManualClock, running
from tensorswap.cid import Cid
from tensorswap.codec import TensorBlock
from tensorswap.store import MemoryStore, get_tensor
from tensorswap.wire import errors as wire_errors
from tensorswap.wire.auth import client_ssl_context, server_ssl_context
from tensorswap.wire.client import BlockClient
from tensorswap.wire.errors import ConnectionFailed, StreamEnded, WireError
from tensorswap.wire.server import BlockServer

KEY = b"cap test key"
ABSENT = Cid.of(b"a block nobody holds")


@contextlib.asynccontextmanager
async def capped_server(cap: int, clock: ManualClock) -> AsyncIterator[BlockServer]:
    async with running(BlockServer(MemoryStore(), key=KEY, max_connections=cap)) as server:
        assert server.listener is not None
        server.listener.clock = clock
        yield server


async def idle_client(server: BlockServer) -> BlockClient:
    """A client that authenticated, made one request and went quiet.

    The server writes the Want and waits for the next request without yielding in between,
    so once the client holds the Want its connection is idle on the server.
    """
    client = await BlockClient.connect("127.0.0.1", server.port, key=KEY)
    assert await client.missing([ABSENT]) == [ABSENT]
    return client


async def test_idle_authenticated_clients_make_room_for_a_real_one() -> None:
    clock = ManualClock()
    async with capped_server(4, clock) as server:
        idle = []
        for _ in range(4):
            idle.append(await idle_client(server))
            clock.advance(1.0)  # each one idle a second longer than the next
        clock.advance(10.0)
        values = np.arange(10_000, dtype=np.float32)
        async with await BlockClient.connect("127.0.0.1", server.port, key=KEY) as fifth:
            result = await fifth.push_tensor(TensorBlock("w", values))
        np.testing.assert_array_equal(get_tensor(server.store, result.roots[0]).values, values)
        assert server.listener is not None and server.listener.evicted == 1
        with pytest.raises((ConnectionFailed, StreamEnded, wire_errors.UnexpectedEof)):
            await idle[0].missing([ABSENT])  # the longest idle one was closed
        for client in idle[1:]:
            assert await client.missing([ABSENT]) == [ABSENT]  # the others still work
        for client in idle:
            await client.aclose()


async def test_a_client_refused_at_the_cap_sees_server_busy() -> None:
    clock = ManualClock()  # never advanced: both connections were active just now
    async with capped_server(2, clock) as server:
        active = [await idle_client(server) for _ in range(2)]
        with pytest.raises(wire_errors.ServerBusy) as info:
            await BlockClient.connect("127.0.0.1", server.port, key=KEY)
        busy = info.value
        assert isinstance(busy, ConnectionFailed) and isinstance(busy, WireError)
        assert "server busy: at its connection cap (2); retry later" in str(busy)
        assert server.listener is not None
        assert (server.listener.refused, server.listener.evicted) == (1, 0)
        for client in active:  # nobody was evicted for the refused one
            assert await client.missing([ABSENT]) == [ABSENT]
            await client.aclose()


async def test_a_tls_client_refused_at_the_cap_sees_server_busy(cert_files: CertFiles) -> None:
    cert, key = cert_files
    server = BlockServer(MemoryStore(), key=KEY, max_connections=1)
    async with running(server, ssl=server_ssl_context(cert, key)):
        assert server.listener is not None
        server.listener.clock = ManualClock()  # never advanced: however slow the TLS handshakes
        ctx = client_ssl_context(cert)
        async with await BlockClient.connect("127.0.0.1", server.port, key=KEY, ssl=ctx) as held:
            assert await held.missing([ABSENT]) == [ABSENT]  # active just now: not evictable
            with pytest.raises(wire_errors.ServerBusy, match=r"connection cap \(1\)"):
                await BlockClient.connect("127.0.0.1", server.port, key=KEY, ssl=ctx)
