"""Inline submits: a tiny update's blocks ride with its submit (one request, one round trip)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import numpy as np
import pytest

from helpers.net import running
from tensorswap.cid import Cid
from tensorswap.rounds.client import RoundClient
from tensorswap.rounds.core import Collecting, Complete, DuplicateContribution, RoundId, RoundSpec
from tensorswap.rounds.engine import Coordinator
from tensorswap.rounds.protocol.inline import (
    APP_INLINE,
    INLINE_SEND_BYTES,
    MAX_INLINE_BLOCKS,
    MAX_INLINE_BYTES,
    InlineBlock,
    InlineSubmitRequest,
    decode_inline,
    encode_inline,
)
from tensorswap.rounds.server import RoundServer
from tensorswap.store import MemoryStore, ModelUpdate, manifest_closure, put_update
from tensorswap.wire import ProtocolViolation, RemoteError

RID = RoundId(7, "inline")
KEY = b"inline-test-key"


def tiny(value: float) -> dict[str, np.ndarray]:
    return {"w": np.full(8, value, np.float32), "b": np.full(2, -value, np.float32)}


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[RoundServer]:
    with Coordinator.open(tmp_path, run_timer=False) as coord:
        async with running(RoundServer(coord, key=KEY)) as srv:
            yield srv


async def connect(server: RoundServer, peer: str) -> RoundClient:
    return await RoundClient.connect("127.0.0.1", server.port, peer=peer, key=KEY)


async def test_a_tiny_update_is_submitted_in_one_request(server: RoundServer) -> None:
    async with await connect(server, "a") as a, await connect(server, "b") as b:
        await a.start_round(RID, RoundSpec(2))
        before_requests, before_blocks = server.stats.requests, server.stats.blocks_stored
        first = await a.submit(RID, tiny(1.0), 1)
        assert server.stats.requests - before_requests == 1  # no offer, no separate push
        assert first.push.sent_blocks == first.push.offered == 5  # 2 chunks, 3 manifests
        assert server.stats.blocks_stored - before_blocks == 5
        assert isinstance(first.status, Collecting)
        await b.submit(RID, tiny(3.0), 3)
        assert isinstance(await a.wait(RID, timeout=30), Complete)
        result = await a.fetch_result(RID, timeout=30)
    np.testing.assert_allclose(result["w"], (1.0 + 9.0) / 4)
    np.testing.assert_allclose(result["b"], -(1.0 + 9.0) / 4)
    assert sorted(c.peer for c in server.coordinator.contributions(RID)) == ["a", "b"]


async def test_a_refusal_comes_back_typed_and_the_connection_goes_on(server: RoundServer) -> None:
    async with await connect(server, "a") as a:
        await a.start_round(RID, RoundSpec(3))
        await a.submit(RID, tiny(1.0), 1)
        with pytest.raises(DuplicateContribution):
            await a.submit(RID, tiny(2.0), 1)
        assert await a.status(RID) == Collecting(1, 3)


async def test_a_coordinator_without_inline_submits_gets_the_plain_path(
    server: RoundServer,
) -> None:
    del server.blocks.handlers[APP_INLINE]  # as a coordinator from before them
    async with await connect(server, "a") as a:
        await a.start_round(RID, RoundSpec(2))
        done = await a.submit(RID, tiny(1.0), 1)
        assert not a.inline  # learnt once, remembered for this connection
        assert done.push.sent_blocks == 5
        other = RoundId(8, "inline")
        await a.start_round(other, RoundSpec(2))
        requests = server.stats.requests
        again = await a.submit(other, tiny(4.0), 1)
        assert server.stats.requests - requests == 1  # the plain submit, not tried inline
        assert isinstance(again.status, Collecting)
    assert [c.peer for c in server.coordinator.contributions(RID)] == ["a"]


async def test_a_large_update_takes_the_plain_path(server: RoundServer) -> None:
    async with await connect(server, "a") as a:
        await a.start_round(RID, RoundSpec(2))
        big = {"w": np.arange(INLINE_SEND_BYTES // 4 + 1, dtype=np.float32)}
        requests = server.stats.requests
        done = await a.submit(RID, big, 1)
        assert server.stats.requests - requests == 1  # the submit; its blocks went before it
        assert server.stats.roots_committed == 0
        assert done.push.sent_blocks == done.push.offered
        assert a.inline  # still on: the update was just too big for it


async def test_a_block_that_does_not_match_its_cid_ends_the_connection(
    server: RoundServer,
) -> None:
    async with await connect(server, "lead") as lead:
        await lead.start_round(RID, RoundSpec(2))
    store = MemoryStore()
    cid = put_update(store, ModelUpdate(tiny(1.0), 1))
    blocks = [(c, bytes(store.get(c))) for c in reversed(manifest_closure(store, cid))]
    forged = bytearray(blocks[0][1])
    forged[-1] ^= 0xFF
    blocks[0] = (blocks[0][0], bytes(forged))
    async with await connect(server, "a") as a:
        with pytest.raises(RemoteError, match="does not match its CID"):
            await a.blocks.request(APP_INLINE, encode_inline(RID, "a", cid, blocks))
    assert server.coordinator.contributions(RID) == []
    assert not server.store.has(blocks[0][0])


def test_an_inline_submit_is_bounded_when_decoded() -> None:
    store = MemoryStore()
    cid = put_update(store, ModelUpdate(tiny(1.0), 1))
    one = InlineBlock(cid.to_bytes(), bytes(store.get(cid)))

    def body(**fields: object) -> bytes:
        call = {"op": "submit_inline", "round": 1, "initiator": "x", "peer": "p"}
        call |= {"update": cid.to_bytes(), "blocks": [one], **fields}
        return msgspec.msgpack.encode(call)

    assert decode_inline(body()).cid == cid
    for bad, why in [
        ({"blocks": []}, "1 to"),
        ({"blocks": [one] * (MAX_INLINE_BLOCKS + 1)}, "1 to"),
        ({"blocks": [InlineBlock(cid.to_bytes(), b"x" * (MAX_INLINE_BYTES + 1))]}, "at most"),
        ({"blocks": [InlineBlock(b"not a cid", b"")]}, "invalid CID"),
        ({"update": b"\x01"}, "invalid CID"),
        ({"proof": b"short"}, "proof"),
        ({"peer": ""}, "peer name"),
    ]:
        with pytest.raises(ProtocolViolation, match=why):
            decode_inline(body(**bad))
    with pytest.raises(ProtocolViolation):
        decode_inline(b"\xc1")


def test_the_encoder_keeps_the_order_of_the_blocks() -> None:
    store = MemoryStore()
    cid = put_update(store, ModelUpdate(tiny(2.0), 2))
    order = list(reversed(manifest_closure(store, cid)))
    call = decode_inline(encode_inline(RID, "p", cid, [(c, store.get(c)) for c in order]))
    assert isinstance(call, InlineSubmitRequest)
    assert [Cid.parse(b.cid) for b in call.blocks] == order
    assert call.blocks[-1].cid == cid.to_bytes()  # the root last: children first
