"""A pull asks for the manifests below what it requests (Get ``manifests``), or for the whole
closure but what it holds (Get ``closure``): an update's chunk list, or all of it, in one
round trip; old servers and lying servers are handled."""

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
    monkeypatch.setattr(_server_handlers, "linked_blocks", lambda *args: [])
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
    monkeypatch.setattr(_server_handlers, "linked_blocks", lambda *args: [stranger])
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


async def test_a_pull_given_what_it_holds_is_one_get_and_skips_those() -> None:
    src, root, update = an_update(5.0)
    closure = manifest_closure(src, root)
    chunks = [cid for cid in closure if cid.codec.name == "RAW"]
    back = MemoryStore()
    for cid in chunks[:2]:  # as if this peer had submitted blocks the result shares
        back.put_verified(cid, src.get(cid))
    async with client_of(BlockServer(src)) as (client, gets):
        pulled = await client.pull(root, back, have=chunks[:2])
    assert len(gets) == 1 and gets[0].closure
    assert pulled.fetched == len(closure) - 2
    got = get_update(back, root)
    np.testing.assert_array_equal(got.tensors["t1"], update.tensors["t1"])


async def test_a_wrong_have_costs_a_round_trip_not_a_wrong_result() -> None:
    src, root, update = an_update(6.0)
    chunk = next(cid for cid in manifest_closure(src, root) if cid.codec.name == "RAW")
    back = MemoryStore()  # claims to hold a chunk it does not
    async with client_of(BlockServer(src)) as (client, gets):
        pulled = await client.pull(root, back, have=[chunk])
    assert pulled.fetched == len(manifest_closure(src, root))
    assert len(gets) >= 2 and not gets[-1].closure
    got = get_update(back, root)
    for name, values in update.tensors.items():
        np.testing.assert_array_equal(got.tensors[name], values)


async def test_a_chunk_sent_unasked_and_unlinked_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    src, root, _ = an_update(7.0)
    other, other_root, _ = an_update(8.0)
    stranger = next(c for c in manifest_closure(other, other_root) if c.codec.name == "RAW")
    src.put_verified(stranger, other.get(stranger))
    monkeypatch.setattr(_server_handlers, "linked_blocks", lambda *args: [stranger])
    async with client_of(BlockServer(src)) as (client, _):
        with pytest.raises(ProtocolViolation, match="not asked for"):
            await client.pull(root, MemoryStore(), have=[])
