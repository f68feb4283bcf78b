"""Runs over the wire: peers register, long-poll for tasks, fetch the global model, submit;
refusals arrive typed; the coordinator's status lists the runs."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from tensorswap.cid import Cid
from tensorswap.rounds import Coordinator, FakeClock, RoundId
from tensorswap.rounds.server import RoundServer
from tensorswap.runs import NotSelected, RunManager, RunMode, RunSpec, StaleContribution
from tensorswap.runs.client import RunClient
from tensorswap.runs.service import RunService
from tensorswap.store import ModelUpdate, put_update

KEY = b"runs-service-key"


def _model(value: float) -> dict[str, np.ndarray]:
    return {"w": np.full((16, 4), value, np.float32), "b": np.full(4, value, np.float32)}


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[RoundServer, RunManager]]:
    coord = Coordinator.open(tmp_path, clock=FakeClock(), run_timer=False, durable=False)
    runs = RunManager.open(coord, durable=False)
    server = RoundServer(coord, key=KEY, max_wait=30)
    RunService(runs, server)
    try:
        await server.start("127.0.0.1", 0)
        yield server, runs
    finally:
        await server.aclose()
        runs.close()
        coord.close()


async def _client(server: RoundServer, peer: str) -> RunClient:
    return await RunClient.connect("127.0.0.1", server.port, peer=peer, key=KEY)


async def test_peers_long_poll_train_and_submit_over_the_wire(
    served: tuple[RoundServer, RunManager],
) -> None:
    server, _ = served
    peers = [await _client(server, f"p{i}") for i in range(3)]
    try:
        for peer in peers:
            await peer.register({"num_samples": 100})
        spec = RunSpec(per_round=2, rounds=2, seed=5)
        row = await peers[0].create_run("fl", spec, ModelUpdate(_model(0.0)))
        assert row.version == 0 and row.mode == "sync"

        async def loop(client: RunClient) -> int:
            done = 0
            while (task := await client.next_task("fl", timeout=20)) is not None:
                model = await client.fetch_model(task)
                trained = {k: v + 1 for k, v in model.items()}
                await client.submit(task, trained, num_samples=100)
                done += 1
            return done

        counts = await asyncio.gather(*(loop(p) for p in peers))
        assert sum(counts) == 4  # 2 rounds x 2 sampled peers
        final = await peers[0].run("fl")
        assert final.finished and final.version == 2
        model = (await peers[0].rounds.fetch(Cid.parse(final.global_cid))).tensors
        np.testing.assert_array_equal(model["w"], np.full((16, 4), 2.0, np.float32))
        history = await peers[2].versions("fl")
        assert [v.version for v in history] == [0, 1, 2]
        assert all(len(v.participants) == 2 for v in history[1:])
        assert history[-1].global_cid == final.global_cid
        assert [v.version for v in await peers[2].versions("fl", since=2)] == [2]
        listed = await peers[1].runs()
        assert [r.name for r in listed] == ["fl"] and len(listed[0].participants) == 2
    finally:
        for peer in peers:
            await peer.aclose()


async def test_refusals_arrive_typed(served: tuple[RoundServer, RunManager]) -> None:
    server, runs = served
    a, b = await _client(server, "a"), await _client(server, "b")
    try:
        await a.register()
        await b.register()
        await a.create_run("one", RunSpec(per_round=1, seed=1), ModelUpdate(_model(0.0)))
        runs.drain()
        chosen = runs.run("one").selected[0]
        other = b if chosen == "a" else a
        task = runs.task("one", chosen)
        assert task is not None
        with pytest.raises(NotSelected, match=other.peer):
            await other.rounds.submit(task.round_id, _model(1.0), 1)  # the plain rounds path
        assert await other.next_task("one", timeout=0) is None
        await a.create_run(
            "buf", RunSpec(mode=RunMode.ASYNC, buffer=2, max_staleness=0), ModelUpdate(_model(0))
        )
        runs.drain()
        task = await a.next_task("buf", timeout=5)
        assert task is not None and task.mode is RunMode.ASYNC and task.version == 0
        delta = await asyncio.to_thread(
            put_update, runs.store, ModelUpdate({k: v + 1 for k, v in _model(0).items()}, 1)
        )
        for fast in ("x", "y"):  # two faster peers make version 1 meanwhile
            runs.registry.register(fast)
            runs.submit(task.round_id, fast, delta, trained_on=0)
        runs.wait_version("buf", 1, timeout=30)
        with pytest.raises(StaleContribution, match="version 0"):
            await a.submit(task, _model(0.5), 1)  # trained on version 0, now one behind
    finally:
        await a.aclose()
        await b.aclose()


async def test_a_driver_long_polls_for_the_next_version(
    served: tuple[RoundServer, RunManager],
) -> None:
    server, _ = served
    driver, peer = await _client(server, "driver"), await _client(server, "p0")
    try:
        await peer.register({"num_samples": 10})
        await driver.create_run("follow", RunSpec(rounds=1, seed=2), ModelUpdate(_model(0.0)))
        assert [v.version for v in await driver.versions("follow", wait=5)] == [0]
        assert await driver.versions("follow", since=1, wait=0) == []  # none yet, no wait
        waiting = asyncio.create_task(driver.versions("follow", since=1, wait=20))
        task = await peer.next_task("follow", timeout=20)
        assert task is not None and not waiting.done()
        await peer.submit(task, {k: v + 3 for k, v in _model(0.0).items()}, num_samples=10)
        got = await asyncio.wait_for(waiting, 20)
        assert [v.version for v in got] == [1] and got[0].participants == ["p0"]
        # the run is finished: a wait for a version that will never come returns at once
        assert await asyncio.wait_for(driver.versions("follow", since=2, wait=20), 5) == []
    finally:
        await driver.aclose()
        await peer.aclose()


async def test_an_async_delta_joins_the_buffer_open_when_it_arrives(
    served: tuple[RoundServer, RunManager],
) -> None:
    """FedBuff: a delta whose task named a buffer that has filled meanwhile joins the next
    one (scaled by its staleness), and a peer's second delta waits for a buffer without it."""
    server, runs = served
    names = ("a", "b", "c", "d")
    clients = {n: await _client(server, n) for n in names}
    try:
        for client in clients.values():
            await client.register({"num_samples": 1})
        spec = RunSpec(mode=RunMode.ASYNC, buffer=2, max_staleness=4, staleness="constant")
        await clients["a"].create_run("fb", spec, ModelUpdate(_model(0.0)))
        tasks = {n: await clients[n].next_task("fb", timeout=10) for n in ("a", "b", "c")}
        assert all(t is not None and t.round_id.round == 1 for t in tasks.values())
        one = {k: np.ones_like(v) for k, v in _model(0.0).items()}
        for n in ("a", "b"):
            task = tasks[n]
            assert task is not None
            await clients[n].submit(task, one, num_samples=1)
        runs.wait_version("fb", 1, timeout=30)
        late = tasks["c"]
        assert late is not None
        await clients["c"].submit(late, one, num_samples=1)  # buffer 1 is full: into buffer 2
        again = asyncio.create_task(clients["c"].submit(late, one, num_samples=1))
        task_d = await clients["d"].next_task("fb", timeout=10)
        assert task_d is not None and task_d.version == 1 and not again.done()
        await clients["d"].submit(task_d, one, num_samples=1)
        await asyncio.wait_for(again, 30)  # buffer 2 filled: c's second delta is in buffer 3
        runs.drain()
        versions = runs.versions("fb")
        assert versions[2].participants == ("c", "d") and versions[2].staleness == (1, 0)
        current = runs.coordinator.info(RoundId(3, "fb"))
        assert current is not None and current.peers == ("c",)
    finally:
        for client in clients.values():
            await client.aclose()


