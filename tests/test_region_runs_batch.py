"""Virtual peers (``runs/batch``) through folding regions: their batched registrations,
tasks and contributions are relayed or folded, giving the flat run's global models."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from pathlib import Path

import numpy as np

from helpers.region_runs import RUN, initial, models, tier, top, trained
from tensorswap.rounds.client import VirtualClients
from tensorswap.runs import RunManager, RunSpec, Task
from tensorswap.runs.client import RunClient
from tensorswap.runs.virtual import RunContribution, VirtualRuns
from tensorswap.store import ModelUpdate

SPEC = RunSpec(per_round=6, rounds=2, seed=7)


async def virtual_peers(
    port: int, first: int, count: int, runs: RunManager, started: asyncio.Event
) -> int:
    """Peers ``v<first>..`` on one pool at ``port``: register, then (once ``started``) train
    every task until the run (at the top: ``runs``) finishes; how many contributions."""
    names = [f"v{i}" for i in range(first, first + count)]
    done = 0
    async with await VirtualClients.connect("127.0.0.1", port, connections=2) as pool:
        vruns = VirtualRuns(pool)
        assert (
            await vruns.register_many({n: {"num_samples": 10 + int(n[1:])} for n in names})
            == [None] * count
        )
        await started.wait()
        while not runs.run(RUN).finished:
            tasks = await vruns.tasks(RUN, names, timeout=5)
            chosen = [(n, t) for n, t in zip(names, tasks, strict=True) if isinstance(t, Task)]
            assert not any(isinstance(t, Exception) for t in tasks), tasks
            if not chosen:
                continue
            model = await RunClient(pool.client_for(chosen[0][0])).fetch_model(chosen[0][1])
            items = [
                RunContribution(n, t, trained(int(n[1:]), model, t.version)["w"], 10 + int(n[1:]))
                for n, t in chosen
            ]
            items = [
                RunContribution(
                    i.peer, i.task, ModelUpdate({"w": i.update}, i.num_samples), i.num_samples
                )
                for i in items
            ]
            statuses = await vruns.contribute_many(items)
            assert not any(isinstance(s, Exception) for s in statuses), statuses
            done += len(chosen)
    return done


async def create(port: int) -> None:
    async with await RunClient.connect("127.0.0.1", port, peer="driver") as driver:
        await driver.create_run(RUN, SPEC, ModelUpdate(initial()))


async def test_virtual_peers_through_folding_regions_give_the_flat_models(tmp_path: Path) -> None:
    async with top(tmp_path, "flat") as flat:
        started = asyncio.Event()
        work = asyncio.ensure_future(virtual_peers(flat.server.port, 0, 8, flat.runs, started))
        await until_registered(flat.runs, 8)
        await create(flat.server.port)
        started.set()
        assert await asyncio.wait_for(work, 120) == 12
        want = models(flat.runs)
    async with AsyncExitStack() as stack:
        up = await stack.enter_async_context(top(tmp_path))
        regions = [
            await stack.enter_async_context(tier(tmp_path, f"region-{r}", up.server.port))
            for r in range(2)
        ]
        started = asyncio.Event()
        work = asyncio.gather(
            *(
                virtual_peers(rg.server.port, 4 * r, 4, up.runs, started)
                for r, rg in enumerate(regions)
            )
        )
        await until_registered(up.runs, 8)
        await create(up.server.port)
        started.set()
        done = await asyncio.wait_for(work, 120)
        got = models(up.runs)
        versions = up.runs.versions(RUN)
        folds = [rg.tier.stats().forwarded for rg in regions]
    assert sum(done) == 12
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    assert all(p.startswith("region-") for v in versions[1:] for p in v.participants)
    assert sum(folds) == sum(len(v.participants) for v in versions[1:])


async def until_registered(runs: RunManager, count: int) -> None:
    for _ in range(6000):
        if len(runs.registry) >= count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the peers never registered")
