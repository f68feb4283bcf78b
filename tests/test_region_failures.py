"""A regional tier when things go wrong: robust rules, an incompatible or failing upper round,
a region that misses the upper deadline, an upstream that is down for a while or for good."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import numpy as np
import pytest

from helpers.region import (
    FAST,
    GROUPS,
    RID,
    network,
    peer_round,
    region,
    region_round,
    start,
    values,
)
from tensorswap.region import Backoff
from tensorswap.rounds.client import RoundClient
from tensorswap.rounds.core import Complete, Failed, FakeClock, RoundSpec
from tensorswap.rounds.engine import Coordinator
from tensorswap.rounds.server import RoundServer

OUTLIER = 1e4


async def test_a_robust_regional_rule_then_a_sample_weighted_upper_average(
    tmp_path: Path,
) -> None:
    async with network(tmp_path, 3) as net:
        await start(net.top.port, RoundSpec(3))
        spec = RoundSpec(4, strategy="median")

        async def one_region(r: int) -> list[tuple[object, dict[str, np.ndarray] | None]]:
            peers = GROUPS[r]
            # the last peer of each region is Byzantine: its update is far off
            ups = [values(i) if i != peers[-1] else np.full_like(values(i), OUTLIER) for i in peers]
            rg = net.regions[r]
            return list(
                await asyncio.gather(
                    *(
                        peer_round(rg.port, f"peer-{i}", u, 10 + i, spec)
                        for i, u in zip(peers, ups, strict=True)
                    )
                )
            )

        answers = await asyncio.gather(*(one_region(r) for r in range(3)))
    medians, weights = [], []
    for peers in GROUPS:
        stack = np.stack([values(i) for i in peers[:-1]] + [np.full_like(values(0), OUTLIER)])
        medians.append(np.median(stack, axis=0))
        weights.append(sum(10 + i for i in peers))
    want = sum(m * (w / sum(weights)) for m, w in zip(medians, weights, strict=True))
    for per_region in answers:
        for status, result in per_region:
            assert isinstance(status, Complete)
            assert result is not None
            np.testing.assert_allclose(result["w"], want, rtol=1e-5, atol=1e-5)
    assert np.abs(want).max() < 10  # the outliers were kept out by each region's median


async def test_an_upper_round_that_does_not_average_is_refused(tmp_path: Path) -> None:
    async with network(tmp_path, 1) as net:
        await start(net.top.port, RoundSpec(1, strategy="median"))
        answers = await region_round(net.regions[0], [0, 1])
        assert net.top.coordinator.info(RID).received == 0  # nothing went up
    for status, result in answers:
        assert isinstance(status, Failed) and result is None
        assert "'median'" in status.reason and "fedavg" in status.reason


async def test_a_deterministic_upper_round_is_refused(tmp_path: Path) -> None:
    """A deterministic round's bits are each peer's update in name order: no regional
    partial can give them, so the region says so rather than folding."""
    async with network(tmp_path, 1) as net:
        await start(net.top.port, RoundSpec(1, deterministic=True))
        answers = await region_round(net.regions[0], [0, 1])
        assert net.top.coordinator.info(RID).received == 0  # nothing went up
    for status, result in answers:
        assert isinstance(status, Failed) and result is None
        assert "deterministic" in status.reason and "name order" in status.reason


async def test_an_upper_round_that_fails_fails_the_regional_round(tmp_path: Path) -> None:
    clock = FakeClock()
    async with network(tmp_path, 1, clock=clock) as net:
        await start(net.top.port, RoundSpec(2, timeout_s=30))
        peers = asyncio.gather(*(region_round(net.regions[0], [0, 1]),))
        await until(lambda: net.top.coordinator.info(RID).received == 1)
        clock.advance(31)
        net.top.coordinator.check_deadlines()  # 1 of 2 regions, quorum 2: the upper round fails
        ((first, _), (second, _)) = (await peers)[0]
    assert first == second
    assert isinstance(first, Failed)
    assert first.reason.startswith("upstream round failed: timeout: 1 of 2 peers")


async def test_a_region_that_misses_the_upper_deadline_still_serves_the_global_result(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    async with network(tmp_path, 3, clock=clock) as net:
        await start(net.top.port, RoundSpec(3, quorum=2, timeout_s=30))
        on_time = asyncio.gather(*(region_round(net.regions[r], GROUPS[r]) for r in (0, 1)))
        await until(lambda: net.top.coordinator.info(RID).received == 2)
        clock.advance(31)
        net.top.coordinator.check_deadlines()  # quorum 2 of 3: the upper tier goes on without it
        answers = await on_time
        late = await region_round(net.regions[2], GROUPS[2])  # region 2 comes back too late
        top = net.top.coordinator.status(RID)
        stats = [rg.tier.stats() for rg in net.regions]
    assert isinstance(top, Complete)
    assert sorted(net.top.coordinator.info(RID).peers) == ["region-0", "region-1"]
    for status, _ in [a for region_answers in answers for a in region_answers] + late:
        assert status == top
    want = sum(values(i) * (10 + i) for i in GROUPS[0] + GROUPS[1]) / sum(
        10 + i for i in GROUPS[0] + GROUPS[1]
    )
    np.testing.assert_allclose(late[0][1]["w"], want, rtol=1e-5, atol=1e-6)  # type: ignore[index]
    assert [s.late for s in stats] == [0, 0, 1]


async def test_an_upstream_down_at_first_is_reached_once_it_listens(tmp_path: Path) -> None:
    with socket.socket() as probe:  # a free port nothing listens on, for now
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    async with region(tmp_path, "region-0", port) as rg:
        peers = asyncio.ensure_future(region_round(rg, [0, 1]))
        await until(lambda: rg.tier.coordinator.status(RID).name == "Aggregating")
        with Coordinator.open(tmp_path / "top", durable=False) as coord:
            top = RoundServer(coord)
            await top.start("127.0.0.1", port)  # the very port the region keeps dialling
            try:
                await start(port, RoundSpec(1))
                answers = await peers
            finally:
                await top.aclose()
    want = (values(0) * 10 + values(1) * 11) / 21
    for status, result in answers:
        assert isinstance(status, Complete) and result is not None
        np.testing.assert_allclose(result["w"], want, rtol=1e-5, atol=1e-6)


async def test_an_upstream_gone_for_good_fails_the_round_after_the_patience(
    tmp_path: Path,
) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    patient = Backoff(first=0.01, cap=0.02, give_up_after=0.2)
    async with region(tmp_path, "region-0", port, patient) as rg:
        answers = await region_round(rg, [0, 1])
    for status, _ in answers:
        assert isinstance(status, Failed)
        assert "unreachable" in status.reason and f"127.0.0.1:{port}" in status.reason


async def until(check: object, *, limit: int = 3000) -> None:
    """Yield to the loop (10 ms at a time, 30 s at most) until ``check()`` holds."""
    for _ in range(limit):
        try:
            if callable(check) and check():
                return
        except AttributeError:  # the round does not exist yet
            pass
        await asyncio.sleep(0.01)
    raise AssertionError("condition never held")


def test_backoff_is_checked() -> None:
    with pytest.raises(ValueError, match="factor"):
        Backoff(factor=0.5)
    assert FAST.cap >= FAST.first


async def test_a_top_server_restarted_mid_wait_is_reconnected_to(tmp_path: Path) -> None:
    with Coordinator.open(tmp_path / "top", durable=False) as coord:
        top = RoundServer(coord)
        await top.start("127.0.0.1", 0)
        port = top.port
        try:
            await start(port, RoundSpec(2))
            async with region(tmp_path, "region-0", port) as rg:
                peers = asyncio.ensure_future(region_round(rg, [0, 1]))
                await until(lambda: coord.info(RID).received == 1)  # the region is waiting
                await top.aclose()  # its connections are cut
                top = RoundServer(coord)
                await top.start("127.0.0.1", port)
                await submit_other(port)
                answers = await peers
                stats = rg.tier.stats()
        finally:
            await top.aclose()
    want = (values(0) * 10 + values(1) * 11 + values(7) * 17) / 38
    for status, result in answers:
        assert isinstance(status, Complete) and result is not None
        np.testing.assert_allclose(result["w"], want, rtol=1e-5, atol=1e-6)
    assert stats.upstream_connections >= 2 and stats.forwarded == 1


async def submit_other(port: int) -> None:
    async with await RoundClient.connect("127.0.0.1", port, peer="other") as other:
        await other.submit(RID, {"w": values(7)}, 17)
