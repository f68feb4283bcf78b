"""Lean blocks: BLOCK frames without a CRC32C where both sides agreed, their CIDs checked."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from tensorswap.cid import Cid
from tensorswap.codec import TensorBlock
from tensorswap.store import MemoryStore, get_tensor
from tensorswap.transport import memory_pair
from tensorswap.wire.client import BlockClient
from tensorswap.wire.connection import FrameConnection, prepare_block
from tensorswap.wire.errors import (
    BlockHashMismatch,
    ChecksumMismatch,
    ProtocolViolation,
    RemoteError,
)
from tensorswap.wire.frames import (
    HEADER_SIZE,
    MAGIC,
    NO_PAYLOAD_CRC,
    FrameHeader,
    FrameKind,
)
from tensorswap.wire.server import BlockServer

_BIG = 1 << 30


def _tap(transport: Any, seen: list[FrameHeader]) -> None:
    """Record the header of every frame ``transport`` sends."""

    def record(parts: tuple[Any, ...]) -> None:
        head = bytes(memoryview(parts[0]).cast("B")) if parts else b""
        if len(head) == HEADER_SIZE and head.startswith(MAGIC):
            seen.append(FrameHeader.unpack(head, max_payload=_BIG, max_block_payload=_BIG))

    send: Callable[..., Any] = transport.send
    send_nowait: Callable[..., bool] = transport.send_nowait

    async def tapped_send(*parts: Any) -> None:
        record(parts)
        await send(*parts)

    def tapped_nowait(*parts: Any) -> bool:
        sent = send_nowait(*parts)
        if sent:
            record(parts)
        return sent

    transport.send, transport.send_nowait = tapped_send, tapped_nowait


def _blocks(headers: list[FrameHeader]) -> list[FrameHeader]:
    return [h for h in headers if h.kind is FrameKind.BLOCK]


def _tensor() -> TensorBlock:
    values = np.random.default_rng(0).standard_normal(300_000).astype(np.float32)
    return TensorBlock("w", values)


@pytest.mark.parametrize(
    ("client_crc", "server_crc", "lean"),
    [(False, False, True), (True, False, False), (False, True, False), (True, True, False)],
)
async def test_blocks_go_without_a_crc32c_only_where_both_sides_agree(
    client_crc: bool, server_crc: bool, lean: bool
) -> None:
    a, b = memory_pair()
    up: list[FrameHeader] = []
    down: list[FrameHeader] = []
    _tap(a, up)
    _tap(b, down)
    store = MemoryStore()
    server = BlockServer(store, block_crc=server_crc)
    serving = asyncio.ensure_future(server.handle(b))
    client = await BlockClient.open(a, block_crc=client_crc)
    tensor = _tensor()
    result = await client.push_tensor(tensor, chunk_bytes=256 * 1024)
    back = MemoryStore()
    await client.pull(result.roots[0], into=back)
    await client.aclose()
    await serving
    np.testing.assert_array_equal(get_tensor(back, result.roots[0]).values, tensor.values)
    chunks = [h for h in _blocks(up) if h.payload_len > 100_000]
    assert len(chunks) == 5
    for headers in (chunks, _blocks(down)):
        assert headers
        assert {h.lean for h in headers} == {lean}
        if lean:
            assert {h.payload_crc for h in headers} == {0}


async def test_a_corrupted_lean_block_is_refused_by_its_cid_and_not_stored() -> None:
    a, b = memory_pair()
    store = MemoryStore()
    server = BlockServer(store)
    serving = asyncio.ensure_future(server.handle(b))
    client = await BlockClient.open(a)
    assert client.conn.send_lean
    data = bytes(range(256)) * 64
    block = prepare_block(Cid.of(data), data, crc=False)
    body = bytearray(data)
    body[100] ^= 1
    await client.transport.send(block.header, block.prefix, bytes(body))
    with pytest.raises(RemoteError) as info:
        await client.commit([])
    assert info.value.code == "block_hash_mismatch"
    await serving
    assert isinstance(server.errors[-1], BlockHashMismatch)
    assert store.size().blocks == 0
    await a.aclose()


async def test_a_lean_block_to_a_side_that_keeps_crc32c_is_a_protocol_violation() -> None:
    a, b = memory_pair()
    server = BlockServer(MemoryStore(), block_crc=True)
    serving = asyncio.ensure_future(server.handle(b))
    client = await BlockClient.open(a)
    assert not client.conn.send_lean
    data = b"x" * 4096
    block = prepare_block(Cid.of(data), data, crc=False)
    await client.transport.send(block.header, block.prefix, data)
    with pytest.raises(RemoteError) as info:
        await client.commit([])
    assert info.value.code == "protocol_violation"
    await serving
    assert isinstance(server.errors[-1], ProtocolViolation)
    assert "without a CRC32C" in str(server.errors[-1])
    await a.aclose()


def test_the_lean_flag_is_for_block_frames_with_a_zero_crc_only() -> None:
    lean = FrameHeader(FrameKind.BLOCK, 10, 0, 0, NO_PAYLOAD_CRC).pack()
    parsed = FrameHeader.unpack(lean, max_payload=100, max_block_payload=100)
    assert parsed.lean
    nonzero = FrameHeader(FrameKind.BLOCK, 10, 7, 0, NO_PAYLOAD_CRC).pack()
    with pytest.raises(ProtocolViolation, match="payload_crc"):
        FrameHeader.unpack(nonzero, max_payload=100, max_block_payload=100)
    control = FrameHeader(FrameKind.OFFER, 10, 0, 0, NO_PAYLOAD_CRC).pack()
    with pytest.raises(ProtocolViolation, match="flags"):
        FrameHeader.unpack(control, max_payload=100, max_block_payload=100)


async def test_a_checked_frame_still_fails_its_crc32c_as_before() -> None:
    """With ``block_crc`` the corrupted block is a ChecksumMismatch, as it always was."""
    a, b = memory_pair()
    conn_a, conn_b = FrameConnection(a), FrameConnection(b)
    data = b"y" * 1000
    block = prepare_block(Cid.of(data), data)
    body = bytearray(data)
    body[5] ^= 2
    await a.send(block.header, block.prefix, bytes(body))
    with pytest.raises(ChecksumMismatch):
        await conn_b.receive_frame()
    assert not conn_a.send_lean and not conn_b.accept_lean


async def test_on_failure_names_the_client_whose_block_failed_its_cid() -> None:
    from tensorswap.wire import FailedConnection

    failures: list[FailedConnection] = []
    a, b = memory_pair()
    server = BlockServer(MemoryStore(), on_failure=failures.append)
    serving = asyncio.ensure_future(server.handle(b))
    client = await BlockClient.open(a, name="pusher-7")
    data = bytes(range(256)) * 16
    block = prepare_block(Cid.of(data), data, crc=False)
    await client.transport.send(block.header, block.prefix, bytes(4096))
    with pytest.raises(RemoteError):
        await client.commit([])
    await serving
    assert [(f.client, type(f.error)) for f in failures] == [("pusher-7", BlockHashMismatch)]
    assert failures[0].peer == b.peer
    await a.aclose()
