"""Runs through a regional coordinator: peers of the region register, get tasks and submit
through it; the top samples and steps; each global model crosses the upstream link once."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
import pytest

from helpers.region import FAST
from tensorswap.cid import Cid
from tensorswap.region import RegionalTier, RunsProxy, UpstreamLink
from tensorswap.rounds.client import RoundClient
from tensorswap.rounds.core import RoundId, RoundNotFound
from tensorswap.rounds.engine import Coordinator
from tensorswap.rounds.server import RoundServer
from tensorswap.runs import NotSelected, RunManager, RunSpec
from tensorswap.runs.client import RunClient
from tensorswap.runs.service import RunService
from tensorswap.store import ModelUpdate

VALUES = 64 * 1024  # float32: a 256 KiB model
MODEL_BYTES = VALUES * 4
STEP = {"p0": 1.0, "p1": 2.0, "p2": 4.0}  # what each peer's training adds: versions differ


@asynccontextmanager
async def top_and_region(tmp: Path) -> AsyncIterator[tuple[RoundServer, RoundServer, RegionalTier]]:
    coord = Coordinator.open(tmp / "top", durable=False)
    runs = RunManager.open(coord, durable=False)
    top = RoundServer(coord, max_wait=30)
    RunService(runs, top)
    link = UpstreamLink("127.0.0.1", 0, region="region-0", backoff=FAST)
    tier = None
    try:
        await top.start("127.0.0.1", 0)
        link.port = top.port
        tier = await asyncio.to_thread(RegionalTier.open, tmp / "region", link, durable=False)
        assert tier.coordinator is not None
        region = RoundServer(tier.coordinator, max_wait=30)
        RunsProxy(link, region)
        await region.start("127.0.0.1", 0)
        await tier.start()
        try:
            yield top, region, tier
        finally:
            await tier.aclose()
            await region.aclose()
    finally:
        await top.aclose()
        if tier is not None:
            tier.close()
        runs.close()
        coord.close()


async def test_a_run_through_a_region(tmp_path: Path) -> None:
    initial = {"w": np.random.default_rng(0).standard_normal(VALUES, dtype=np.float32)}
    async with top_and_region(tmp_path) as (_, region, tier):
        peers = [await RunClient.connect("127.0.0.1", region.port, peer=f"p{i}") for i in range(3)]
        try:
            for peer in peers:
                await peer.register({"num_samples": 100})
            spec = RunSpec(per_round=2, rounds=2, seed=5)
            row = await peers[0].create_run("fl", spec, ModelUpdate(initial))
            assert row.version == 0

            async def loop(client: RunClient) -> int:
                done, step = 0, np.float32(STEP[client.peer])
                while (task := await client.next_task("fl", timeout=20)) is not None:
                    model = await client.fetch_model(task)  # served by the region
                    await client.submit(task, {k: v + step for k, v in model.items()}, 100)
                    done += 1
                return done

            counts = await asyncio.gather(*(loop(p) for p in peers))
            final = await peers[0].run("fl")  # its global model is pulled to the region too
            model = (await peers[1].rounds.fetch(Cid.parse(final.global_cid))).tensors
            history = await peers[2].versions("fl")
            # a peer the top did not sample for the round is refused by the top, typed
            outsider = await RunClient.connect("127.0.0.1", region.port, peer="p9")
            async with outsider:
                await outsider.register()
        finally:
            for peer in peers:
                await peer.aclose()
        received = tier.stats().upstream_bytes_received
        served = region.traffic().bytes_out
    assert sum(counts) == 4 and final.finished and final.version == 2
    moved = sum(np.mean([STEP[p] for p in v.participants]) for v in history[1:])
    np.testing.assert_allclose(model["w"], initial["w"] + moved, rtol=1e-5, atol=1e-5)
    assert [v.version for v in history] == [0, 1, 2]
    # versions 1 and 2 came down once each (version 0 went up through the region), though
    # the region served at least 4 models (two peers at once per round; p0 made version 0)
    assert 2 * MODEL_BYTES <= received < 2 * MODEL_BYTES * 1.05 + 64 * 1024
    assert served >= 4 * MODEL_BYTES


async def test_refusals_from_the_top_arrive_typed_through_the_region(tmp_path: Path) -> None:
    async with top_and_region(tmp_path) as (_, region, _tier):
        async with await RunClient.connect("127.0.0.1", region.port, peer="a") as a:
            await a.register()
            await a.create_run("fl", RunSpec(per_round=1, rounds=1), {"w": np.ones(4, np.float32)})
            task = await a.next_task("fl", timeout=20)
            assert task is not None
        async with await RunClient.connect("127.0.0.1", region.port, peer="b") as b:
            await b.register()
            try:
                await b.submit(task, {"w": np.ones(4, np.float32)}, 1)
            except NotSelected as exc:
                assert exc.peer == "b"
            else:
                raise AssertionError("an unsampled peer's submit was accepted")


async def test_a_submit_to_an_unknown_round_is_refused_at_once_with_the_upstream_down(
    tmp_path: Path,
) -> None:
    with socket.socket() as probe:  # nothing listens there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    link = UpstreamLink("127.0.0.1", port, region="region-0", backoff=FAST)  # patience 30 s
    tier = await asyncio.to_thread(RegionalTier.open, tmp_path / "region", link, durable=False)
    assert tier.coordinator is not None
    region = RoundServer(tier.coordinator)
    RunsProxy(link, region)
    await region.start("127.0.0.1", 0)
    await tier.start()
    try:
        async with await RoundClient.connect("127.0.0.1", region.port, peer="p") as peer:
            with pytest.raises(RoundNotFound):
                await asyncio.wait_for(
                    peer.submit(RoundId(1, "nowhere"), {"w": np.ones(4, np.float32)}, 1), 20
                )
    finally:
        await tier.aclose()
        await region.aclose()
        tier.close()


async def test_a_relayed_inline_submit_is_held_to_the_regions_byte_budget(tmp_path: Path) -> None:
    """A tiny update's inline submit to a run's round at the top, relayed by a region,
    reserves its blocks' bytes in the region's in-flight budget while they are stored and
    relayed, as a local inline submit does (beyond the request frame's own reservation)."""
    values = 4096  # 16 KiB: inline (below INLINE_SEND_BYTES)
    async with top_and_region(tmp_path) as (top, region, _tier):
        budget = region.blocks.budget
        granted: list[int] = []
        earlier = budget.on_idle

        def idle(nbytes: int) -> None:
            granted.append(nbytes)
            if earlier is not None:
                earlier(nbytes)

        budget.on_idle = idle
        async with await RunClient.connect("127.0.0.1", top.port, peer="driver") as driver:
            spec = RunSpec(per_round=1, rounds=1)
            await driver.create_run("fl", spec, {"w": np.zeros(values, np.float32)})
        async with await RunClient.connect("127.0.0.1", region.port, peer="a") as a:
            await a.register()
            task = await a.next_task("fl", timeout=20)
            assert task is not None
            granted.clear()
            assert a.rounds.inline
            await a.submit(task, {"w": np.ones(values, np.float32)}, 1)
        top_round = top.coordinator.info(task.round_id)
    assert top_round is not None and top_round.peers == ("a",)  # relayed, one by one
    # the request frame (> 16 KiB) and then its blocks (> 16 KiB) were each reserved
    assert sum(granted) >= 2 * values * 4
