"""The block service's coordinator aggregating replies it already holds (the Flower bridge's
streamed path, ``tensorswap.flower.coordinated``): the weighted mean, joined again after a
retry, refusals as AggregateUnavailable. Needs no Flower."""

from __future__ import annotations

import numpy as np
import pytest

from tensorswap.flower import AggregateUnavailable, BlockLink, BlockService
from tensorswap.flower.coordinated import aggregate_held
from tensorswap.rounds.core.model import RoundId
from tensorswap.store import MemoryStore, ModelUpdate
from tensorswap.wire import BlockClient, BlockServer

WEIGHTS = [10, 20, 30]


def _updates() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(7)
    return [
        {
            "w": rng.standard_normal((300, 64)).astype(np.float32),
            "b": rng.standard_normal(7).astype(np.float64),
        }
        for _ in WEIGHTS
    ]


@pytest.fixture
def service() -> object:
    with BlockService() as running:
        yield running


def test_the_service_gives_the_weighted_mean_of_what_it_holds(service: BlockService) -> None:
    updates = _updates()
    with BlockLink(service.address) as nodes, BlockLink(service.address) as strategy:
        roots = [nodes.push(u, samples=n) for u, n in zip(updates, WEIGHTS, strict=True)]
        entries = [(f"node-{i}", root) for i, root in enumerate(roots)]
        cid, arrays = strategy.aggregate(RoundId(1, "run"), entries)
        assert strategy.counters.sent_bytes == 0  # nothing but requests went up
        for name in updates[0]:
            want = sum(u[name] * (n / sum(WEIGHTS)) for u, n in zip(updates, WEIGHTS, strict=True))
            assert arrays[name].dtype == updates[0][name].dtype
            np.testing.assert_allclose(arrays[name], want, rtol=1e-6, atol=1e-6)
        # made again (a retry after a broken connection): the same round, the same aggregate
        again, _ = strategy.aggregate(RoundId(1, "run"), entries)
        assert again == cid


def test_a_refused_contribution_is_aggregate_unavailable(service: BlockService) -> None:
    good, _, _ = _updates()
    bad = {"w": np.full((300, 64), np.nan, np.float32), "b": good["b"]}
    with BlockLink(service.address) as link:
        entries = [("node-0", link.push(good, samples=1)), ("node-1", link.push(bad, samples=1))]
        with pytest.raises(AggregateUnavailable, match=r"node-1.*InvalidUpdate") as caught:
            link.aggregate(RoundId(2, "run"), entries, timeout=30)
    assert caught.value.round == "2-run"


async def test_a_service_without_a_coordinator_is_aggregate_unavailable() -> None:
    store = MemoryStore()
    async with BlockServer(store) as server:
        await server.start("127.0.0.1", 0)
        async with await BlockClient.connect("127.0.0.1", server.port) as client:
            pushed = await client.push_update(ModelUpdate({"w": np.ones(4, np.float32)}, 1))
            root = pushed.roots[0]
            with pytest.raises(AggregateUnavailable, match="not a tensorswap coordinator"):
                await aggregate_held(
                    client, RoundId(1, "run"), [("node-0", root)], timeout=5, address="here"
                )
