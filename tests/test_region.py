"""Hierarchical aggregation in one process: regional partials compose into the flat result,
and the upstream link carries one update per region per direction."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from helpers.region import GROUPS, RID, SIZE, flat_round, network, region_round, start, values
from tensorswap.rounds.core import Complete, RoundSpec


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