@pytest.mark.parametrize("mode", [RunMode.SYNC, RunMode.ASYNC])
async def test_a_peers_own_store_keeps_its_latest_rounds_of_a_run(
    served: tuple[RoundServer, RunManager], mode: RunMode
) -> None:
    """What a runs client's calls bring into its own store (the global models it fetches,
    the updates or deltas it pushes) is kept for its latest two rounds only."""
    server, _ = served
    peer = await _client(server, "p0")
    try:
        await peer.register({"num_samples": 10})
        spec = (
            RunSpec(per_round=1, rounds=5, seed=3)
            if mode is RunMode.SYNC
            else RunSpec(mode=RunMode.ASYNC, buffer=1, max_staleness=0, rounds=5, seed=3)
        )
        await peer.create_run("kept", spec, ModelUpdate(_model(0.0)))
        models: list[Cid] = []
        while (task := await peer.next_task("kept", timeout=20)) is not None:
            model = await peer.fetch_model(task)
            models.append(task.global_cid)
            fresh = {k: v + np.float32(len(models)) for k, v in model.items()}  # new blocks
            await peer.submit(task, fresh, num_samples=10)
        assert len(models) == 5
        store, retention = peer.rounds.store, peer.rounds.retention
        assert retention is not None and retention.deleted > 0
        assert not store.has(models[1]) and store.has(models[-1])  # the oldest rounds went
        assert len(retention.held_rounds) == 2
    finally:
        await peer.aclose()
