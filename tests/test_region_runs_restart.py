"""A regional coordinator folding a run's round, killed with -9 after two of its four
sampled peers submitted, resumes from its journal: the two updates are kept, the others
join, one fold goes up, and the run's global models are the flat FedAvg's."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from helpers.region_runs import RUN, initial, trained
from helpers.serve import SECRET, Server
from tensorswap.cid import Cid
from tensorswap.runs import RunSpec
from tensorswap.runs.client import RunClient
from tensorswap.store import ModelUpdate

PEERS = [f"peer-{i}" for i in range(4)]


async def client(port: int, peer: str) -> RunClient:
    return await RunClient.connect("127.0.0.1", port, peer=peer, key=SECRET.encode())


async def register_and_create(region: int, top: int) -> None:
    for i, peer in enumerate(PEERS):
        async with await client(region, peer) as c:
            await c.register({"num_samples": 10 + i})
    async with await client(top, "driver") as driver:
        await driver.create_run(RUN, RunSpec(per_round=4, rounds=2, seed=1), ModelUpdate(initial()))


async def first_two_submit(region: int) -> None:
    for i in (0, 1):
        async with await client(region, PEERS[i]) as c:
            task = await c.next_task(RUN, timeout=60)
            assert task is not None and task.version == 0
            model = await c.fetch_model(task)
            await c.submit(task, trained(i, model, 0), 10 + i)


async def everyone_to_the_end(region: int) -> list[int]:
    async def work(i: int) -> int:
        done = 0
        async with await client(region, PEERS[i]) as c:
            while (task := await c.next_task(RUN, timeout=60)) is not None:
                model = await c.fetch_model(task)
                await c.submit(task, trained(i, model, task.version), 10 + i)
                done += 1
        return done

    return list(await asyncio.gather(*(work(i) for i in range(4))))


async def history(top: int) -> tuple[list[list[str]], list[np.ndarray]]:
    async with await client(top, "watcher") as watcher:
        versions = await watcher.versions(RUN)
        models = [
            (await watcher.rounds.fetch(Cid.parse(v.global_cid))).tensors["w"] for v in versions
        ]
    return [list(v.participants) for v in versions], models


def flat_fedavg() -> list[np.ndarray]:
    weights = np.array([10 + i for i in range(4)], dtype=np.float64)
    models = [initial()]
    for version in range(2):
        updates = [trained(i, models[-1], version)["w"] for i in range(4)]
        mean = sum(w * u.astype(np.float64) for w, u in zip(weights, updates, strict=True))
        models.append({"w": (mean / weights.sum()).astype(np.float32)})
    return [m["w"] for m in models]


@pytest.mark.timeout(180)
def test_a_region_killed_mid_round_keeps_its_peers_updates_and_folds_once(
    tmp_path: Path, servers: list[Server]
) -> None:
    top = Server(tmp_path / "top")
    servers.append(top)

    def region() -> Server:
        up = ("--upstream", f"127.0.0.1:{top.port}", "--region", "region-a")
        started = Server(tmp_path / "region", *up)
        servers.append(started)
        return started

    first = region()
    asyncio.run(register_and_create(first.port, top.port))
    asyncio.run(first_two_submit(first.port))  # journaled in the region: its round is 2 of 4
    first.kill()
    second = region()
    counts = asyncio.run(everyone_to_the_end(second.port))
    participants, models = asyncio.run(history(top.port))
    # peers 0 and 1 were not asked to train round 1 again: their updates survived the kill
    assert counts == [1, 1, 2, 2]
    assert participants[1:] == [["region-a"], ["region-a"]]  # one fold per round
    for got, want in zip(models, flat_fedavg(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
