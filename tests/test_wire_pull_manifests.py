"""A pull asks for the manifests below what it requests (Get ``manifests``): an update's whole
chunk list arrives in one round trip; old servers and lying servers are handled."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from tensorswap.cid import Cid
from tensorswap.store import MemoryStore, ModelUpdate, get_update, manifest_closure, put_update
from tensorswap.transport import memory_pair
from tensorswap.wire import _server_handlers
from tensorswap.wire.client import BlockClient
from tensorswap.wire.errors import ProtocolViolation
from tensorswap.wire.messages import Get
from tensorswap.wire.server import BlockServer

CHUNK = 16 * 1024


def an_update(value: float) -> tuple[MemoryStore, Cid, ModelUpdate]:
    store = MemoryStore()
    rng = np.random.default_rng(int(value))  # distinct chunks: none deduplicated
    update = ModelUpdate({f"t{i}": rng.standard_normal(10_000, np.float32) for i in range(3)}, 5)
    return store, put_update(store, update, chunk_bytes=CHUNK), update


@contextlib.asynccontextmanager
async def client_of(server: BlockServer) -> AsyncIterator[tuple[BlockClient, list[Get]]]:
    """A client over an in-memory pair, and the Gets it sends."""
    a, b = memory_pair(capacity=1 << 20)
    serving = asyncio.ensure_future(server.handle(b))
    gets: list[Get] = []
    try:
        async with await BlockClient.open(a) as client:
            send = client.conn.send_message

            async def counting(message: Any, stream_id: int = 0) -> None:
                if isinstance(message, Get):
                    gets.append(message)
                await send(message, stream_id)

            client.conn.send_message = counting  # type: ignore[method-assign]
            yield client, gets
    finally:
        async with asyncio.timeout(10):
            await serving
        await b.aclose()


async def test_a_pull_of_an_update_takes_two_gets_its_manifests_then_its_chunks() -> None:
    src, root, update = an_update(1.0)
    back = MemoryStore()
    async with client_of(BlockServer(src)) as (client, gets):
        pulled = await client.pull(root, back)
    closure = manifest_closure(src, root)
    assert pulled.fetched == pulled.blocks == len(closure)
    assert len(gets) == 2 and all(get.manifests for get in gets)
    got = get_update(back, root)
    for name, values in update.tensors.items():
        np.testing.assert_array_equal(got.tensors[name], values)


async def test_a_server_that_ignores_the_flag_is_pulled_level_by_level(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_server_handlers, "linked_manifests", lambda store, cids: [])
    src, root, _ = an_update(2.0)
    back = MemoryStore()
    async with client_of(BlockServer(src)) as (client, gets):
        pulled = await client.pull(root, back)
    assert pulled.fetched == len(manifest_closure(src, root))
    assert len(gets) == 3  # the update's manifest, its tensors' manifests, their chunks


async def test_a_manifest_sent_unasked_and_unlinked_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    src, root, _ = an_update(3.0)
    stranger = put_update(src, ModelUpdate({"x": np.zeros(4, np.float32)}, 1))
    monkeypatch.setattr(_server_handlers, "linked_manifests", lambda store, cids: [stranger])
    async with client_of(BlockServer(src)) as (client, _):
        with pytest.raises(ProtocolViolation, match="not asked for"):
            await client.pull(root, MemoryStore())


async def test_blocks_the_puller_holds_are_not_fetched_again() -> None:
    src, root, _ = an_update(4.0)
    back = MemoryStore()
    for cid in manifest_closure(src, root)[-2:]:  # two chunks already here
        back.put_verified(cid, src.get(cid))
    async with client_of(BlockServer(src)) as (client, _):
        pulled = await client.pull(root, back)
    assert pulled.fetched == len(manifest_closure(src, root)) - 2
