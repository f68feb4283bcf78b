"""BlockServer counts the wire bytes of its connections, open ones included."""

from __future__ import annotations

import asyncio

from tensorswap.store import MemoryStore
from tensorswap.wire import BlockClient, BlockServer, memory_pair


async def test_bytes_and_open_connections_are_counted_live_and_after_the_end() -> None:
    server = BlockServer(MemoryStore())
    client_end, server_end = memory_pair()
    serving = asyncio.ensure_future(server.handle(server_end))
    async with asyncio.timeout(10):
        client = await BlockClient.open(client_end)
        assert await client.missing([]) == []
        stats = server.stats
        assert (stats.connections, stats.open_connections) == (1, 1)
        assert stats.bytes_in == client_end.bytes_sent > 0
        assert stats.bytes_out == client_end.bytes_received > 0
        await client.aclose()
        await serving
    assert stats.open_connections == 0 and stats.connections == 1
    assert (stats.bytes_in, stats.bytes_out) == (server_end.bytes_received, server_end.bytes_sent)
    assert (stats.ended_bytes_in, stats.ended_bytes_out) == (stats.bytes_in, stats.bytes_out)
