"""RoundServer + RoundClient over loopback TCP: rounds and blocks on one port."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from helpers.net import running
from tensorswap.rounds.client import RoundClient
from tensorswap.rounds.core import (
    Collecting,
    Complete,
    DuplicateContribution,
    Failed,
    FakeClock,
    InvalidRoundSpec,
    RoundFailed,
    RoundId,
    RoundNotFound,
    RoundSpec,
    RoundTimeout,
    UpdateMismatch,
)
from tensorswap.rounds.engine import Coordinator
from tensorswap.rounds.server import RoundServer
from tensorswap.store import MemoryStore, ModelUpdate, put_update
from tensorswap.wire.client import BlockClient
from tensorswap.wire.errors import AuthenticationFailed, ProtocolViolation, RemoteError
from tensorswap.wire.server import BlockServer

RID = RoundId(3, "lead")
KEY = b"rounds-test-key"


def weights(value: float) -> dict[str, np.ndarray]:
    return {"w": np.full((4, 3), value, np.float32), "b": np.full(3, value, np.float32)}


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def server(tmp_path: Path, clock: FakeClock) -> AsyncIterator[RoundServer]:
    with Coordinator.open(tmp_path, clock=clock, run_timer=False, durable=False) as coord:
        async with running(RoundServer(coord, key=KEY)) as srv:
            yield srv


async def connect(server: RoundServer, peer: str) -> RoundClient:
    return await RoundClient.connect("127.0.0.1", server.port, peer=peer, key=KEY)


async def test_a_round_over_the_wire(server: RoundServer) -> None:
    lead = await connect(server, "lead")
    async with lead:
        assert await lead.start_round(RID, RoundSpec(3))
        assert not await lead.start_round(RID, RoundSpec(3))
        results = []
        for peer, (value, n) in zip("abc", [(0.0, 100), (2.0, 300), (9.0, 0)], strict=True):
            async with await connect(server, peer) as client:
                results.append(await client.submit(RID, weights(value), n))
        assert [r.status for r in results[:2]] == [Collecting(1, 3), Collecting(2, 3)]
        assert results[0].push.sent_blocks == results[0].push.offered > 0
        status = await lead.wait(RID, timeout=30)
        assert isinstance(status, Complete)
        got = await lead.fetch_result(RID, timeout=30)
        np.testing.assert_allclose(got["w"], 1.5)
        report = await lead.server_status()
        (row,) = report.rounds
        assert (row.received, row.expected, sorted(row.peers)) == (3, 3, ["a", "b", "c"])
        assert row.status["status"] == "Complete" and row.nbytes > 0
        assert report.stats["contributions"] == 3 and report.stats["rounds_completed"] == 1
        assert int(report.stats["bytes_in"]) > row.nbytes


async def test_refusals_arrive_as_the_same_errors_and_keep_the_connection(
    server: RoundServer,
) -> None:
    async with await connect(server, "a") as client:
        with pytest.raises(RoundNotFound) as missing:
            await client.submit(RID, weights(1.0), 1)
        assert missing.value.key == RID.as_key()
        await client.start_round(RID, RoundSpec(2))
        await client.submit(RID, weights(1.0), 1)
        with pytest.raises(DuplicateContribution) as dup:
            await client.submit(RID, weights(2.0), 1)
        assert (dup.value.peer, dup.value.key) == ("a", RID.as_key())
        with pytest.raises(UpdateMismatch):
            client.peer = "b"
            await client.submit(RID, {"w": np.ones(2, np.float32)}, 1)
        with pytest.raises(InvalidRoundSpec):
            await client.start_round(RoundId(9, "x"), RoundSpec(2, strategy="nope"))
        assert await client.status(RID) == Collecting(1, 2)


async def test_wait_times_out_without_blocking_other_requests(server: RoundServer) -> None:
    async with await connect(server, "a") as a, await connect(server, "b") as b:
        await a.start_round(RID, RoundSpec(2))
        waiting = asyncio.create_task(a.wait(RID, timeout=30))
        await b.submit(RID, weights(1.0), 1)
        with pytest.raises(RoundTimeout):
            await b.wait(RID, timeout=0.01)
        await b.blocks.missing([])  # the connection still serves block requests
        b.peer = "c"
        await b.submit(RID, weights(3.0), 1)
        assert isinstance(await waiting, Complete)


async def test_a_deadline_below_quorum_reaches_waiting_clients(
    server: RoundServer, clock: FakeClock
) -> None:
    async with await connect(server, "a") as client:
        await client.start_round(RID, RoundSpec(4, quorum=3, timeout_s=5))
        await client.submit(RID, weights(1.0), 1)
        waiting = asyncio.create_task(client.result(RID, timeout=30))
        await asyncio.sleep(0)
        clock.advance(6)
        server.coordinator.check_deadlines()
        with pytest.raises(RoundFailed, match="timeout: 1 of 4 peers"):
            await waiting
        assert await client.status(RID) == Failed("timeout: 1 of 4 peers (quorum 3)")


async def test_fetch_moves_only_the_blocks_the_client_lacks(server: RoundServer) -> None:
    async with await connect(server, "a") as client:
        await client.start_round(RID, RoundSpec(1))
        await client.submit(RID, weights(5.0), 1)
        cid = await client.result(RID, timeout=30)
        first = await client.blocks.pull(cid, client.store)
        again = await client.blocks.pull(cid, client.store)
        assert first.fetched > 0 and again.fetched == 0


async def test_resubmitting_the_same_update_elsewhere_sends_no_blocks(server: RoundServer) -> None:
    async with await connect(server, "a") as client:
        await client.start_round(RID, RoundSpec(2))
        await client.start_round(RoundId(4, "lead"), RoundSpec(2))
        await client.submit(RID, weights(5.0), 1)
        again = await client.submit(RoundId(4, "lead"), weights(5.0), 1)
        assert again.push.sent_blocks == 0


async def test_wrong_key_is_refused(server: RoundServer) -> None:
    with pytest.raises((AuthenticationFailed, RemoteError)):
        await RoundClient.connect("127.0.0.1", server.port, peer="x", key=b"wrong")


async def test_plain_block_clients_still_work(server: RoundServer) -> None:
    store = MemoryStore()
    cid = put_update(store, ModelUpdate(weights(1.0), 1))
    async with await BlockClient.connect("127.0.0.1", server.port, key=KEY) as client:
        result = await client.push(store, cid)
        assert result.sent_blocks == result.offered
    assert server.store.has(cid)


async def test_a_plain_block_server_is_not_a_coordinator() -> None:
    plain = await BlockServer(MemoryStore()).start("127.0.0.1", 0)
    async with plain, await RoundClient.connect("127.0.0.1", plain.port, peer="a") as client:
        with pytest.raises(ProtocolViolation, match="not a tensorswap coordinator"):
            await client.status(RID)


@pytest.mark.timeout(120)
async def test_200_concurrent_peers_in_one_round(server: RoundServer) -> None:
    n = 200
    async with await connect(server, "lead") as lead:
        await lead.start_round(RID, RoundSpec(n))

        async def peer(i: int) -> None:
            async with await connect(server, f"peer-{i}") as client:
                await client.submit(RID, {"w": np.full(16, float(i), np.float32)}, 1)
                assert isinstance(await client.wait(RID, timeout=60), Complete)

        await asyncio.gather(*(peer(i) for i in range(n)))
        got = await lead.fetch_result(RID, timeout=30)
        np.testing.assert_allclose(got["w"], (n - 1) / 2, rtol=1e-6)
        assert server.coordinator.stats().contributions == n


async def test_blocking_client_with_torch_tensors(server: RoundServer) -> None:
    torch = pytest.importorskip("torch")
    from tensorswap.rounds.client import BlockingRoundClient

    def peer_loop(name: str, value: float) -> dict[str, np.ndarray]:
        with BlockingRoundClient("127.0.0.1", server.port, peer=name, key=KEY) as client:
            client.start_round(RID, RoundSpec(2))
            state = {"layer.weight": torch.full((3, 2), value), "layer.bias": torch.zeros(2)}
            client.submit(RID, state, num_samples=1)
            return client.fetch_result(RID, timeout=60)

    a, b = await asyncio.gather(
        asyncio.to_thread(peer_loop, "a", 1.0), asyncio.to_thread(peer_loop, "b", 3.0)
    )
    np.testing.assert_allclose(a["layer.weight"], 2.0)
    np.testing.assert_array_equal(a["layer.weight"], b["layer.weight"])


def test_the_round_server_passes_its_connection_cap_to_the_block_service() -> None:
    with Coordinator(MemoryStore(), run_timer=False) as coordinator:
        assert RoundServer(coordinator, max_connections=3).max_connections == 3
        with pytest.raises(ValueError, match="max_connections"):
            RoundServer(coordinator, max_connections=0)
