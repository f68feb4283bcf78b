"""Sender-side pacing of cut-through uploads (rounds.client._cut_gate): a peer's chunk waits
while the peer is too far ahead of the pieces its result stream brought back."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from helpers.net import running
from tensorswap.cid import Cid, Multicodec
from tensorswap.rounds import Coordinator, RoundClient, RoundServer
from tensorswap.rounds.client._cut_gate import MIN_LEAD, UploadGate
from tensorswap.rounds.client._updates import children_first
from tensorswap.rounds.core import Complete, RoundId, RoundSpec
from tensorswap.store import MemoryStore, ModelUpdate, put_update

KiB = 1024
RID = RoundId(1, "lead")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def gate_of(chunks: int, chunk: int, lead: int, clock: Clock | None = None) -> UploadGate:
    positions = {Cid.of(bytes([i])): i for i in range(chunks)}
    starts = tuple(i * chunk for i in range(chunks + 1))
    gate = UploadGate(positions, starts, lead_bytes=lead, clock=clock or Clock())
    gate.arm()
    return gate


def test_a_chunk_within_the_lead_goes_and_one_beyond_waits() -> None:
    gate = gate_of(8, 512 * KiB, 1024 * KiB)
    assert gate.due(0) is None and gate.due(1) is None  # MIN_LEAD chunks always go
    assert gate.due(2) is not None  # 1 MiB past the pieces streamed (none yet)
    gate.progressed(1)
    assert gate.due(2) is None and gate.due(3) is not None
    big = gate_of(8, 8 * 1024 * KiB, 1024 * KiB)  # chunks larger than the lead
    assert big.due(MIN_LEAD - 1) is None and big.due(MIN_LEAD) is not None


def test_nothing_is_paced_before_every_peer_announced_or_after_the_stream_ended() -> None:
    positions = {Cid.of(bytes([i])): i for i in range(8)}
    gate = UploadGate(positions, tuple(range(0, 9 * KiB, KiB)), lead_bytes=1)
    assert gate.due(7) is None  # not armed: a peer that is early does not wait for the late
    gate.arm()
    assert gate.due(7) is not None
    gate.close()
    assert gate.due(7) is None


def test_a_waiting_chunk_goes_when_the_stream_brings_a_piece() -> None:
    async def main() -> None:
        gate = gate_of(8, 512 * KiB, 1024 * KiB)
        waiting = asyncio.ensure_future(gate.before(Cid.of(bytes([3]))))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not waiting.done()
        gate.progressed(1)  # 3 - 1 = 2 chunks ahead, 1 MiB: still too far
        for _ in range(5):
            await asyncio.sleep(0)
        assert not waiting.done()
        gate.progressed(2)
        await asyncio.wait_for(waiting, 5)
        assert gate.waits == 1
        await gate.before(Cid.of(b"not one of the update's chunks"))  # goes at once
        closed = asyncio.ensure_future(gate.before(Cid.of(bytes([7]))))
        await asyncio.sleep(0)
        gate.close()  # the stream ended: the round went to the barrier, or finished
        await asyncio.wait_for(closed, 5)

    asyncio.run(main())


def test_pacing_is_given_up_after_no_piece_for_its_patience() -> None:
    clock = Clock()
    gate = gate_of(16, 512 * KiB, 1024 * KiB, clock)
    assert gate.due(4) == pytest.approx(1.0)  # min_patience from the first wait
    clock.now = 0.5
    assert gate.due(4) == pytest.approx(0.5)
    gate.progressed(1)  # a piece after 0.5 s (the first gap is counted from the first wait)
    clock.now = 3.5
    gate.progressed(2)  # a gap of 3 s: patience now 12 s
    clock.now = 15.0
    assert gate.due(8) == pytest.approx(0.5)
    clock.now = 15.5
    assert gate.due(8) is None
    assert gate.given_up and not gate.on
    assert gate.due(15) is None  # for the rest of the round


def test_the_gate_of_an_update_counts_its_chunks_in_push_order() -> None:
    store = MemoryStore()
    rng = np.random.default_rng(1)
    values = {"a": rng.standard_normal(40_000, np.float32), "b": rng.random(7, np.float32)}
    cid = put_update(store, ModelUpdate(values, 3), chunk_bytes=64 * KiB)
    gate = UploadGate.of(store, cid)
    chunks = [
        c for c in children_first(store, cid) if c.codec is not Multicodec.TENSORSWAP_MANIFEST
    ]
    assert [gate.positions[c] for c in chunks] == list(range(len(chunks)))
    assert gate.starts[-1] == sum(store.get(c).nbytes for c in chunks)  # block lengths
    assert len(gate.starts) == len(chunks) + 1


async def test_a_peer_ahead_waits_for_the_others_and_the_round_keeps_its_bits() -> None:
    chunk = 64 * KiB
    rng = np.random.default_rng(3)
    values = [{"w": rng.standard_normal(100_000, np.float32)} for _ in range(2)]
    results = {}
    for paced in (True, False):
        coord = Coordinator(MemoryStore(), run_timer=False)
        coord.result_chunk_bytes = chunk
        async with running(RoundServer(coord)) as server:
            a = await RoundClient.connect("127.0.0.1", server.port, peer="a")
            b = await RoundClient.connect("127.0.0.1", server.port, peer="b")
            try:
                for client in (a, b):
                    client.cut.chunk_bytes = chunk
                    client.cut.lead_bytes = chunk if paced else None
                await a.start_round(RID, RoundSpec(2))
                cids = []
                for client, v, n in zip((a, b), values, (3, 5), strict=True):
                    cid = put_update(client.store, ModelUpdate(dict(v), n), chunk_bytes=chunk)
                    cids.append(await client.cut.begin(RID, cid, None))
                gate = a.cut.gate(RID)
                if paced:
                    assert gate is not None
                    async with asyncio.timeout(10):  # a's stream hears both announced
                        while not gate.armed:
                            await asyncio.sleep(0.005)
                else:
                    assert gate is None
                # a pushes alone first: with pacing it stops MIN_LEAD chunks in, since no
                # piece folds before b's chunks come
                ahead = asyncio.ensure_future(a.submit(RID, cids[0], wait=30))
                if gate is not None:
                    async with asyncio.timeout(10):
                        while gate.waits == 0:
                            await asyncio.sleep(0.005)
                    assert not ahead.done()
                await b.submit(RID, cids[1], wait=30)
                status = (await ahead).status
                assert isinstance(status, Complete)
                got = [await c.fetch_result(RID, timeout=30) for c in (a, b)]
                np.testing.assert_array_equal(got[0]["w"], got[1]["w"])
                results[paced] = (status.cid, got[0]["w"])
                if paced:
                    assert a.cut.paced_waits >= 1  # counted once the round was taken
                    assert not gate.on  # the stream ended with the round
            finally:
                await a.aclose()
                await b.aclose()
    assert results[True][0] == results[False][0]  # the same bits, paced or not
    want = (3 * values[0]["w"].astype(np.float64) + 5 * values[1]["w"]) / 8
    np.testing.assert_allclose(results[True][1], want, rtol=1e-5, atol=1e-6)
