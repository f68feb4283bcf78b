"""Cut-through rounds under review: leaks, races and wasted bytes, driven without a network
(announce, ``on_stored`` and ``finish`` called as the block service and the intake call them)."""

from __future__ import annotations

import asyncio
import threading
from typing import Literal

import numpy as np

from helpers.cut import announce_all
from helpers.net import running
from tensorswap.cid import Cid, Multicodec
from tensorswap.rounds import Coordinator, FakeClock, RoundClient, RoundServer
from tensorswap.rounds.client._updates import children_first
from tensorswap.rounds.core import RoundId, RoundSpec
from tensorswap.rounds.core.state import Contribution
from tensorswap.rounds.engine import _cut_fold as cut_fold
from tensorswap.rounds.engine import cut as cut_module
from tensorswap.store import MemoryStore, ModelUpdate, manifest_closure, put_update
from tensorswap.swarm import SwarmPeer

RID = RoundId(1, "lead")
CHUNK = 64 * 1024


def coordinator(**kwargs: object) -> Coordinator:
    c = Coordinator(MemoryStore(), run_timer=False, **kwargs)  # type: ignore[arg-type]
    c.result_chunk_bytes = CHUNK
    return c


def prepared(
    peer: int, values: np.ndarray, compression: Literal["zstd"] | None = None
) -> tuple[MemoryStore, Cid, dict[Cid, bytes]]:
    """A peer's update in a store of its own: the store, its CID, its manifest blocks."""
    store = MemoryStore()
    update = ModelUpdate({"w": values}, 10 + peer)
    cid = put_update(store, update, chunk_bytes=CHUNK, compression=compression)
    manifests = {
        c: bytes(store.get(c))
        for c in children_first(store, cid)
        if c.codec is Multicodec.TENSORSWAP_MANIFEST
    }
    return store, cid, manifests


def chunks(store: MemoryStore, cid: Cid) -> list[Cid]:
    return [c for c in children_first(store, cid) if c.codec is not Multicodec.TENSORSWAP_MANIFEST]


def deliver(coord: Coordinator, source: MemoryStore, cid: Cid) -> None:
    """``cid`` stored at the coordinator and handed to its cut-through, as a sink does."""
    data = bytes(source.get(cid))
    coord.store.put_verified(cid, data)
    coord.cut.on_stored(cid, memoryview(data))


def push_all(coord: Coordinator, source: MemoryStore, root: Cid) -> None:
    for c in children_first(source, root):
        if c.codec is Multicodec.TENSORSWAP_MANIFEST:
            coord.store.put_verified(c, bytes(source.get(c)))
        else:
            deliver(coord, source, c)


def test_a_failed_round_leaves_no_index_entry_nor_held_bytes() -> None:
    rng = np.random.default_rng(0)
    with coordinator(clock=FakeClock()) as coord:
        coord.start_round(RID, RoundSpec(2, timeout_s=60))
        store, cid, manifests = prepared(0, rng.standard_normal(50_000, np.float32))
        assert coord.cut.announce(RID, "p0", cid, manifests).ok
        deliver(coord, store, chunks(store, cid)[0])  # one chunk in, the rest never
        assert coord.cut.stats()["cut_held_bytes"] > 0
        coord.fail_round(RID, "cancelled")
        assert coord.cut.stats()["cut_held_bytes"] == 0
        assert (
            coord.cut.stats()["cut_awaited_chunks"] == 0
        )  # the chunks that never came are not waited for


