"""Cut-through rounds: pieces folded as they arrive, the result streamed while peers upload."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from helpers.cut import announce_all
from helpers.net import running
from tensorswap.cid import Cid
from tensorswap.rounds import Coordinator, FakeClock, RoundClient, RoundServer
from tensorswap.rounds.core import Complete, RoundId, RoundSpec
from tensorswap.rounds.engine.hooks import CoordinatorHooks
from tensorswap.rounds.protocol.cut import (
    APP_ANNOUNCE,
    APP_STREAM,
    AnnounceRequest,
    StreamAnswer,
    StreamRequest,
    decode_stream_answer,
    encode,
)
from tensorswap.store import (
    DEFAULT_CHUNK_BYTES,
    MemoryStore,
    ModelUpdate,
    manifest_closure,
    put_update,
)
from tensorswap.wire import RemoteError

RID = RoundId(1, "lead")
CHUNK = 64 * 1024  # the coordinator's result chunks: 16 Ki floats, several per tensor
SIZE = 100_000


def inputs(peers: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    frozen = rng.standard_normal(20_000, np.float32)
    return [
        {
            "w": rng.standard_normal(SIZE, np.float32),
            "frozen": frozen,
            "b": rng.random(7, np.float32),
        }
        for _ in range(peers)
    ]


def fedavg(
    values: Sequence[dict[str, np.ndarray]], weights: Sequence[int]
) -> dict[str, np.ndarray]:
    total = sum(weights)
    return {
        k: sum(w * v[k].astype(np.float64) for v, w in zip(values, weights, strict=True)) / total
        for k in values[0]
    }


async def run_round(
    coordinator: Coordinator,
    values: Sequence[dict[str, np.ndarray]],
    *,
    spec: RoundSpec,
    cut: bool = True,
    submitting: int | None = None,
) -> tuple[str, list[dict[str, np.ndarray]], list[RoundClient]]:
    """Every peer submits (the first ``submitting`` of them) and fetches; the result's CID,
    what each fetched, and the clients (closed)."""
    server = RoundServer(coordinator)
    async with running(server):
        clients = [
            await RoundClient.connect("127.0.0.1", server.port, peer=f"p{i}")
            for i in range(len(values))
        ]
        for client in clients:
            client.cut.enabled = cut
        try:
            await clients[0].start_round(RID, spec)
            count = len(values) if submitting is None else submitting
            if cut:
                samples = [10 + i for i in range(count)]
                await announce_all(clients[:count], RID, values[:count], samples, CHUNK)
            await asyncio.gather(
                *(
                    c.submit(RID, v, 10 + i)
                    for i, (c, v) in enumerate(zip(clients, values, strict=True))
                    if i < count
                )
            )
            results = await asyncio.gather(
                *(c.fetch_result(RID, timeout=30) for c in clients[:count])
            )
        finally:
            for client in clients:
                await client.aclose()
    status = coordinator.status(RID)
    assert isinstance(status, Complete)
    return status.cid, list(results), clients


def coordinator(**kwargs: object) -> Coordinator:
    c = Coordinator(MemoryStore(), **kwargs)  # type: ignore[arg-type]
    c.result_chunk_bytes = CHUNK
    return c


@pytest.mark.parametrize("deterministic", [True, False])
async def test_a_cut_through_round_gives_the_deterministic_barrier_bits(
    deterministic: bool,
) -> None:
    values = inputs(4)
    with coordinator() as cut_coord, coordinator() as barrier_coord:
        spec = RoundSpec(4, deterministic=deterministic)
        cid, results, clients = await run_round(cut_coord, values, spec=spec)
        barrier_cid, _, _ = await run_round(
            barrier_coord, values, spec=RoundSpec(4, deterministic=True), cut=False
        )
        pieces = sum(-(-n * 4 // CHUNK) for n in (SIZE, 20_000, 7))  # w's, frozen's, b's
        assert cut_coord.cut.folded == pieces
        assert barrier_coord.cut.folded == 0
    # folded piece by piece in peer-name order: a deterministic barrier round's bits
    assert cid == barrier_cid
    want = fedavg(values, [10, 11, 12, 13])
    for result in results:
        np.testing.assert_allclose(result["w"], want["w"], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(result["frozen"], values[0]["frozen"])  # its own bits
        np.testing.assert_array_equal(result["w"], results[0]["w"])
    assert all(client.cut.streamed > 0 for client in clients)  # came by the stream


async def test_a_peer_that_announces_and_never_submits_sends_the_round_to_the_barrier() -> None:
    values = inputs(4, seed=1)
    clock = FakeClock()
    with coordinator(clock=clock, run_timer=False) as cut_coord:
        spec = RoundSpec(4, quorum=3, timeout_s=60, deterministic=True)
        server = RoundServer(cut_coord)
        async with running(server):
            clients = [
                await RoundClient.connect("127.0.0.1", server.port, peer=f"p{i}") for i in range(4)
            ]
            try:
                await clients[0].start_round(RID, spec)
                # p3 announces its update, then goes away before it pushes a chunk
                gone = clients[3]
                cid = put_update(gone.store, ModelUpdate(values[3], 13), chunk_bytes=CHUNK)
                assert await gone.cut.begin(RID, cid, None) == cid
                assert gone.cut.streaming(RID)
                await announce_all(clients[:3], RID, values[:3], [10, 11, 12], CHUNK)
                await asyncio.gather(
                    *(
                        c.submit(RID, v, 10 + i)
                        for i, (c, v) in enumerate(zip(clients[:3], values[:3], strict=True))
                    )
                )
                # p3's chunks never came, but for the frozen ones every peer shares
                assert cut_coord.cut.folded == 2
                clock.advance(61)
                assert cut_coord.check_deadlines() == [RID]
                results = await asyncio.gather(
                    *(c.fetch_result(RID, timeout=30) for c in clients[:3])
                )
            finally:
                for client in clients:
                    await client.aclose()
        status = cut_coord.status(RID)
        assert isinstance(status, Complete)
    with coordinator() as barrier_coord:
        barrier_cid, _, _ = await run_round(
            barrier_coord, values[:3], spec=RoundSpec(3, deterministic=True), cut=False
        )
    assert status.cid == barrier_cid  # the survivors' mean, the same bits as a barrier's
    want = fedavg(values[:3], [10, 11, 12])
    for result in results:
        np.testing.assert_allclose(result["w"], want["w"], rtol=1e-5, atol=1e-6)


async def test_an_update_cut_otherwise_is_cut_again_to_take_part() -> None:
    values = inputs(2, seed=2)
    with coordinator() as coord:
        server = RoundServer(coord)
        async with running(server):
            a = await RoundClient.connect("127.0.0.1", server.port, peer="a")
            b = await RoundClient.connect("127.0.0.1", server.port, peer="b")
            async with a, b:
                await a.start_round(RID, RoundSpec(2))
                for client, v in ((a, values[0]), (b, values[1])):
                    update = ModelUpdate(v, 1)
                    cid = put_update(client.store, update)  # the default 4 MiB chunks
                    assert await client.cut.begin(RID, cid, update) != cid  # cut again
                    assert client.cut.chunk_bytes == CHUNK  # learned for later rounds
                await asyncio.gather(a.submit(RID, values[0], 1), b.submit(RID, values[1], 1))
                result = await a.fetch_result(RID, timeout=30)
        assert coord.cut.folded > 0
    want = fedavg(values, [1, 1])["w"]
    np.testing.assert_allclose(result["w"], want, rtol=1e-5, atol=1e-6)


async def test_a_fresh_client_cuts_as_the_welcome_says_and_announces_once() -> None:
    values = inputs(2, seed=4)
    with coordinator() as coord:
        async with running(RoundServer(coord)) as server:
            a = await RoundClient.connect("127.0.0.1", server.port, peer="a")
            b = await RoundClient.connect("127.0.0.1", server.port, peer="b")
            async with a, b:
                assert a.blocks.welcome.chunk_bytes == CHUNK
                assert a.cut.chunk_bytes == b.cut.chunk_bytes == CHUNK  # before any round
                await a.start_round(RID, RoundSpec(2))
                submitted = await asyncio.gather(
                    a.submit(RID, values[0], 1), b.submit(RID, values[1], 1)
                )
                result = await a.fetch_result(RID, timeout=30)
            # the updates were cut once, in the coordinator's chunks: no second cut
            for v, done in zip(values, submitted, strict=True):
                once = put_update(MemoryStore(), ModelUpdate(v, 1), chunk_bytes=CHUNK)
                assert done.cid == once
            coord.result_chunk_bytes = 1  # a size out of bounds is not taken
            async with await RoundClient.connect("127.0.0.1", server.port, peer="c") as c:
                assert c.blocks.welcome.chunk_bytes == 1
                assert c.cut.chunk_bytes == DEFAULT_CHUNK_BYTES
        assert coord.cut.folded > 0
    np.testing.assert_allclose(result["w"], fedavg(values, [1, 1])["w"], rtol=1e-5, atol=1e-6)


class Noising(CoordinatorHooks):
    """A hook that releases something else (as DP does): its rounds must not stream."""

    def release(self, round_id: RoundId, aggregate: Cid) -> Cid:
        return aggregate


async def test_a_round_whose_release_a_hook_transforms_is_not_streamed() -> None:
    values = inputs(2, seed=3)
    with coordinator(hooks=[Noising()]) as coord:
        _, results, clients = await run_round(coord, values, spec=RoundSpec(2))
        assert coord.cut.folded == 0
        assert all(client.cut.streamed == 0 for client in clients)
        want = fedavg(values, [10, 11])["w"]
        np.testing.assert_allclose(results[1]["w"], want, rtol=1e-5, atol=1e-6)


async def test_a_non_finite_update_is_refused_without_being_read_back() -> None:
    values = inputs(2, seed=4)
    values[1]["w"][5] = np.nan
    with coordinator() as coord:
        server = RoundServer(coord)
        async with running(server):
            a = await RoundClient.connect("127.0.0.1", server.port, peer="a")
            b = await RoundClient.connect("127.0.0.1", server.port, peer="b")
            async with a, b:
                await a.start_round(RID, RoundSpec(2))
                await a.submit(RID, values[0], 1)
                with pytest.raises(Exception, match="non-finite"):
                    await b.submit(RID, values[1], 1)
                stats = (await a.server_status()).stats  # the cut-through's own counters
                assert stats["cut_rounds"] == 1 and stats["cut_held_bytes"] == 0
        assert coord.status(RID).name == "Collecting"  # nothing of b's recorded
        state = coord.cut.state(RID)
        assert state is not None and state[1] is not None  # abandoned: a barrier now


async def test_an_announcement_whose_manifest_does_not_hash_ends_the_connection() -> None:
    with coordinator() as coord:
        server = RoundServer(coord)
        async with (
            running(server),
            await RoundClient.connect("127.0.0.1", server.port, peer="a") as a,
        ):
            await a.start_round(RID, RoundSpec(2))
            cid = put_update(a.store, ModelUpdate({"w": np.ones(10, np.float32)}, 1))
            root = bytes(a.store.get(cid))
            forged = root[:-1] + bytes([root[-1] ^ 1])
            call = AnnounceRequest(
                    round=RID.round, initiator=RID.initiator, peer="a", update=cid.to_bytes(),
                    blocks=[(cid.to_bytes(), forged)],
                )  # fmt: skip
            with pytest.raises(RemoteError):
                await a.blocks.request(APP_ANNOUNCE, encode(call))
        assert coord.cut.state(RID) is None  # nothing taken


async def test_a_coordinator_without_cut_through_turns_it_off_on_the_client() -> None:
    values = inputs(2, seed=5)
    with coordinator() as coord:
        server = RoundServer(coord)
        for app in ("rounds/announce", "rounds/stream"):
            del server.blocks.handlers[app]  # as one from before cut-through
        async with running(server):
            a = await RoundClient.connect("127.0.0.1", server.port, peer="a")
            b = await RoundClient.connect("127.0.0.1", server.port, peer="b")
            async with a, b:
                await a.start_round(RID, RoundSpec(2))
                await asyncio.gather(a.submit(RID, values[0], 1), b.submit(RID, values[1], 1))
                result = await a.fetch_result(RID, timeout=30)
                assert not a.cut.enabled and not b.cut.enabled
        np.testing.assert_allclose(result["w"], fedavg(values, [1, 1])["w"], rtol=1e-5, atol=1e-6)


async def test_the_result_streamed_is_the_one_fetched_and_held_by_retention() -> None:
    values = inputs(3, seed=6)
    with coordinator() as coord:
        cid, _, clients = await run_round(coord, values, spec=RoundSpec(3))
    for client in clients:
        closure = manifest_closure(client.store, Cid.parse(cid))
        assert not client.store.missing(closure)
        assert client.retention is not None and RID in client.retention.held_rounds


async def test_a_restart_between_any_two_submits_keeps_the_cut_through_bits(tmp_path: Path) -> None:
    """The round becomes deterministic (journaled) once every peer has announced, so the
    barrier that finishes it after a restart folds by peer name too: the same bits."""
    values = inputs(4, seed=7)
    with coordinator() as plain:
        want, _, _ = await run_round(plain, values, spec=RoundSpec(4))
    for cut_after in range(5):  # the coordinator dies after 0..4 submits
        path = tmp_path / f"c{cut_after}"
        first = Coordinator.open(path)
        first.result_chunk_bytes = CHUNK
        clients: list[RoundClient] = []
        try:
            async with running(RoundServer(first)) as server:
                clients = [
                    await RoundClient.connect("127.0.0.1", server.port, peer=f"p{i}")
                    for i in range(4)
                ]
                await clients[0].start_round(RID, RoundSpec(4))
                await announce_all(clients, RID, values, [10, 11, 12, 13], CHUNK)
                for i in reversed(range(4 - cut_after, 4)):  # submitted last name first
                    await clients[i].submit(RID, values[i], 10 + i)
        finally:
            for client in clients:
                await client.aclose()
            first.close()
        second = Coordinator.open(path)
        second.result_chunk_bytes = CHUNK
        try:
            assert second.info(RID).spec.deterministic  # journaled with the round
            async with running(RoundServer(second)) as server:
                for i in reversed(range(4 - cut_after)):
                    async with await RoundClient.connect(
                        "127.0.0.1", server.port, peer=f"p{i}"
                    ) as c:
                        await c.submit(RID, values[i], 10 + i)
                status = second.wait(RID, timeout=30)
        finally:
            second.close()
        assert isinstance(status, Complete)
        assert status.cid == want, f"after {cut_after} submits"


@pytest.mark.parametrize("restart", [False, True])
async def test_a_submit_before_the_last_announcement_leaves_the_round_as_started(
    tmp_path: Path, restart: bool
) -> None:
    """p0 uploads and submits before p1 announces: the round is not cut through and stays
    as it was started (not deterministic: a round that takes regions' partials must not
    change); restarted in between or not, the CID is a plain barrier round's."""
    values = inputs(2, seed=8)
    with coordinator() as plain:
        want, _, _ = await run_round(plain, values, spec=RoundSpec(2), cut=False)
    path = tmp_path / "c"
    coord = Coordinator.open(path)
    coord.result_chunk_bytes = CHUNK
    try:
        async with running(RoundServer(coord)) as server:
            p0 = await RoundClient.connect("127.0.0.1", server.port, peer="p0")
            async with p0:
                p0.cut.chunk_bytes = CHUNK
                await p0.start_round(RID, RoundSpec(2))
                await p0.submit(RID, values[0], 10)  # p1 has not announced yet
        if restart:
            coord.close()
            coord = Coordinator.open(path)
            coord.result_chunk_bytes = CHUNK
        async with running(RoundServer(coord)) as server:
            p1 = await RoundClient.connect("127.0.0.1", server.port, peer="p1")
            async with p1:
                await p1.submit(RID, values[1], 11)
                result = await p1.fetch_result(RID, timeout=30)
        status = coord.status(RID)
        assert isinstance(status, Complete) and status.cid == want
        assert not coord.info(RID).spec.deterministic
        assert coord.cut.folded == 0
    finally:
        coord.close()
    np.testing.assert_allclose(result["w"], fedavg(values, [10, 11])["w"], rtol=1e-5, atol=1e-6)


