"""Hierarchical aggregation in one process: a top coordinator, regional tiers, their peers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from tensorswap.region import Backoff, RegionalTier, UpstreamLink
from tensorswap.rounds.client import RoundClient
from tensorswap.rounds.coordinator import Coordinator
from tensorswap.rounds.server import RoundServer
from tensorswap.rounds.state import Complete, Failed, RoundId, RoundSpec, RoundStatus

RID = RoundId(1, "lead")
FAST = Backoff(first=0.01, cap=0.05, patience=30.0)
SIZE = 64 * 1024  # float32 values per peer update (256 KiB): several chunks? no: one chunk


@dataclass
class Region:
    tier: RegionalTier
    server: RoundServer

    @property
    def port(self) -> int:
        return self.server.port


@dataclass
class Net:
    top: RoundServer
    regions: list[Region]


def values(i: int, size: int = SIZE) -> np.ndarray:
    return np.random.default_rng(i).standard_normal(size, dtype=np.float32)


@asynccontextmanager
async def serve(coordinator: Coordinator) -> AsyncIterator[RoundServer]:
    server = RoundServer(coordinator)
    await server.start("127.0.0.1", 0)
    try:
        yield server
    finally:
        await server.aclose()


@asynccontextmanager
async def region(tmp: Path, name: str, port: int, backoff: Backoff = FAST) -> AsyncIterator[Region]:
    link = UpstreamLink("127.0.0.1", port, region=name, backoff=backoff)
    tier = await asyncio.to_thread(RegionalTier.open, tmp / name, link, durable=False)
    assert tier.coordinator is not None
    try:
        async with serve(tier.coordinator) as server:
            await tier.start()
            try:
                yield Region(tier, server)
            finally:
                await tier.aclose()
    finally:
        await asyncio.to_thread(tier.close)


@asynccontextmanager
async def network(tmp: Path, regions: int) -> AsyncIterator[Net]:
    async with AsyncExitStack() as stack:
        top_coord = stack.enter_context(Coordinator.open(tmp / "top", durable=False))
        top = await stack.enter_async_context(serve(top_coord))
        tiers = [
            await stack.enter_async_context(region(tmp, f"region-{r}", top.port))
            for r in range(regions)
        ]
        yield Net(top, tiers)


async def start(port: int, spec: RoundSpec, rid: RoundId = RID) -> None:
    async with await RoundClient.connect("127.0.0.1", port, peer="driver") as driver:
        assert await driver.start_round(rid, spec)


async def peer_round(
    port: int, peer: str, update: np.ndarray, samples: int, spec: RoundSpec
) -> tuple[RoundStatus, dict[str, np.ndarray] | None]:
    async with await RoundClient.connect("127.0.0.1", port, peer=peer) as client:
        await client.start_round(RID, spec)
        await client.submit(RID, {"w": update}, samples)
        status = await client.wait(RID, timeout=60)
        if not isinstance(status, Complete):
            return status, None
        return status, await client.fetch_result(RID, timeout=60)


async def region_round(
    rg: Region, peers: Sequence[int], strategy: str = "fedavg"
) -> list[tuple[RoundStatus, dict[str, np.ndarray] | None]]:
    spec = RoundSpec(len(peers), strategy=strategy)
    return list(
        await asyncio.gather(
            *(peer_round(rg.port, f"peer-{i}", values(i), 10 + i, spec) for i in peers)
        )
    )


async def flat_round(tmp: Path, peers: Sequence[int], strategy: str) -> np.ndarray:
    with Coordinator.open(tmp / "flat", durable=False) as coord:
        async with serve(coord) as server:
            spec = RoundSpec(len(peers), strategy=strategy)
            got = await asyncio.gather(
                *(peer_round(server.port, f"peer-{i}", values(i), 10 + i, spec) for i in peers)
            )
    result = got[0][1]
    assert result is not None
    return result["w"]


GROUPS = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


@pytest.mark.parametrize(
    ("strategy", "groups"),
    [("fedavg", GROUPS), ("mean", GROUPS), ("mean", [[0, 1], [2, 3, 4, 5], [6, 7, 8, 9, 10, 11]])],
)
async def test_three_regions_of_peers_give_the_flat_result(
    tmp_path: Path, strategy: str, groups: list[list[int]]
) -> None:
    async with network(tmp_path, len(groups)) as net:
        await start(net.top.port, RoundSpec(len(groups)))
        per_region = await asyncio.gather(
            *(region_round(rg, g, strategy) for rg, g in zip(net.regions, groups, strict=True))
        )
        top_status = net.top.coordinator.status(RID)
    assert isinstance(top_status, Complete)
    flat = await flat_round(tmp_path, [i for g in groups for i in g], strategy)
    for answers in per_region:
        for status, result in answers:
            # every peer's round on its region names the global result, not the partial
            assert status == top_status
            assert result is not None
            np.testing.assert_allclose(result["w"], flat, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_less(1e-3, np.abs(flat - values(0)).max())  # not trivially equal


async def test_the_upstream_link_carries_one_update_per_region_per_direction(
    tmp_path: Path,
) -> None:
    update_bytes = SIZE * 4
    async with network(tmp_path, 3) as net:
        await start(net.top.port, RoundSpec(3))
        before = net.top.traffic()
        await asyncio.gather(
            *(region_round(rg, g) for rg, g in zip(net.regions, GROUPS, strict=True))
        )
        top = net.top.traffic()
        links = [rg.tier.stats() for rg in net.regions]
        region_in = [rg.server.traffic().bytes_in for rg in net.regions]
    into_top, out_of_top = top.bytes_in - before.bytes_in, top.bytes_out - before.bytes_out
    # what the top coordinator saw: three updates in, three out (plus a little framing)
    assert 3 * update_bytes <= into_top < 3 * update_bytes * 1.05 + 64 * 1024
    assert 3 * update_bytes <= out_of_top < 3 * update_bytes * 1.05 + 64 * 1024
    for stats, received_from_peers in zip(links, region_in, strict=True):
        assert update_bytes <= stats.upstream_bytes_sent < update_bytes * 1.05 + 16 * 1024
        assert update_bytes <= stats.upstream_bytes_received < update_bytes * 1.05 + 16 * 1024
        assert received_from_peers >= 4 * update_bytes  # the peers' updates stayed regional
        assert (stats.forwarded, stats.completed, stats.failed) == (1, 1, 0)
