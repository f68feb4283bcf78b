"""Decompression bombs and bad blocks against a BlockServer: bounded memory, prompt answers."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
from collections.abc import Callable

import numpy as np
import pytest

from helpers.net import read_error, until
from tensorswap.cid import Cid
from tensorswap.store import MemoryStore
from tensorswap.wire import BlockClient, BlockServer, memory_pair
from tensorswap.wire.auth import client_handshake
from tensorswap.wire.connection import FrameConnection, Timeouts, prepare_block
from tensorswap.wire.errors import (
    BlockHashMismatch,
    ConnectionFailed,
    OverBudget,
    RemoteError,
    RemoteOverBudget,
    StreamEnded,
)
from tensorswap.wire.frames import Compression, FrameHeader, FrameKind, crc32c, pack_block_prefix
from tensorswap.wire.tcp import connect_tcp

MiB = 1 << 20


def bomb_frame(raw_len: int, cid: Cid | None = None, stream_id: int = 0) -> bytes:
    """A zstd BLOCK frame: ``raw_len`` zero bytes in a few KB, under a CID they do not match."""
    packed = bytes(prepare_block(Cid.of(b"x"), bytes(raw_len), Compression.ZSTD).parts[0])
    assert len(packed) < raw_len // 100
    payload = pack_block_prefix(cid or Cid.of(b"not these bytes"), raw_len) + packed
    header = FrameHeader(FrameKind.BLOCK, len(payload), crc32c(payload), stream_id, 1)
    return header.pack() + payload


async def raw_connection(port: int) -> FrameConnection:
    transport = await connect_tcp("127.0.0.1", port, timeout=5)
    conn = FrameConnection(transport, timeouts=Timeouts(read=10, handshake=10))
    await client_handshake(conn, None)
    return conn


async def expect_closed(conn: FrameConnection) -> None:
    """The server closed the connection: the next read finds its end."""
    with pytest.raises((StreamEnded, ConnectionFailed)):
        await conn.receive_frame()


class GatedStore(MemoryStore):
    """A store whose writes wait until ``gate`` is set (blocks stay in flight meanwhile)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def put_verified(
        self, cid: Cid, data: object, *, adopt: bool = False, threads: int | None = None
    ) -> None:
        assert self.gate.wait(30)
        super().put_verified(cid, data, adopt=adopt, threads=threads)  # type: ignore[arg-type]


async def settled(condition: Callable[[], object], what: str) -> None:
    """Wait until ``condition()`` holds (the store's worker threads make it true: polled)."""
    await until(condition, what, seconds=10, step=0.005)


