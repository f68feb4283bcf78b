"""A top coordinator, regional tiers and their peers in one process (tests of region)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tensorswap.region import Backoff, RegionalTier, RegionGate, UpstreamLink
from tensorswap.rounds.client import RoundClient
from tensorswap.rounds.core import Clock, Complete, RoundId, RoundSpec, RoundStatus
from tensorswap.rounds.engine import Coordinator
from tensorswap.rounds.server import RoundServer

RID = RoundId(1, "lead")
FAST = Backoff(first=0.01, cap=0.05, give_up_after=30.0)
GROUPS = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
"""Three regions of four peers (peer i sends values(i) with 10 + i samples)."""
SIZE = 64 * 1024  # float32 values per peer update (256 KiB, one chunk)


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
async def serve(
    coordinator: Coordinator, link: UpstreamLink | None = None
) -> AsyncIterator[RoundServer]:
    """A coordinator's server with its region gate (a region's: ``link``'s)."""
    server = RoundServer(coordinator)
    RegionGate(server, link=link)
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
        async with serve(tier.coordinator, link) as server:
            await tier.start()
            try:
                yield Region(tier, server)
            finally:
                await tier.aclose()
    finally:
        await asyncio.to_thread(tier.close)


@asynccontextmanager
async def network(
    tmp: Path, regions: int, clock: Clock | None = None, backoff: Backoff = FAST
) -> AsyncIterator[Net]:
    """A top coordinator (on ``clock``, its timer off when given) and ``regions`` tiers."""
    async with AsyncExitStack() as stack:
        top_coord = stack.enter_context(
            Coordinator.open(tmp / "top", durable=False, clock=clock, run_timer=clock is None)
        )
        top = await stack.enter_async_context(serve(top_coord))
        tiers = [
            await stack.enter_async_context(region(tmp, f"region-{r}", top.port, backoff))
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
