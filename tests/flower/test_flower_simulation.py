"""Flower's own FedAvg and FedAdam through run_simulation (4 nodes, 3 rounds) with and without
the bridge: equal arrays (to 1e-6) and equal metrics; with it the messages carry <= 1% of the
arrays' bytes, and the block service aggregates every round's replies (streamed: the strategy
fetches one aggregate a round, not four replies; after FedAvg's first round it pushes no
model again, the aggregate being the next global model)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

flwr = pytest.importorskip("flwr")
from apps import SIMULATION_MARKS, simulate  # noqa: E402
from flwr.serverapp.strategy import FedAdam, FedAvg, Strategy  # noqa: E402

from tensorswap.flower import BlockService  # noqa: E402

pytestmark = SIMULATION_MARKS

NODES, ROUNDS = 4, 3
MODEL_BYTES = 4 * (64 * 1024 + 64 + 32 * 1024)  # apps.initial_model: 98,368 float32 values

# Flower sizes a round's sample from the nodes connected *before* it waits for
# min_available_nodes (FedAvg.configure_train), so with the defaults an early round may train on
# 2 random nodes of 4. Every node in every round makes the two runs comparable.
EVERY_NODE = {"min_available_nodes": NODES, "min_train_nodes": NODES, "min_evaluate_nodes": NODES}
STRATEGIES: dict[str, Callable[[], Strategy]] = {
    "fedavg": lambda: FedAvg(**EVERY_NODE),
    "fedadam": lambda: FedAdam(**EVERY_NODE, eta=0.05),
}
# Flower folds replies in arrival order under Ray: float32 sums differ by a few ulps run to run
# (FedAdam's division by sqrt(v) amplifies them to ~2e-6), with or without the bridge.
TOLERANCE = {"fedavg": 1e-6, "fedadam": 1e-5}


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    ["fedavg", "fedadam"],
)
def test_the_bridge_changes_no_result(name: str) -> None:
    plain = simulate(STRATEGIES[name], None, nodes=NODES, rounds=ROUNDS)["result"]
    with BlockService() as service:
        bridged_run = simulate(STRATEGIES[name], service.address, nodes=NODES, rounds=ROUNDS)
    bridged = bridged_run["result"]
    strategy = bridged_run["strategy"]
    strategy.close()
    assert list(bridged.arrays) == list(plain.arrays)
    for key in plain.arrays:
        np.testing.assert_allclose(
            bridged.arrays[key].numpy(),
            plain.arrays[key].numpy(),
            rtol=TOLERANCE[name],
            atol=TOLERANCE[name],
        )
    for what in ("train_metrics_clientapp", "evaluate_metrics_clientapp"):
        ours, theirs = getattr(bridged, what), getattr(plain, what)
        assert sorted(ours) == sorted(theirs) == list(range(1, ROUNDS + 1))
        for r in theirs:
            # evaluate metrics are computed from the arrays, so they carry the arrays' tolerance
            assert dict(ours[r]) == pytest.approx(dict(theirs[r]), rel=TOLERANCE[name]), (what, r)
    assert strategy.bytes.referenced > 0
    assert strategy.bytes.carried <= 0.01 * strategy.bytes.referenced, strategy.bytes
    counters = strategy.link.counters
    assert strategy.streamed_rounds == counters.aggregates == ROUNDS
    assert strategy.arrival_rounds == ROUNDS  # every reply submitted by its mod as it replied
    # one aggregate a round came to the strategy (plain bridge: the 4 replies), manifests
    # aside; FedAdam's step makes the model float64 from round 1 on (numpy's float64 scalars)
    result_bytes = sum(array.numpy().nbytes for array in bridged.arrays.values())
    assert ROUNDS * MODEL_BYTES <= counters.fetched_bytes <= 1.05 * ROUNDS * result_bytes
    if name == "fedavg":  # the initial model only: each later one was the service's aggregate
        assert MODEL_BYTES <= counters.sent_bytes <= 1.05 * MODEL_BYTES, counters