def test_held_bytes_count_what_is_held_whole_or_compressed() -> None:
    """Held values are counted in and out alike: an encoded block's header, or a compressed
    chunk's few bytes standing for many values, must not make the count drift."""
    rng = np.random.default_rng(4)
    for compression in (None, "zstd"):
        with coordinator() as coord:
            coord.start_round(RID, RoundSpec(2))
            peers = [
                prepared(i, np.full(50_000, i, np.float32) if compression
                         else rng.random(50_000, np.float32), compression)
                for i in range(2)
            ]  # fmt: skip
            for i, (_, cid, manifests) in enumerate(peers):
                assert coord.cut.announce(RID, f"p{i}", cid, manifests).ok
            store, cid, _ = peers[0]
            for c in chunks(store, cid):
                deliver(coord, store, c)
            assert 0 < coord.cut.stats()["cut_held_bytes"] <= 50_000 * 4  # p0's values
            coord.fail_round(RID, "cancelled")
            assert coord.cut.stats()["cut_held_bytes"] == 0, compression


def test_rounds_forgotten_for_newer_ones_leave_no_index_entry() -> None:
    rng = np.random.default_rng(1)
    with coordinator() as coord:
        values = rng.standard_normal(50_000, np.float32)
        for r in range(cut_module.ROUNDS_KEPT + 8):
            rid = RoundId(r + 1, "lead")
            coord.start_round(rid, RoundSpec(2))
            _, cid, manifests = prepared(r, values + r)
            assert coord.cut.announce(rid, "p0", cid, manifests).ok
        remembered, awaited = coord.cut.remembered()
        assert len(remembered) == cut_module.ROUNDS_KEPT
        assert awaited <= set(remembered)


def test_values_arriving_as_another_thread_folds_their_piece_are_not_held() -> None:
    """Peer a's chunk is marked present; before its values are kept, b's chunk arrives in
    another sink thread and folds the piece: a's values must not stay held."""
    rng = np.random.default_rng(2)
    with coordinator() as coord:
        coord.start_round(RID, RoundSpec(2))
        (sa, ca, ma), (sb, cb, mb) = (
            prepared(i, rng.standard_normal(10_000, np.float32)) for i in range(2)
        )
        assert coord.cut.announce(RID, "a", ca, ma).ok
        assert coord.cut.announce(RID, "b", cb, mb).ok
        (chunk_a,), (chunk_b,) = chunks(sa, ca), chunks(sb, cb)
        real = cut_module.count_nonfinite
        fired = []

        def count(values: np.ndarray) -> int:
            if not fired:  # the other sink thread, between a's two steps
                fired.append(True)
                other = threading.Thread(target=deliver, args=(coord, sb, chunk_b))
                other.start()
                other.join()
            return real(values)

        cut_module.count_nonfinite = count  # type: ignore[assignment]
        try:
            deliver(coord, sa, chunk_a)
        finally:
            cut_module.count_nonfinite = real
        assert coord.cut.folded == 1
        assert coord.cut.stats()["cut_held_bytes"] == 0


def test_finish_waits_for_a_piece_another_thread_is_folding() -> None:
    """A piece claimed by a sink thread that is still folding it when the round aggregates:
    the round must not fall back to the barrier (and its streams be told so) for it."""
    rng = np.random.default_rng(3)
    with coordinator() as coord:
        coord.start_round(RID, RoundSpec(2))
        peers = [prepared(i, rng.standard_normal(40_000, np.float32)) for i in range(2)]
        for i, (_, cid, manifests) in enumerate(peers):
            assert coord.cut.announce(RID, f"p{i}", cid, manifests).ok
        (sa, ca, _), (sb, cb, _) = peers
        push_all(coord, sa, ca)
        first, *rest = chunks(sb, cb)
        for c in rest:
            deliver(coord, sb, c)
        real = cut_fold.put_chunk_block
        folding, go = threading.Event(), threading.Event()

        def slow_put(store: object, piece: np.ndarray) -> object:
            folding.set()
            assert go.wait(30)
            return real(store, piece)  # type: ignore[arg-type]

        rc = coord.cut._rounds[RID]
        if hasattr(rc, "settled"):  # finish waiting lets the fold go on
            waits = rc.settled.wait

            def wait(timeout: float | None = None) -> bool:
                go.set()
                return waits(timeout)

            rc.settled.wait = wait  # type: ignore[method-assign]
        cut_fold.put_chunk_block = slow_put  # type: ignore[assignment]
        sink = threading.Thread(target=deliver, args=(coord, sb, first))
        try:
            sink.start()
            assert folding.wait(30)
            cut_fold.put_chunk_block = real
            live = [
                Contribution(RID, f"p{i}", str(cid), 10 + i, 0, 0.0)
                for i, (_, cid, _) in enumerate(peers)
            ]
            done = coord.cut.finish(coord.tracker.info(RID), live, {})
        finally:
            go.set()
            cut_fold.put_chunk_block = real
            sink.join()
        assert done is not None
        assert coord.cut.state(RID) == (rc.progress, None)  # not abandoned
        assert (
            coord.cut.stats()["cut_held_bytes"] == 0
            and coord.cut.stats()["cut_awaited_chunks"] == 0
        )


