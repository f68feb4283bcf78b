"""Block exchange over tensorswap frames: push/pull, dedup, resume, verification, auth, TLS.

Every exchange runs over each Transport (in-memory and loopback TCP; TLS where it matters).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

from helpers.net import CertFiles, Pair, transport_pair
from helpers.store import make_older
from tensorswap.cid import Cid
from tensorswap.codec import TensorBlock
from tensorswap.store import (
    DirectoryStore,
    MemoryStore,
    ModelUpdate,
    get_tensor,
    get_update,
    manifest_closure,
    put_tensor,
    put_update,
)
from tensorswap.store.base import BlockStore
from tensorswap.transport import Transport, memory_pair
from tensorswap.wire.auth import client_ssl_context, server_ssl_context
from tensorswap.wire.client import BlockClient
from tensorswap.wire.connection import FrameConnection, Timeouts, prepare_block
from tensorswap.wire.errors import (
    AuthenticationFailed,
    BlockHashMismatch,
    ChecksumMismatch,
    ConnectionFailed,
    PeerTimeout,
    RemoteError,
)
from tensorswap.wire.frames import Compression
from tensorswap.wire.messages import Commit, Committed, Offer, Want, wire_cids
from tensorswap.wire.server import BlockServer

if TYPE_CHECKING:
    from typing_extensions import Buffer

KEY = b"correct horse battery staple"
CHUNK = 16 * 1024  # small chunks: many blocks from a small tensor


def tensor_store(n: int = 40_000, seed: int = 0) -> tuple[MemoryStore, Cid, np.ndarray]:
    store = MemoryStore()
    values = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    root = put_tensor(store, TensorBlock("w", values), chunk_bytes=CHUNK)
    return store, root, values


def block_sizes(store: BlockStore, cids: list[Cid]) -> int:
    return sum(store.get(cid).nbytes for cid in cids)


@pytest.fixture(params=["memory", "tcp"])
async def pair(request: pytest.FixtureRequest) -> AsyncIterator[Pair]:
    """Two connected ends, (client, server), of each kind of transport."""
    async with transport_pair(request.param) as ends:
        yield ends


@pytest.fixture(params=["memory", "tcp"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@contextlib.asynccontextmanager
async def connected(
    server: BlockServer, kind: str, key: bytes | None = None
) -> AsyncIterator[BlockClient]:
    """A client of ``server``: over loopback TCP (``server.start``) or an in-memory pair."""
    if kind == "tcp":
        async with (
            await server.start() as started,
            await BlockClient.connect("127.0.0.1", started.port, key=key) as client,
        ):
            yield client
        return
    a, b = memory_pair(capacity=1 << 20)
    serving = asyncio.ensure_future(server.handle(b))
    try:
        async with await BlockClient.open(a, key=key) as client:
            yield client
    finally:
        async with asyncio.timeout(10):
            await serving  # the server returns once the client closed
        await b.aclose()


# ── round trips ──────────────────────────────────────────────────────────────
@pytest.mark.parametrize("compression", [Compression.NONE, Compression.LZ4, "auto"])
async def test_push_tensor(compression: Compression | str, tmp_path: Path, kind: str) -> None:
    src, root, values = tensor_store()
    dst = DirectoryStore(tmp_path / "dst")
    landed: list[Cid] = []
    async with connected(BlockServer(dst, on_root=landed.append), kind) as client:
        result = await client.push(src, root, compression=compression)  # type: ignore[arg-type]
    closure = manifest_closure(src, root)
    assert result.offered == result.sent_blocks == len(closure)
    assert result.sent_bytes == block_sizes(src, closure)
    assert landed == [root]
    np.testing.assert_array_equal(get_tensor(dst, root).values, values)


async def test_push_model_update_and_pull_it_back(kind: str) -> None:
    src = MemoryStore()
    update = ModelUpdate({"a": np.ones((30, 40), np.float32), "b": np.arange(5000.0)}, 7)
    root = put_update(src, update, chunk_bytes=CHUNK)
    dst, back = MemoryStore(), MemoryStore()
    async with connected(BlockServer(dst), kind) as client:
        await client.push(src, root)
        pulled = await client.pull(root, back)
    assert pulled.fetched == pulled.blocks == len(manifest_closure(src, root))
    got = get_update(back, root)
    assert got.num_samples == 7
    np.testing.assert_array_equal(got.tensors["b"], update.tensors["b"])


async def test_get_blocks_reports_missing(kind: str) -> None:
    src, root, _ = tensor_store()
    absent = Cid.of(b"nobody has this")
    async with connected(BlockServer(src), kind) as client:
        into = MemoryStore()
        missing = await client.get_blocks([root, absent], into)
        assert missing == [absent]
        assert into.has(root)
        with pytest.raises(RemoteError) as info:
            await client.pull(absent, MemoryStore())
        assert info.value.code == "not_found"


# ── dedup and resume ─────────────────────────────────────────────────────────
async def test_second_push_sends_nothing_and_shared_chunks_are_skipped(kind: str) -> None:
    src, root, values = tensor_store()
    changed = values.copy()
    changed[-10:] += 1  # only the last chunk differs
    root2 = put_tensor(src, TensorBlock("w", changed), chunk_bytes=CHUNK)
    dst = MemoryStore()
    async with connected(BlockServer(dst), kind) as client:
        first = await client.push(src, root)
        again = await client.push(src, root)
        second = await client.push(src, root2)
    assert first.sent_blocks == len(manifest_closure(src, root))
    assert (again.sent_blocks, again.sent_bytes) == (0, 0)
    assert second.sent_blocks == 2  # the new last chunk and the new manifest
    assert again.wire_bytes < 1000  # one offer and one commit


class KillAfter(Transport):
    """Delegates to ``inner`` but aborts the connection once ``limit`` bytes were sent."""

    def __init__(self, inner: Transport, limit: int) -> None:
        self.inner = inner
        self.limit = limit
        self.peer = inner.peer

    @property  # type: ignore[override]
    def bytes_sent(self) -> int:
        return self.inner.bytes_sent

    async def send(self, *parts: Buffer) -> None:
        for part in parts:
            view = memoryview(part).cast("B")
            room = self.limit - self.inner.bytes_sent
            if view.nbytes > room:
                await self.inner.send(view[: max(room, 0)])
                self.inner.abort()
                raise ConnectionFailed(self.peer, "killed by the test")
            await self.inner.send(view)

    async def receive_into(self, buffer: Buffer) -> int:
        return await self.inner.receive_into(buffer)

    async def send_eof(self) -> None:
        await self.inner.send_eof()

    async def aclose(self) -> None:
        await self.inner.aclose()

    def abort(self) -> None:
        self.inner.abort()


async def test_killed_transfer_resumes_with_only_missing_blocks(
    pair: Pair,
) -> None:
    src, root, values = tensor_store(200_000)
    closure = manifest_closure(src, root)
    total = block_sizes(src, closure)
    dst = MemoryStore()
    server = BlockServer(dst)
    client_end, server_end = pair
    serving = asyncio.ensure_future(server.handle(server_end))
    client = await BlockClient.open(KillAfter(client_end, total // 2))
    with pytest.raises(ConnectionFailed):
        await client.push(src, root)
    await serving  # the server stores every block that arrived whole, then gives up
    lacking = dst.missing(closure)
    assert 0 < len(lacking) < len(closure)
    assert server.stats.failed_connections == 1

    async with (
        await server.start() as listening,
        await BlockClient.connect("127.0.0.1", listening.port) as again,
    ):
        result = await again.push(src, root)
    assert result.sent_blocks == len(lacking)
    assert result.sent_bytes == block_sizes(src, lacking)
    np.testing.assert_array_equal(get_tensor(dst, root).values, values)


async def test_offered_blocks_the_server_holds_are_touched(pair: Pair) -> None:
    """Blocks a client learns the server holds get a fresh age, so that a collection with a
    grace period cannot delete them before the client references them."""
    src, root, _ = tensor_store(n=2_000)
    dst = MemoryStore()
    blocks = manifest_closure(src, root)
    held, lacking = blocks[:2], blocks[2:]
    for cid in held:
        dst.put_verified(cid, src.get(cid))
        make_older(dst, cid, 10_000)
    a, b = pair
    serving = asyncio.ensure_future(BlockServer(dst).handle(b))
    async with await BlockClient.open(a) as client:
        result = await client.push(src, root)
    await serving
    assert result.sent_blocks == len(lacking)
    assert all(dst.age_of(cid) < 60 for cid in held)


# ── verification ─────────────────────────────────────────────────────────────
async def test_block_that_does_not_match_its_cid_is_not_stored(pair: Pair) -> None:
    dst = MemoryStore()
    server = BlockServer(dst)
    a, b = pair
    serving = asyncio.ensure_future(server.handle(b))
    client = await BlockClient.open(a)
    claimed = Cid.of(b"the real bytes")
    await client.conn.send_prepared(prepare_block(claimed, b"forged bytes!!"))
    with pytest.raises(RemoteError) as info:
        await client.commit([])
    assert info.value.code == "block_hash_mismatch"
    await serving
    assert isinstance(server.errors[-1], BlockHashMismatch)
    assert not dst.has(claimed) and dst.size().blocks == 0
    await a.aclose()


@pytest.mark.parametrize("where", ["data", "cid"])
async def test_corrupted_block_frame_is_a_checksum_mismatch_and_not_stored(
    where: str, pair: Pair
) -> None:
    dst = MemoryStore()
    server = BlockServer(dst)
    a, b = pair
    serving = asyncio.ensure_future(server.handle(b))
    client = await BlockClient.open(a)
    data = bytes(range(256)) * 64
    cid = Cid.of(data)
    block = prepare_block(cid, data)
    prefix = bytearray(block.prefix)
    body = bytearray(data)
    if where == "data":
        body[100] ^= 1  # the server checks this frame's CRC32C off the event loop
    else:
        prefix[3] ^= 0x40  # the CID no longer parses: still reported as the CRC mismatch
    await client.transport.send(block.header, bytes(prefix), bytes(body))
    with pytest.raises(RemoteError) as info:
        await client.commit([])
    assert info.value.code == "checksum_mismatch"
    await serving
    assert isinstance(server.errors[-1], ChecksumMismatch)
    assert dst.size().blocks == 0
    await a.aclose()


async def test_commit_of_incomplete_root_is_refused(pair: Pair) -> None:
    src, root, _ = tensor_store()
    dst = MemoryStore()
    server = BlockServer(dst)
    a, b = pair
    serving = asyncio.ensure_future(server.handle(b))
    client = await BlockClient.open(a)
    await client.put_blocks(src, [root])  # the manifest without its chunks
    with pytest.raises(RemoteError) as info:
        await client.commit([root])
    assert "lacks" in info.value.message
    await serving
    await a.aclose()


async def test_want_is_the_offered_cids_the_server_lacks(pair: Pair) -> None:
    src, root, _ = tensor_store()
    closure = manifest_closure(src, root)
    dst = MemoryStore()
    dst.put(src.get(closure[1]))
    server = BlockServer(dst)
    a, b = pair
    serving = asyncio.ensure_future(server.handle(b))
    client = await BlockClient.open(a)
    conn: FrameConnection = client.conn
    await conn.send_message(Offer(cids=wire_cids(closure)), 5)
    want, stream = await conn.receive_message(Want)
    assert stream == 5
    assert want.cids == wire_cids([c for c in closure if c != closure[1]])
    await conn.send_message(Commit(roots=[], blocks=0, nbytes=0), 6)
    assert (await conn.receive_message(Committed))[0].blocks == 0
    await a.aclose()
    await serving


# ── authentication and TLS ───────────────────────────────────────────────────
async def test_matching_keys_authenticate_both_ways(kind: str) -> None:
    src, root, values = tensor_store()
    dst = MemoryStore()
    async with connected(BlockServer(dst, key=KEY), kind, key=KEY) as client:
        await client.push(src, root)
    np.testing.assert_array_equal(get_tensor(dst, root).values, values)


@pytest.mark.parametrize(
    ("server_key", "client_key", "needle"),
    [
        (KEY, b"wrong key", "refused"),
        (KEY, None, "requires a shared key"),
        (None, KEY, "does not authenticate"),
    ],
)
async def test_wrong_or_missing_key_is_refused_and_nothing_stored(
    server_key: bytes | None, client_key: bytes | None, needle: str, pair: Pair
) -> None:
    dst = MemoryStore()
    server = BlockServer(dst, key=server_key)
    a, b = pair
    serving = asyncio.ensure_future(server.handle(b))
    with pytest.raises(AuthenticationFailed, match=needle):
        await BlockClient.open(a, key=client_key)
    await serving
    assert dst.size().blocks == 0
    if server_key is not None and client_key is not None:
        assert isinstance(server.errors[-1], AuthenticationFailed)


async def test_push_over_tls_with_a_key(cert_files: CertFiles) -> None:
    cert, key = cert_files
    src, root, values = tensor_store()
    dst = MemoryStore()
    server = BlockServer(dst, key=KEY)
    async with (
        await server.start(ssl=server_ssl_context(cert, key)),
        await BlockClient.connect(
            "127.0.0.1", server.port, key=KEY, ssl=client_ssl_context(cert)
        ) as client,
    ):
        assert client.transport.ssl_object is not None  # type: ignore[attr-defined]
        await client.push(src, root)
    np.testing.assert_array_equal(get_tensor(dst, root).values, values)


# ── timeouts ─────────────────────────────────────────────────────────────────
async def test_client_drops_a_server_that_never_welcomes(pair: Pair) -> None:
    a, b = pair
    with pytest.raises(PeerTimeout):
        await BlockClient.open(a, timeouts=Timeouts(handshake=0.05))
    await b.aclose()


async def test_server_drops_a_client_that_stalls_mid_frame(pair: Pair) -> None:
    src, root, _ = tensor_store()
    server = BlockServer(MemoryStore(), timeouts=Timeouts(read=0.05, idle=5))
    a, b = pair
    serving = asyncio.ensure_future(server.handle(b))
    await BlockClient.open(a)
    block = prepare_block(root, src.get(root))
    await a.send(block.header, block.prefix)  # then nothing: the body never comes
    await serving
    assert isinstance(server.errors[-1], PeerTimeout)
    await a.aclose()


async def test_server_drops_an_idle_client(pair: Pair) -> None:
    server = BlockServer(MemoryStore(), timeouts=Timeouts(idle=0.05))
    a, b = pair
    serving = asyncio.ensure_future(server.handle(b))
    await BlockClient.open(a)
    await serving
    assert isinstance(server.errors[-1], PeerTimeout)
    await a.aclose()


# ── pipelined pushes ─────────────────────────────────────────────────────────
async def test_push_tensor_pipeline_matches_put_tensor_and_dedups(kind: str) -> None:
    values = np.random.default_rng(3).standard_normal(50_000).astype(np.float32)
    values[:20_000] = 0.0  # several identical all-zero chunks
    tensor = TensorBlock("t", values, num_samples=9, metadata={"k": "v"})
    expected_store = MemoryStore()
    expected = put_tensor(expected_store, tensor, chunk_bytes=CHUNK)
    closure = manifest_closure(expected_store, expected)
    dst = MemoryStore()
    async with connected(BlockServer(dst), kind) as client:
        first = await client.push_tensor(tensor, chunk_bytes=CHUNK, batch=3)
        again = await client.push_tensor(tensor, chunk_bytes=CHUNK, batch=3)
    assert first.roots == (expected,)
    assert first.offered == first.sent_blocks == len(closure)  # each unique block once
    assert first.sent_bytes == block_sizes(expected_store, closure)
    assert (again.sent_blocks, again.offered) == (0, len(closure))
    np.testing.assert_array_equal(get_tensor(dst, expected).values, values)


async def test_push_update_pipeline_matches_put_update(kind: str) -> None:
    update = ModelUpdate(
        {"a": np.ones((30, 40), np.float32), "b": np.arange(5000.0)}, 7, {"m": "1"}, "u"
    )
    expected = put_update(MemoryStore(), update, chunk_bytes=CHUNK)
    dst = MemoryStore()
    async with connected(BlockServer(dst), kind) as client:
        result = await client.push_update(update, chunk_bytes=CHUNK, compression="auto")
    assert result.roots == (expected,)
    got = get_update(dst, expected)
    np.testing.assert_array_equal(got.tensors["a"], update.tensors["a"])


async def test_killed_push_tensor_resumes(pair: Pair) -> None:
    values = np.random.default_rng(4).standard_normal(200_000).astype(np.float32)
    tensor = TensorBlock("w", values)
    dst = MemoryStore()
    server = BlockServer(dst)
    client_end, server_end = pair
    serving = asyncio.ensure_future(server.handle(server_end))
    client = await BlockClient.open(KillAfter(client_end, values.nbytes // 2))
    with pytest.raises(ConnectionFailed):
        await client.push_tensor(tensor, chunk_bytes=CHUNK)
    await serving
    held = dst.size().blocks
    assert held > 0
    async with (
        await server.start() as listening,
        await BlockClient.connect("127.0.0.1", listening.port) as again,
    ):
        result = await again.push_tensor(tensor, chunk_bytes=CHUNK)
    assert result.sent_blocks == result.offered - held
    np.testing.assert_array_equal(get_tensor(dst, result.roots[0]).values, values)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8", "float64"])
def test_chunker_blocks_equal_put_tensor_blocks(dtype: str) -> None:
    from tensorswap.codec import DType
    from tensorswap.wire._chunks import TensorChunker

    values = (np.arange(10_001) % 97).astype(DType.parse(dtype).numpy).reshape(73, 137)
    tensor = TensorBlock("x", values)
    store = MemoryStore()
    root = put_tensor(store, tensor, chunk_bytes=4096)
    chunker = TensorChunker(tensor, chunk_bytes=4096)
    chunks = [chunker.prepare(start) for start in chunker.starts]
    for chunk in chunks:
        assert b"".join(bytes(p) for p in chunk.frame.parts) == bytes(store.get(chunk.cid))
    assert chunker.manifest([c.ref for c in chunks if c.ref]).cid == root


def test_chunker_of_an_empty_tensor_matches_put_tensor() -> None:
    from tensorswap.wire._chunks import TensorChunker

    tensor = TensorBlock("empty", np.empty((0, 3), np.float32))
    root = put_tensor(MemoryStore(), tensor)
    chunker = TensorChunker(tensor, chunk_bytes=1024)
    assert list(chunker.starts) == []
    assert chunker.manifest([]).cid == root