# ── (b) many bomb connections at once ────────────────────────────────────────
async def test_concurrent_bombs_never_exceed_the_budget_and_real_blocks_still_land() -> None:
    limit = 6 * MiB
    store = MemoryStore()
    async with await BlockServer(store, max_inflight_bytes=limit).start() as server:
        frame = bomb_frame(4 * MiB)  # 4 MiB once decompressed: one such frame at a time

        async def bomber() -> str:
            conn = await raw_connection(server.port)
            try:
                await conn.transport.send(*[frame] * 5)
                code = (await read_error(conn)).code
                await expect_closed(conn)
                return code
            finally:
                conn.transport.abort()

        codes = await asyncio.gather(*(bomber() for _ in range(6)))
        assert codes == ["block_hash_mismatch"] * 6
        budget = server.budget
        await settled(lambda: budget.in_flight == 0, "the budget to empty")
        assert 0 < budget.peak <= limit
        assert budget.waiting == 0

        data = np.arange(MiB // 2, dtype=np.uint32).tobytes()  # 2 MiB, ~2 MiB compressed
        src = MemoryStore()
        cid = src.put(data)
        async with await BlockClient.connect("127.0.0.1", server.port) as client:
            await client.put_blocks(src, [cid], compression=Compression.ZSTD)
            committed = await client.commit([cid])
        assert committed.blocks == 1
        assert store.has(cid)
        assert budget.peak <= limit
        # the compressed payload's share goes back when its buffer is freed, which a worker
        # thread may do just after the block is stored: through the loop, not at once
        await settled(lambda: budget.in_flight == 0, "the compressed payload's share back")
        stats = server.stats
        assert stats.inflight_peak_bytes == budget.peak <= stats.inflight_limit_bytes == limit
        assert stats.inflight_bytes == 0
        assert stats.failed_connections == 6
        assert all(isinstance(e, BlockHashMismatch) for e in server.errors)


async def test_a_connection_over_budget_waits_for_others_to_store_then_goes_on() -> None:
    store = GatedStore()
    limit = 3 * MiB
    server = BlockServer(store, max_inflight_bytes=limit)
    blocks = [np.full(MiB, i, dtype=np.uint8).tobytes() for i in range(5)]
    async with await server.start():
        clients = [await BlockClient.connect("127.0.0.1", server.port) for _ in blocks]
        try:
            src = MemoryStore()
            cids = [src.put(b) for b in blocks]

            async def push(client: BlockClient, cid: Cid) -> None:
                await client.put_blocks(src, [cid])
                await client.commit([cid])

            pushes = [
                asyncio.ensure_future(push(c, cid)) for c, cid in zip(clients, cids, strict=True)
            ]
            budget = server.budget
            # two blocks (1 MiB + prefix each) are held by the closed gate; the other three
            # wait (and so does a Commit that came after them: it queues behind them)
            await settled(lambda: budget.waiting >= 3, "three blocks waiting")
            assert budget.in_flight <= limit
            assert server.stats.inflight_waits >= 3
            store.gate.set()
            await asyncio.gather(*pushes)
        finally:
            for client in clients:
                await client.aclose()
    assert all(store.has(cid) for cid in cids)
    assert budget.peak <= limit
    assert budget.in_flight == 0


async def test_connections_waiting_for_budget_release_everything_when_the_server_closes() -> None:
    store = GatedStore()
    server = BlockServer(store, max_inflight_bytes=2 * MiB)
    await server.start()
    conns = [await raw_connection(server.port) for _ in range(4)]
    try:
        for i, conn in enumerate(conns):
            data = np.full(MiB, i, dtype=np.uint8)
            await conn.send_prepared(prepare_block(Cid.of(data), data))
        budget = server.budget
        await settled(lambda: budget.waiting == 3, "three connections waiting")
        closing = asyncio.ensure_future(server.aclose())
        await settled(lambda: budget.waiting == 0, "the waiters to be cancelled")
        store.gate.set()  # the block being stored finishes (it arrived whole: it is kept)
        await closing
        assert budget.in_flight == 0
        assert store.size().blocks == 1
    finally:
        store.gate.set()
        for conn in conns:
            conn.transport.abort()
        await server.aclose()


# ── (c) a frame that could never fit ─────────────────────────────────────────
async def test_a_block_larger_than_the_whole_budget_is_refused_with_over_budget() -> None:
    server = BlockServer(MemoryStore(), max_inflight_bytes=MiB)
    a, b = memory_pair(capacity=1 << 20)
    serving = asyncio.ensure_future(server.handle(b))
    src = MemoryStore()
    cid = src.put(bytes(2 * MiB))  # compresses to a few KB: only raw_len is too large
    client = await BlockClient.open(a)
    await client.put_blocks(src, [cid], compression=Compression.ZSTD)
    with pytest.raises(RemoteOverBudget) as info:
        await client.commit([cid])
    assert isinstance(info.value, RemoteError)
    assert info.value.code == "over_budget"
    assert str(2 * MiB) in info.value.message
    await serving
    failure = server.errors[-1]
    assert isinstance(failure, OverBudget)
    assert failure.limit == MiB
    assert failure.length > 2 * MiB
    stats = server.stats
    assert (stats.inflight_refused, stats.inflight_bytes, stats.inflight_peak_bytes) == (1, 0, 0)
    await a.aclose()


async def test_an_uncompressed_frame_larger_than_the_budget_is_refused_before_it_is_read() -> None:
    server = BlockServer(MemoryStore(), max_inflight_bytes=MiB)
    a, b = memory_pair(capacity=1 << 20)
    serving = asyncio.ensure_future(server.handle(b))
    conn = FrameConnection(a, timeouts=Timeouts(read=5))
    await client_handshake(conn, None)
    data = bytes(2 * MiB)
    block = prepare_block(Cid.of(data), data)
    await a.send(block.header, block.prefix)  # the 2 MiB body never comes
    error = await read_error(conn)
    assert error.code == "over_budget"
    await serving
    assert server.budget.in_flight == 0
    assert server.budget.refused == 1
    await a.aclose()


def test_max_inflight_bytes_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_inflight_bytes"):
        BlockServer(MemoryStore(), max_inflight_bytes=0)


# ── (d) a block that does not match its CID ──────────────────────────────────
async def test_a_hash_mismatch_is_answered_at_once_logged_and_the_connection_closed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    claimed = Cid.of(b"the real bytes")
    async with await BlockServer(MemoryStore()).start() as server:
        conn = await raw_connection(server.port)
        try:
            with caplog.at_level(logging.WARNING, logger="tensorswap.wire"):
                await conn.send_prepared(prepare_block(claimed, b"forged bytes!!"))
                error = await read_error(conn)  # nothing more sent: the answer comes anyway
                await expect_closed(conn)
        finally:
            conn.transport.abort()
        assert error.code == "block_hash_mismatch"
        assert str(claimed) in error.message
        assert isinstance(server.errors[-1], BlockHashMismatch)
        assert server.budget.in_flight == 0
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(claimed) in r.getMessage() and "127.0.0.1" in r.getMessage() for r in warnings)