async def test_the_stream_does_not_send_a_peer_the_chunks_of_its_own_update() -> None:
    """A frozen layer's pieces are the very blocks every peer pushed: streaming them back
    to each peer doubles its download of them for nothing."""
    rng = np.random.default_rng(5)
    frozen = rng.standard_normal(200_000, np.float32)  # 13 pieces every peer shares
    values = [{"frozen": frozen, "w": rng.standard_normal(20_000, np.float32)} for _ in range(2)]
    with coordinator() as coord:
        server = RoundServer(coord)
        async with running(server):
            clients = [
                await RoundClient.connect("127.0.0.1", server.port, peer=f"p{i}") for i in range(2)
            ]
            try:
                await clients[0].start_round(RID, RoundSpec(2))
                await announce_all(clients, RID, values, [1, 1], CHUNK)
                submitted = await asyncio.gather(
                    *(c.submit(RID, v, 1) for c, v in zip(clients, values, strict=True))
                )
                results = [await c.fetch_result(RID, timeout=30) for c in clients]
            finally:
                for client in clients:
                    await client.aclose()
        assert coord.cut.folded == 13 + 2
        result = Cid.parse(coord.status(RID).cid)  # type: ignore[union-attr]
    for client, sent, got in zip(clients, submitted, results, strict=True):
        np.testing.assert_array_equal(got["frozen"], frozen)
        own = set(manifest_closure(client.store, sent.cid))
        lacked = set(manifest_closure(client.store, result)) - own
        assert len(lacked) == 4  # w's 2 pieces, its manifest and the update's
        assert client.cut.streamed == len(lacked)  # each once, and nothing it pushed


async def test_a_swarm_peer_turns_the_stream_off_on_its_client() -> None:
    """A SwarmPeer fetches the result from peers: its client must not also stream it whole
    from the coordinator (nor have it pushed behind a waited submit) in its next rounds."""
    rng = np.random.default_rng(6)
    with coordinator() as coord:
        server = RoundServer(coord)
        async with running(server):
            clients = [
                await RoundClient.connect("127.0.0.1", server.port, peer=f"p{i}") for i in range(2)
            ]
            try:
                for r in (1, 2):
                    rid = RoundId(r, "lead")
                    await clients[0].start_round(rid, RoundSpec(2))
                    values = [rng.standard_normal(40_000, np.float32) for _ in clients]
                    await asyncio.gather(
                        *(c.submit(rid, {"w": v}, 1) for c, v in zip(clients, values, strict=True))
                    )
                    if r == 2:
                        assert not any(c.cut.streaming(rid) for c in clients)
                        before = [c.cut.streamed for c in clients]
                    for client in clients:
                        async with SwarmPeer(client.store, peer=client.peer, serve=False) as peer:
                            got = await peer.fetch_result(client, rid, timeout=30)
                        np.testing.assert_allclose(got["w"], (values[0] + values[1]) / 2, 1e-5)
                assert [c.cut.streamed for c in clients] == before
                assert all(not c.push_results for c in clients)
            finally:
                for client in clients:
                    await client.aclose()
