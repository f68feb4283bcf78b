"""`tensorswap serve --upstream`: a regional coordinator process killed with -9 mid-round
resumes from its journal: no second submission upstream, its peers get the global result."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from helpers.serve import SECRET, Server
from tensorswap.rounds.client import RoundClient
from tensorswap.rounds.core import Aggregating, Complete, RoundId, RoundNotFound, RoundSpec

RID = RoundId(1, "lead")
VALUES = 64 * 1024  # float32 values per update: 256 KiB, one chunk
UPDATE_BYTES = VALUES * 4


def values(i: int) -> np.ndarray:
    return np.random.default_rng(i).standard_normal(VALUES, dtype=np.float32)


SAMPLES = {"p0": 10, "p1": 30, "other": 60}
VALUE_OF = {"p0": values(0), "p1": values(1), "other": values(2)}


def expected() -> np.ndarray:
    total = sum(SAMPLES.values())
    return sum(VALUE_OF[p] * (SAMPLES[p] / total) for p in SAMPLES)  # type: ignore[return-value]


async def client(port: int, peer: str) -> RoundClient:
    return await RoundClient.connect("127.0.0.1", port, peer=peer, key=SECRET.encode())


async def start_top(port: int) -> None:
    async with await client(port, "driver") as driver:
        assert await driver.start_round(RID, RoundSpec(2))


async def regional_peers_submit(port: int) -> None:
    for peer in ("p0", "p1"):
        async with await client(port, peer) as c:
            await c.start_round(RID, RoundSpec(2))
            await c.submit(RID, {"w": VALUE_OF[peer]}, SAMPLES[peer])


async def until(port: int, peer: str, check: object) -> None:
    """Poll the coordinator at ``port`` (every 20 ms, 60 s at most) until ``check(row)``."""
    async with await client(port, "watcher") as watcher:
        for _ in range(3000):
            try:
                row = await watcher.round_row(RID)
            except RoundNotFound:
                row = None
            if callable(check) and check(row):
                return
            await asyncio.sleep(0.02)
    raise AssertionError(f"{peer}: condition never held")


async def finish(top: int, region: int) -> tuple[str, list[np.ndarray]]:
    async with await client(top, "other") as other:
        await other.submit(RID, {"w": VALUE_OF["other"]}, SAMPLES["other"])
        status = await other.wait(RID, timeout=60)
    assert isinstance(status, Complete)
    results = []
    for peer in ("p0", "p1"):
        async with await client(region, peer) as c:
            assert await c.wait(RID, timeout=60) == status  # the global result, not a partial
            results.append((await c.fetch_result(RID, timeout=60))["w"])
    return status.cid, results


async def top_report(port: int) -> tuple[list[str], int]:
    async with await client(port, "watcher") as watcher:
        report = await watcher.server_status()
    (row,) = report.rounds
    return sorted(row.peers), int(report.stats["bytes_in"])


def region(data: Path, top: Server) -> Server:
    return Server(data, "--upstream", f"127.0.0.1:{top.port}", "--region", "region-a")


@pytest.mark.timeout(180)
def test_a_region_killed_after_submitting_upstream_resumes_without_resubmitting(
    tmp_path: Path, servers: list[Server]
) -> None:
    top = Server(tmp_path / "top")
    servers.append(top)
    asyncio.run(start_top(top.port))
    first = region(tmp_path / "region", top)
    servers.append(first)
    asyncio.run(regional_peers_submit(first.port))
    asyncio.run(until(top.port, "region-a", lambda row: row and "region-a" in row.peers))
    asyncio.run(
        until(first.port, "region", lambda row: isinstance(row.status.to_status(), Aggregating))
    )
    first.kill()  # SIGKILL: the region had submitted upstream, the upper round is open
    second = region(tmp_path / "region", top)
    servers.append(second)
    cid, results = asyncio.run(finish(top.port, second.port))
    for got in results:
        np.testing.assert_allclose(got, expected(), rtol=1e-5, atol=1e-6)
    peers, bytes_in = asyncio.run(top_report(top.port))
    assert peers == ["other", "region-a"]
    # two updates reached the top: the region's partial once, the other contribution once
    assert 2 * UPDATE_BYTES <= bytes_in < 2 * UPDATE_BYTES * 1.05 + 64 * 1024
    assert cid


@pytest.mark.timeout(180)
def test_a_region_killed_before_the_upper_round_exists_resumes_and_submits(
    tmp_path: Path, servers: list[Server]
) -> None:
    top = Server(tmp_path / "top")
    servers.append(top)
    first = region(tmp_path / "region", top)
    servers.append(first)
    asyncio.run(regional_peers_submit(first.port))  # the region's round is full: it waits
    asyncio.run(
        until(first.port, "region", lambda row: isinstance(row.status.to_status(), Aggregating))
    )
    first.kill()
    second = region(tmp_path / "region", top)
    servers.append(second)
    asyncio.run(start_top(top.port))
    _, results = asyncio.run(finish(top.port, second.port))
    for got in results:
        np.testing.assert_allclose(got, expected(), rtol=1e-5, atol=1e-6)
    peers, _ = asyncio.run(top_report(top.port))
    assert peers == ["other", "region-a"]
