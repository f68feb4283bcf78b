"""A sync run through regions: each region folds the peers the top sampled into one
contribution per round, so 3 regions x 4 peers give the flat 12-peer run's global models,
and the upstream link carries one model per region per direction per round."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path

import numpy as np
import pytest

from helpers.region_runs import (
    MODEL_BYTES,
    RUN,
    Tier,
    Top,
    drive,
    initial,
    models,
    tier,
    top,
    trained,
)
from tensorswap.region import SecureRunThroughRegion
from tensorswap.rounds.core import Complete, Failed, FakeClock, RoundId
from tensorswap.rounds.protocol import PeerKeys
from tensorswap.runs import RunSpec
from tensorswap.runs.client import RunClient
from tensorswap.store import ModelUpdate

ROUNDS = 3


@pytest.mark.parametrize(
    ("optimizer", "per_round"), [("fedavg", 12), ("fedadam", 8), ("fedavgm", 5)]
)
async def test_three_regions_of_four_give_the_flat_runs_global_models(
    tmp_path: Path, optimizer: str, per_round: int
) -> None:
    params = {"server_momentum": 0.9} if optimizer == "fedavgm" else {}
    spec = RunSpec(
        per_round=per_round, rounds=ROUNDS, seed=3, optimizer=optimizer, optimizer_params=params
    )
    async with top(tmp_path, "flat") as flat:
        await drive([flat.server.port], flat.server.port, spec)
        flat_models = models(flat.runs)
        flat_versions = flat.runs.versions(RUN)
    async with AsyncExitStack() as stack:
        up, regions = await three_regions(stack, tmp_path)
        counts = await drive([rg.server.port for rg in regions], up.server.port, spec)
        hier_models = models(up.runs)
        versions = up.runs.versions(RUN)
        links = [rg.tier.stats() for rg in regions]
    assert len(hier_models) == len(flat_models) == ROUNDS + 1
    for got, want in zip(hier_models, flat_models, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.abs(hier_models[-1] - hier_models[0]).max() > 0.1  # the model moved
    assert sum(counts) == per_round * ROUNDS
    # the top sampled the same peers; each region stood for its sampled peers, once a round
    names = [f"region-{r}" for r in range(3)]
    for flat_v, hier_v in zip(flat_versions[1:], versions[1:], strict=True):
        covering = {f"region-{int(p.split('-')[1]) // 4}" for p in flat_v.participants}
        assert set(hier_v.participants) == covering
        assert set(hier_v.participants) <= set(names)
    for r, stats in enumerate(links):
        folded = [v for v in versions[1:] if names[r] in v.participants]
        up_models = len(folded)  # one fold per round its peers were sampled in
        down_models = len({v.version - 1 for v in folded} | {ROUNDS})  # each version once
        assert up_models * MODEL_BYTES <= stats.upstream_bytes_sent
        assert stats.upstream_bytes_sent < up_models * MODEL_BYTES * 1.02 + 96 * 1024
        assert down_models * MODEL_BYTES <= stats.upstream_bytes_received
        assert stats.upstream_bytes_received < down_models * MODEL_BYTES * 1.02 + 96 * 1024
        assert stats.forwarded == up_models and stats.failed == 0


@pytest.mark.parametrize("optimizer", ["fedavg", "fedadam"])
async def test_a_deterministic_run_through_three_regions_has_the_flat_runs_bits(
    tmp_path: Path, optimizer: str
) -> None:
    """``--deterministic``: each region relays its peers' updates one by one (nothing folded
    regionally) and the top folds in canonical order, so every version's CID is the flat
    12-peer run's, whatever order the peers' updates arrived in at either tier."""
    spec = RunSpec(
        per_round=12,
        rounds=ROUNDS,
        seed=3,
        optimizer=optimizer,
        params={"deterministic": 1},
    )
    assert spec.deterministic
    async with top(tmp_path, "flat") as flat:
        await drive([flat.server.port], flat.server.port, spec)
        flat_versions = flat.runs.versions(RUN)
    async with AsyncExitStack() as stack:
        up, regions = await three_regions(stack, tmp_path)
        await drive([rg.server.port for rg in regions], up.server.port, spec)
        versions = up.runs.versions(RUN)
        folded = [rg.tier.stats().forwarded for rg in regions]
    assert [v.global_cid for v in versions] == [v.global_cid for v in flat_versions]
    assert len(versions) == ROUNDS + 1
    assert folded == [0, 0, 0]  # relayed peer by peer
    assert all(p.startswith("peer-") for v in versions[1:] for p in v.participants)


async def three_regions(stack: AsyncExitStack, tmp_path: Path) -> tuple[Top, list[Tier]]:
    """A top coordinator and three folding regions under it, closed with ``stack``."""
    up = await stack.enter_async_context(top(tmp_path))
    regions = [
        await stack.enter_async_context(tier(tmp_path, f"region-{r}", up.server.port))
        for r in range(3)
    ]
    return up, regions


async def until(check: Callable[[], bool]) -> None:
    for _ in range(6000):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the condition never held")


async def test_late_peers_and_a_silent_region_meet_the_quorums_of_both_tiers(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    spec = RunSpec(per_round=12, rounds=1, quorum=0.6, round_timeout_s=100.0)
    rid = RoundId(1, RUN)
    async with AsyncExitStack() as stack:
        up = await stack.enter_async_context(top(tmp_path, clock=clock))
        regions = [
            await stack.enter_async_context(
                tier(tmp_path, f"region-{r}", up.server.port, clock=clock)
            )
            for r in range(3)
        ]
        ports = [rg.server.port for rg in regions]
        started = asyncio.Event()
        # peer 3 (region-0) never trains; region-2's peers never ask: that region is silent
        silent = (3, 8, 9, 10, 11)
        work = asyncio.ensure_future(
            drive(ports, up.server.port, spec, silent=silent, started=started)
        )
        await started.wait()
        region_0 = regions[0].tier.coordinator
        assert region_0 is not None

        def top_peers() -> tuple[str, ...]:
            info = up.runs.coordinator.info(rid)
            return () if info is None else info.peers

        def region_0_peers() -> tuple[str, ...]:
            info = region_0.info(rid)
            return () if info is None else info.peers

        await until(lambda: top_peers() == ("region-1",) and len(region_0_peers()) == 3)
        clock.advance(95)  # region-0's deadline (0.9 of the top's 100 s): 3 of 4 is its quorum
        await until(lambda: set(top_peers()) == {"region-0", "region-1"})
        assert up.runs.run(RUN).version == 0  # 2 of 3 units: the top waits for its deadline
        clock.advance(10)  # the top's deadline: 2 of 3 units is its quorum
        counts = await asyncio.wait_for(work, 60)
        (_, final) = models(up.runs)
        versions = up.runs.versions(RUN)
    assert sorted(versions[1].participants) == ["region-0", "region-1"]
    assert counts == [1, 1, 1, 0, 1, 1, 1, 1, 0, 0, 0, 0]
    joined = [0, 1, 2, 4, 5, 6, 7]
    weights = np.array([10 + i for i in joined], dtype=np.float64)
    updates = [trained(i, initial(), 0)["w"].astype(np.float64) for i in joined]
    want = sum(w * u for w, u in zip(weights, updates, strict=True)) / weights.sum()
    np.testing.assert_allclose(final, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "spec",
    [
        RunSpec(mode="async", buffer=4, rounds=2, max_staleness=4),
        RunSpec(per_round=4, rounds=2, strategy="median"),
    ],
    ids=["fedbuff", "median"],
)
async def test_runs_that_do_not_fold_are_relayed_peer_by_peer(
    tmp_path: Path, spec: RunSpec
) -> None:
    async with AsyncExitStack() as stack:
        up = await stack.enter_async_context(top(tmp_path))
        regions = [
            await stack.enter_async_context(tier(tmp_path, f"region-{r}", up.server.port))
            for r in range(2)
        ]
        counts = await drive([rg.server.port for rg in regions], up.server.port, spec, peers=4)
        versions = up.runs.versions(RUN)
        folded = [rg.tier.stats().forwarded for rg in regions]
    assert [v.version for v in versions] == [0, 1, 2]
    assert sum(counts) >= 8
    # each peer's update went up on its own, under its own name: nothing folded regionally
    assert all(p.startswith("peer-") for v in versions[1:] for p in v.participants)
    assert folded == [0, 0]


async def test_a_secure_run_is_refused_at_a_region_with_the_reason(tmp_path: Path) -> None:
    pytest.importorskip("cryptography")
    async with AsyncExitStack() as stack:
        up = await stack.enter_async_context(top(tmp_path))
        rg = await stack.enter_async_context(tier(tmp_path, "region-0", up.server.port))
        peers = [
            await stack.enter_async_context(
                await RunClient.connect("127.0.0.1", rg.server.port, peer=f"peer-{i}")
            )
            for i in range(2)
        ]
        for peer in peers:
            await peer.register({"num_samples": 10})
        spec = RunSpec(per_round=2, min_clients=2, secagg=True, secagg_min_survivors=2)
        async with await RunClient.connect("127.0.0.1", up.server.port, peer="driver") as d:
            await d.create_run(RUN, spec, ModelUpdate(initial()))
        with pytest.raises(SecureRunThroughRegion, match="masks do not compose"):
            await peers[0].next_task(RUN, timeout=30)


@pytest.mark.parametrize("proven", [True, False])
async def test_a_top_with_per_peer_keys_takes_a_regions_fold_only_with_its_proof(
    tmp_path: Path, proven: bool
) -> None:
    key = b"region-0's own key"
    rid = RoundId(1, RUN)
    async with AsyncExitStack() as stack:
        up = await stack.enter_async_context(top(tmp_path, peer_keys=PeerKeys({"region-0": key})))
        rg = await stack.enter_async_context(
            tier(tmp_path, "region-0", up.server.port, peer_key=key if proven else None)
        )
        spec = RunSpec(per_round=2, rounds=1)
        work = asyncio.ensure_future(drive([rg.server.port], up.server.port, spec, peers=2))
        regional = rg.tier.coordinator
        assert regional is not None

        def ended() -> bool:
            status = regional.status(rid)
            return status is not None and status.is_terminal

        try:
            await until(ended)
            status = regional.status(rid)
            if proven:
                assert await asyncio.wait_for(work, 60) == [1, 1]
        finally:
            work.cancel()
        versions = up.runs.versions(RUN)
    if proven:
        assert isinstance(status, Complete)
        assert [v.participants for v in versions[1:]] == [("region-0",)]
    else:  # refused upstream, typed: the regional round fails with the reason
        assert isinstance(status, Failed) and "region-0" in status.reason, status
        assert len(versions) == 1
