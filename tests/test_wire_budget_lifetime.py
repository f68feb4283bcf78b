"""A budget reservation lives exactly as long as the bytes it covers (issue 25, fault 2).

A block's decompressed bytes count against the server's budget from before they are allocated
until they are freed (or stored), whatever ends its connection meanwhile: here the
decompressor or the hasher is held on an event while the connection is cancelled (twice,
as a listener tearing down may) or closed by its client. The collector is off throughout, so
memory kept by a reference cycle would show; every wait is on an event or on the budget.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import tensorswap.wire.connection as connection_module
from helpers.net import until
from tensorswap.cid import Cid
from tensorswap.store import MemoryStore
from tensorswap.wire import BlockServer, ByteBudget, memory_pair
from tensorswap.wire.auth import client_handshake
from tensorswap.wire.connection import FrameConnection, Timeouts, prepare_block
from tensorswap.wire.errors import ProtocolViolation
from tensorswap.wire.frames import Compression
from test_wire_bomb import GatedStore, bomb_frame

MiB = 1 << 20
RAW = 32 * MiB


@pytest.fixture(autouse=True)
def no_collector() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class Watch:
    """Records each decompressed buffer (weakly) and, when ``gate`` is given, holds the
    decompressing thread on it once the buffer exists."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.gate = gate
        self.entered = threading.Event()
        self.buffers: list[weakref.ref[Any]] = []
        self.real = connection_module.decompress

    def __call__(self, data: Any, compression: Any, raw_len: int) -> Any:
        out = self.real(data, compression, raw_len)
        self.buffers.append(weakref.ref(memoryview(out).obj))
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(30)
        return out

    def alive(self) -> int:
        return sum(ref() is not None for ref in self.buffers)


def watch_idle(budget: ByteBudget, watch: Watch) -> list[int]:
    """Each time the budget empties, how many decompressed buffers are still alive then."""
    seen: list[int] = []
    before: Callable[[int], None] | None = budget.on_idle

    def on_idle(granted: int) -> None:
        seen.append(watch.alive())
        if before is not None:
            before(granted)

    budget.on_idle = on_idle
    return seen


async def open_connection(server: BlockServer) -> tuple[FrameConnection, asyncio.Future[None]]:
    a, b = memory_pair(capacity=1 << 22)
    serving = asyncio.ensure_future(server.handle(b))
    conn = FrameConnection(a, timeouts=Timeouts(read=10, handshake=10))
    await client_handshake(conn, None)
    return conn, serving


async def test_a_connection_cancelled_while_its_block_decompresses_keeps_its_share(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gate = threading.Event()
    watch = Watch(gate)
    monkeypatch.setattr(connection_module, "decompress", watch)
    server = BlockServer(MemoryStore())
    idle = watch_idle(server.budget, watch)
    conn, serving = await open_connection(server)
    try:
        await conn.transport.send(bomb_frame(RAW))
        assert await asyncio.to_thread(watch.entered.wait, 30)
        assert server.budget.in_flight >= RAW
        serving.cancel()
        await asyncio.sleep(0)  # one loop turn: the first cancel is being handled
        serving.cancel()  # and a second one, as a listener closing everything may send
        await asyncio.wait([serving], timeout=0)
        assert server.budget.in_flight >= RAW  # the thread still holds the bytes
        gate.set()
        await asyncio.wait([serving])
        await until(lambda: server.budget.in_flight == 0, "the share given back", seconds=10)
    finally:
        gate.set()
        conn.transport.abort()
    assert watch.alive() == 0
    assert idle and idle[-1] == 0  # the budget emptied only once the buffer was gone


async def test_a_client_gone_while_its_block_is_hashed_keeps_its_share() -> None:
    store = GatedStore()
    watch = Watch()
    server = BlockServer(store)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(connection_module, "decompress", watch)
        idle = watch_idle(server.budget, watch)
        conn, serving = await open_connection(server)
        try:
            await conn.transport.send(bomb_frame(RAW))
            await until(lambda: watch.buffers, "the block decompressed", seconds=10, step=0.005)
            conn.transport.abort()  # the client goes while the sink's thread is held
            await until(lambda: server.stats.open_connections == 0, "the close seen", seconds=10)
            assert server.budget.in_flight >= RAW
            assert watch.alive() == 1
            store.gate.set()  # the hash check fails: nothing is stored
            await asyncio.wait([serving])
            await until(lambda: server.budget.in_flight == 0, "the share given back", seconds=10)
        finally:
            store.gate.set()
            conn.transport.abort()
    assert watch.alive() == 0
    assert idle and idle[-1] == 0


async def test_a_stored_block_gives_its_share_back_though_the_store_keeps_its_bytes() -> None:
    """A memory store adopts the buffer: the share goes back when it is stored, not freed."""
    store = MemoryStore()
    server = BlockServer(store)
    conn, serving = await open_connection(server)
    data = bytes(range(256)) * (RAW // 256)
    try:
        cid = Cid.of(data)
        await conn.send_prepared(prepare_block(cid, data, Compression.ZSTD))
        await until(lambda: cid in store, "the block stored", seconds=10, step=0.005)
        await until(lambda: server.budget.in_flight == 0, "the share given back", seconds=10)
    finally:
        conn.transport.abort()
        await asyncio.wait([serving])
    assert store.get(cid) == data


class FailingWatch(Watch):
    """A decompressor that makes the buffer, then fails (a size that does not match, say):
    the buffer stays referenced from the failing frame, that is, from the error's traceback.
    ``at_death``: the budget's bytes in flight when each buffer was freed."""

    def __init__(self, budget: ByteBudget) -> None:
        super().__init__()
        self.budget = budget
        self.at_death: list[int] = []

    def __call__(self, data: Any, compression: Any, raw_len: int) -> Any:
        out = self.real(data, compression, raw_len)
        owner = memoryview(out).obj
        self.buffers.append(weakref.ref(owner))
        weakref.finalize(owner, lambda: self.at_death.append(self.budget.in_flight))
        raise ProtocolViolation(f"decompressed to {len(out)} bytes, not as claimed")


async def test_a_block_that_fails_to_decompress_gives_its_share_back_after_its_buffer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = BlockServer(MemoryStore())
    watch = FailingWatch(server.budget)
    monkeypatch.setattr(connection_module, "decompress", watch)
    conn, serving = await open_connection(server)
    try:
        await conn.transport.send(bomb_frame(RAW))
        await asyncio.wait([serving], timeout=30)  # the server refuses and ends the connection
        await until(lambda: server.budget.in_flight == 0, "the share given back", seconds=10)
    finally:
        conn.transport.abort()
    assert watch.alive() == 0
    assert len(watch.at_death) == 1
    assert watch.at_death[0] >= RAW  # still counted when it was freed: its share went after