async def test_a_bomb_is_answered_at_once_too() -> None:
    async with await BlockServer(MemoryStore()).start() as server:
        conn = await raw_connection(server.port)
        try:
            await conn.transport.send(bomb_frame(8 * MiB))
            assert (await read_error(conn)).code == "block_hash_mismatch"
            await expect_closed(conn)
        finally:
            conn.transport.abort()
        # its share goes back when its bytes are freed (on the thread that hashed them)
        await settled(lambda: server.budget.in_flight == 0, "the bomb's bytes freed")
        assert server.budget.peak > 8 * MiB  # its raw_len was counted before decompressing


# ── nothing of a refused block outlives its connection ───────────────────────
async def test_kept_errors_do_not_hold_the_blocks_that_failed() -> None:
    async with await BlockServer(MemoryStore()).start() as server:
        conn = await raw_connection(server.port)
        try:
            await conn.send_prepared(prepare_block(Cid.of(b"real"), b"forged"))
            assert (await read_error(conn)).code == "block_hash_mismatch"
            await expect_closed(conn)
        finally:
            conn.transport.abort()
    failure = server.errors[-1]
    assert isinstance(failure, BlockHashMismatch)
    chain = [failure, failure.__cause__, failure.__context__]
    assert failure.__cause__ is not None
    # a traceback would keep the failed check's frames, and the block in them, alive
    assert all(e is None or e.__traceback__ is None for e in chain)


async def test_a_dropped_server_frees_its_store_without_waiting_for_the_collector() -> None:
    """No reference cycle (budget, trimmer, kept errors) keeps a served store alive."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        for forged in (False, True):
            store = MemoryStore()
            server = BlockServer(store)
            a, b = memory_pair(capacity=1 << 22)
            serving = asyncio.ensure_future(server.handle(b))
            src = MemoryStore()
            cid = src.put(bytes(range(256)) * 8192)
            async with await BlockClient.open(a) as client:
                if forged:
                    await client.conn.send_prepared(prepare_block(Cid.of(b"x"), b"y"))
                    with pytest.raises(RemoteError):
                        await client.commit([])
                else:
                    await client.put_blocks(src, [cid], compression=Compression.ZSTD)
                    await client.commit([cid])
            await serving
            await b.aclose()
            held = id(store)
            del store, server, serving
            # Deterministic: whatever the collector finds unreachable is kept in gc.garbage
            # (DEBUG_SAVEALL) instead of freed, so a store held by a cycle shows up there;
            # one still referenced for a moment by a worker thread finishing its item is
            # reachable, not garbage, and frees itself when that thread lets go.
            gc.set_debug(gc.DEBUG_SAVEALL)
            try:
                gc.collect()
                # (the collector clears weak references to what it finds: compare ids)
                cyclic = any(type(o) is MemoryStore and id(o) == held for o in gc.garbage)
            finally:
                gc.set_debug(0)
                gc.garbage.clear()
            assert not cyclic, f"forged={forged}: a reference cycle held the store"
    finally:
        if enabled:
            gc.enable()
