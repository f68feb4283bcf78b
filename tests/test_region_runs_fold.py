"""A sync run through regions: each region folds the peers the top sampled into one
contribution per round, so 3 regions x 4 peers give the flat 12-peer run's global models,
and the upstream link carries one model per region per direction per round."""

from __future__ import annotations

from contextlib import AsyncExitStack
from pathlib import Path

import numpy as np
import pytest

from helpers.region_runs import MODEL_BYTES, RUN, drive, models, tier, top
from tensorswap.runs import RunSpec

ROUNDS = 3


@pytest.mark.parametrize(
    ("optimizer", "per_round"), [("fedavg", 12), ("fedadam", 8), ("fedavgm", 5)]
)
async def test_three_regions_of_four_give_the_flat_runs_global_models(
    tmp_path: Path, optimizer: str, per_round: int
) -> None:
    spec = RunSpec(per_round=per_round, rounds=ROUNDS, seed=3, optimizer=optimizer)
    async with top(tmp_path, "flat") as flat:
        await drive([flat.server.port], flat.server.port, spec)
        flat_models = models(flat.runs)
        flat_versions = flat.runs.versions(RUN)
    async with AsyncExitStack() as stack:
        up = await stack.enter_async_context(top(tmp_path))
        regions = [
            await stack.enter_async_context(tier(tmp_path, f"region-{r}", up.server.port))
            for r in range(3)
        ]
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
