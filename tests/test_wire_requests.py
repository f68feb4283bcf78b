"""Application requests (REQUEST / REPLY): the wire's public extension point."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tensorswap.codec import TensorBlock
from tensorswap.store import MemoryStore, manifest_closure, put_tensor
from tensorswap.wire import (
    AppRequest,
    BlockClient,
    BlockServer,
    ProtocolViolation,
    RemoteError,
    memory_pair,
)

KEY = b"request test key"


async def test_a_handler_answers_after_the_blocks_before_it_are_stored() -> None:
    dst = MemoryStore()
    seen: list[AppRequest] = []

    async def echo(request: AppRequest) -> bytes:
        seen.append(request)
        return b"held" if dst.has(root) else b"lacking"

    src = MemoryStore()
    root = put_tensor(src, TensorBlock("w", np.arange(50_000, dtype=np.float32)), chunk_bytes=8192)
    async with (
        await BlockServer(dst, key=KEY, handlers={"echo": echo}).start() as server,
        await BlockClient.connect("127.0.0.1", server.port, key=KEY) as client,
    ):
        closure = await client.missing([root])
        assert closure == [root]
        blocks = list(reversed(manifest_closure(src, root)))
        await client.put_blocks(src, blocks)  # no commit: the request alone must wait for them
        assert await client.request("echo", b"ping") == b"held"
        assert await client.request("echo", b"") == b"held"  # the connection goes on
        assert server.stats.requests == 2
    assert [r.body for r in seen] == [b"ping", b""]
    assert all(r.app == "echo" and r.peer for r in seen)
    assert seen[0].stream_id != seen[1].stream_id


async def test_an_unknown_app_is_refused_and_the_connection_stays_usable() -> None:
    server = BlockServer(MemoryStore())
    client_end, server_end = memory_pair()
    task = asyncio.ensure_future(server.handle(server_end))
    async with await BlockClient.open(client_end) as client:
        with pytest.raises(RemoteError) as info:
            await client.request("nobody", b"x")
        assert info.value.code == "unsupported"
        assert await client.missing([]) == []
    await task
    assert not server.errors


async def test_a_failing_handler_ends_the_connection_with_an_error() -> None:
    async def broken(request: AppRequest) -> bytes:
        raise ProtocolViolation(f"bad body {request.body!r}")

    async with (
        await BlockServer(MemoryStore(), handlers={"app": broken}).start() as server,
        await BlockClient.connect("127.0.0.1", server.port) as client,
    ):
        with pytest.raises(RemoteError) as info:
            await client.request("app", b"junk")
        assert info.value.code == "protocol_violation"
        assert "bad body" in str(info.value)
    assert isinstance(server.errors[-1], ProtocolViolation)