async def test_fetch_result_waits_its_timeout_in_all_not_once_per_stage(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with coordinator() as coord:
        async with (
            running(RoundServer(coord)) as server,
            await RoundClient.connect("127.0.0.1", server.port, peer="a") as a,
        ):
            asked: list[float | None] = []

            async def slow_take(round_id: RoundId, timeout: float | None) -> None:
                await asyncio.sleep(0.05)  # the stream waited, and brought nothing
                return None

            async def result(round_id: RoundId, timeout: float | None = None) -> Cid:
                asked.append(timeout)
                return Cid.of(b"x")

            async def fetch(cid: Cid, *, have: object = None) -> ModelUpdate:
                return ModelUpdate({})

            monkeypatch.setattr(a.cut, "take", slow_take)
            monkeypatch.setattr(a, "result", result)
            monkeypatch.setattr(a, "fetch", fetch)
            await a.fetch_result(RID, timeout=10.0)
            await a.fetch_result(RID, timeout=None)
    assert asked[0] is not None and asked[0] <= 10.0 - 0.05  # what the stream left of it
    assert asked[1] is None


async def test_a_stream_says_every_peer_announced_only_to_a_client_that_asks() -> None:
    values = inputs(2, seed=6)
    with coordinator() as coord:
        async with (
            running(RoundServer(coord)) as server,
            await RoundClient.connect("127.0.0.1", server.port, peer="a") as a,
            await RoundClient.connect("127.0.0.1", server.port, peer="b") as b,
        ):
            await a.start_round(RID, RoundSpec(2))
            await announce_all([a, b], RID, values, [1, 1], CHUNK)  # nothing pushed yet

            async def ask(ready: bool | None) -> StreamAnswer:
                call = StreamRequest(
                    round=RID.round, initiator=RID.initiator, peer="a", timeout=0.2, ready=ready
                )
                body, _ = await a.blocks.request_blocks(
                    APP_STREAM, encode(call), a.store, lambda b: decode_stream_answer(b).sent_cids()
                )
                return decode_stream_answer(body)

            told = await ask(False)  # a client that listens for it: told at once
            assert told.ready and not told.chunks
            for ready in (None, True):  # one from before it, or one told already: no such answer
                quiet = await ask(ready)
                assert not quiet.ready and not quiet.chunks  # the wait's empty end
