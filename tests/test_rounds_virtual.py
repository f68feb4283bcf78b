"""VirtualClients: many peers over a few connections, batched submits, per-peer keys; the
paged status ops."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from helpers.net import running
from tensorswap.rounds.client import PeerSubmit, RoundClient, VirtualClients
from tensorswap.rounds.core import (
    Collecting,
    Complete,
    DuplicateContribution,
    PeerNotAuthorised,
    RoundId,
    RoundNotFound,
    RoundSpec,
)
from tensorswap.rounds.engine import Coordinator
from tensorswap.rounds.journal import RoundDatabase
from tensorswap.rounds.protocol import page_peers, page_rounds
from tensorswap.rounds.protocol.batch import (
    MAX_BATCH,
    BatchItem,
    BatchSubmitRequest,
    PeerKeys,
    submit_proof,
)
from tensorswap.rounds.server import RoundServer

RID = RoundId(5, "sim")
KEY = b"virtual-test-key"
PEER_KEYS = {f"p{i}": bytes([i + 1]) * 16 for i in range(4)}


def tiny(value: float) -> dict[str, np.ndarray]:
    return {"w": np.full(4, value, np.float32)}


@pytest.fixture
async def coord(tmp_path: Path) -> AsyncIterator[Coordinator]:
    with Coordinator.open(tmp_path, run_timer=False) as coordinator:
        yield coordinator


async def test_concurrent_virtual_peers_are_coalesced_into_one_request(coord: Coordinator) -> None:
    async with running(RoundServer(coord, key=KEY)) as server:
        pool = await VirtualClients.connect("127.0.0.1", server.port, connections=2, key=KEY)
        async with pool:
            await pool.clients[0].start_round(RID, RoundSpec(8))
            peers = [pool.peer(f"v{i}") for i in range(8)]
            requests = server.stats.requests
            statuses = await asyncio.gather(
                *(p.submit(RID, tiny(float(i)), i + 1) for i, p in enumerate(peers))
            )
            assert server.stats.requests - requests == 1  # eight submits, one submit_batch
            assert all(isinstance(s, Collecting) for s in statuses)
            assert isinstance(await peers[0].wait(RID, timeout=30), Complete)
            result = await pool.fetch_result(RID, timeout=30)
        expected = sum(float(i) * (i + 1) for i in range(8)) / sum(range(1, 9))
        np.testing.assert_allclose(result["w"], expected, rtol=1e-6)
        assert sorted(c.peer for c in coord.contributions(RID)) == sorted(f"v{i}" for i in range(8))


async def test_submit_many_answers_each_item_on_its_own(coord: Coordinator) -> None:
    async with (
        running(RoundServer(coord, key=KEY)) as server,
        await VirtualClients.connect("127.0.0.1", server.port, key=KEY) as pool,
    ):
        await pool.clients[0].start_round(RID, RoundSpec(10))
        items = [PeerSubmit(f"v{i}", tiny(1.0), 1) for i in range(3)]
        items.append(PeerSubmit("v0", tiny(2.0), 1))  # the same peer again
        outcomes = await pool.submit_many(RID, items, batch=2)
        assert [type(o) for o in outcomes] == [
            Collecting,
            Collecting,
            Collecting,
            DuplicateContribution,
        ]
        gone = await pool.submit_many(RoundId(99, "nobody"), items[:1])
        assert isinstance(gone[0], RoundNotFound)
        assert isinstance(coord.journal, RoundDatabase)


async def test_with_peer_keys_each_peer_proves_its_own_key(coord: Coordinator) -> None:
    async with running(RoundServer(coord, key=KEY, peer_keys=PEER_KEYS)) as server:
        async with await VirtualClients.connect(
            "127.0.0.1", server.port, key=KEY, keys={"p0": PEER_KEYS["p0"], "p1": b"wrong"}
        ) as pool:
            await pool.clients[0].start_round(RID, RoundSpec(4))
            assert isinstance(await pool.peer("p0").submit(RID, tiny(1.0), 1), Collecting)
            with pytest.raises(PeerNotAuthorised, match="does not verify"):
                await pool.peer("p1").submit(RID, tiny(1.0), 1)
            with pytest.raises(PeerNotAuthorised, match="no proof"):
                await pool.peer("p2").submit(RID, tiny(1.0), 1)  # no key given here
            with pytest.raises(PeerNotAuthorised, match="no key for it"):
                await pool.peer("stranger", b"k" * 16).submit(RID, tiny(1.0), 1)
            # a peer's own key, given to the pool as it joins
            assert isinstance(
                await pool.peer("p3", PEER_KEYS["p3"]).submit(RID, tiny(2.0), 1), Collecting
            )
        # the plain submit op carries no proof: refused, and the connection goes on
        async with await RoundClient.connect("127.0.0.1", server.port, peer="p2", key=KEY) as plain:
            plain.inline = False
            with pytest.raises(PeerNotAuthorised, match="only proven submits"):
                await plain.submit(RID, tiny(3.0), 1)
            assert await plain.status(RID) == Collecting(2, 4)
        # an inline submit carries the proof of the client's peer_key, when it has one
        async with await RoundClient.connect("127.0.0.1", server.port, peer="p2", key=KEY) as bare:
            with pytest.raises(PeerNotAuthorised, match="no proof"):
                await bare.submit(RID, tiny(3.0), 1)
        async with await RoundClient.connect(
            "127.0.0.1", server.port, peer="p2", key=KEY, peer_key=PEER_KEYS["p2"]
        ) as proven:
            assert await proven.submit(RID, tiny(3.0), 1) is not None
            assert await proven.status(RID) == Collecting(3, 4)
    assert sorted(c.peer for c in coord.contributions(RID)) == ["p0", "p2", "p3"]


def test_a_proof_names_one_contribution() -> None:
    from tensorswap.cid import Cid

    one, other = Cid.of(b"one"), Cid.of(b"other")
    key = PEER_KEYS["p0"]
    proof = submit_proof(key, RID, "p0", one)
    keys = PeerKeys(PEER_KEYS)
    keys.check(RID, "p0", one, proof)
    for rid, peer, cid in ((RID, "p0", other), (RoundId(6, "sim"), "p0", one), (RID, "p1", one)):
        with pytest.raises(PeerNotAuthorised):
            keys.check(rid, peer, cid, proof)


def test_peer_keys_load_and_refuse_bad_lines(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# peers\np0 0a0b\n\np1 ff\n")
    assert dict(PeerKeys.load(path)) == {"p0": b"\x0a\x0b", "p1": b"\xff"}
    path.write_text("p0 not-hex\n")
    with pytest.raises(ValueError, match=":1:"):
        PeerKeys.load(path)


def test_a_batch_request_is_bounded_when_built_or_decoded() -> None:
    from tensorswap.cid import Cid

    cid = Cid.of(b"x").to_bytes()
    with pytest.raises(ValueError, match="items"):
        BatchSubmitRequest(round=1, initiator="a", items=[])
    with pytest.raises(ValueError, match="items"):
        BatchSubmitRequest(round=1, initiator="a", items=[BatchItem("p", cid)] * (MAX_BATCH + 1))
    with pytest.raises(ValueError, match="proof"):
        BatchSubmitRequest(round=1, initiator="a", items=[BatchItem("p", cid, b"short")])
    with pytest.raises(ValueError, match="CID"):
        BatchSubmitRequest(round=1, initiator="a", items=[BatchItem("p", b"junk")])


async def test_status_pages_rounds_and_peers(coord: Coordinator) -> None:
    async with (
        running(RoundServer(coord, key=KEY)) as server,
        await VirtualClients.connect("127.0.0.1", server.port, key=KEY) as pool,
    ):
        for n in range(1, 4):
            await pool.clients[0].start_round(RoundId(n, "sim"), RoundSpec(50))
        items = [PeerSubmit(f"v{i:02}", tiny(1.0), 1) for i in range(25)]
        await pool.submit_many(RoundId(2, "sim"), items)
        client = pool.reader
        first = await page_rounds(client, 0, 2, peers=3, stats=True)
        assert (first.total, first.next) == (3, 2)
        assert [(r.round, r.received, r.peers) for r in first.rounds] == [
            (1, 0, []),
            (2, 25, ["v00", "v01", "v02"]),
        ]
        assert first.stats["contributions"] == 25
        last = await page_rounds(client, first.next or 0, 2)
        assert ([r.round for r in last.rounds], last.next) == ([3], None)
        names: list[str] = []
        start: int | None = 0
        while start is not None:
            page = await page_peers(client, RoundId(2, "sim"), start, 10)
            assert page.total == 25
            names += page.peers
            start = page.next
        assert names == [f"v{i:02}" for i in range(25)]  # acceptance order
        with pytest.raises(RoundNotFound):
            await page_peers(client, RoundId(9, "sim"))


async def test_virtual_peers_register_for_runs_under_their_own_names(tmp_path: Path) -> None:
    from tensorswap.runs import RunManager
    from tensorswap.runs.client import RunClient
    from tensorswap.runs.service import RunService

    with Coordinator.open(tmp_path, run_timer=False, durable=False) as coord:
        runs = RunManager.open(coord, durable=False)
        try:
            server = RoundServer(coord, key=KEY)
            RunService(runs, server)
            async with (
                running(server),
                await VirtualClients.connect(
                    "127.0.0.1", server.port, connections=2, key=KEY
                ) as pool,
            ):
                names = [f"site-{i}" for i in range(5)]
                for i, name in enumerate(names):
                    await RunClient(pool.client_for(name, i % 2)).register({"num_samples": i})
            assert sorted(runs.registry.active()) == names
        finally:
            runs.close()
