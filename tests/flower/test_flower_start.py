"""A wrapped strategy whose class overrides ``Strategy.start`` keeps its override under
BlockStrategy, with the bridge still in effect for the calls that start makes on itself."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

flwr = pytest.importorskip("flwr")
from apps import SIMULATION_MARKS, simulate  # noqa: E402
from flwr.app import ArrayRecord  # noqa: E402
from flwr.serverapp import Grid  # noqa: E402
from flwr.serverapp.strategy import FedAvg, Result  # noqa: E402

from tensorswap.flower import BlockService, BlockStrategy  # noqa: E402

pytestmark = SIMULATION_MARKS

NODES = 2
BRIDGED = ("configure_train", "aggregate_train", "configure_evaluate", "aggregate_evaluate")


class TwoRoundsAlways(FedAvg):
    """Overrides ``start``: always 2 rounds, whatever is asked, and notes that it ran; also
    a ``configure_train`` of its own that counts its calls (reached through ``super()``)."""

    def __init__(self) -> None:
        super().__init__(min_available_nodes=NODES, min_train_nodes=NODES, min_evaluate_nodes=NODES)
        self.started: list[int] = []
        self.configured = 0

    def configure_train(self, *args: Any, **kwargs: Any) -> Any:
        self.configured += 1
        return super().configure_train(*args, **kwargs)

    def start(self, grid: Grid, initial_arrays: ArrayRecord, *args: Any, **kwargs: Any) -> Result:
        self.started.append(kwargs.pop("num_rounds", 3))
        return super().start(grid, initial_arrays, *args, num_rounds=2, **kwargs)


@pytest.mark.slow
def test_an_overridden_start_runs_with_the_bridge() -> None:
    plain_run = simulate(TwoRoundsAlways, None, nodes=NODES, rounds=1)
    with BlockService() as service:
        bridged_run = simulate(TwoRoundsAlways, service.address, nodes=NODES, rounds=1)
    strategy: BlockStrategy = bridged_run["strategy"]
    strategy.close()
    inner = strategy.strategy
    assert isinstance(inner, TwoRoundsAlways)
    assert inner.started == [1] and inner.configured == 2  # its start, its configure_train
    plain, bridged = plain_run["result"], bridged_run["result"]
    assert sorted(bridged.train_metrics_clientapp) == [1, 2]
    for key in plain.arrays:
        np.testing.assert_allclose(
            bridged.arrays[key].numpy(), plain.arrays[key].numpy(), rtol=1e-6, atol=1e-6
        )
    # the bridge was in effect: 2 rounds of train and evaluate messages carried references
    model_bytes = sum(array.numpy().nbytes for array in plain.arrays.values())
    assert strategy.bytes.referenced >= 2 * 3 * NODES * model_bytes  # train down+up, evaluate
    assert strategy.bytes.carried <= 0.01 * strategy.bytes.referenced, strategy.bytes
    assert not any(name in vars(inner) for name in BRIDGED)  # the instance restored


class FailingStart(FedAvg):
    """Overrides ``start``: sees the bridge on itself, then fails."""

    def start(self, grid: Grid, initial_arrays: ArrayRecord, *args: Any, **kwargs: Any) -> Result:
        self.seen = {name: name in vars(self) for name in BRIDGED}
        raise RuntimeError("start failed")


def test_the_instance_is_restored_when_an_overridden_start_fails() -> None:
    inner = FailingStart()
    with (
        BlockService() as service,
        BlockStrategy(inner, service.address) as strategy,
        pytest.raises(RuntimeError, match="start failed"),
    ):
        strategy.start(None, ArrayRecord())  # type: ignore[arg-type]
    assert inner.seen == dict.fromkeys(BRIDGED, True)
    assert not any(name in vars(inner) for name in BRIDGED)
