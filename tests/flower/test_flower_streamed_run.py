"""The streamed path inside a Flower run, where it must give way: a node that fails in round 2
(Flower aggregates the others; so does the service) and replies holding an int64 array in
round 3 (the service does not sum those as Flower does: that round is aggregated in the
ServerApp, logged). Arrays and metrics equal plain Flower's, as everywhere else."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

flwr = pytest.importorskip("flwr")
from apps import BACKEND, SIMULATION_MARKS, server_app  # noqa: E402
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402
from flwr.simulation import run_simulation  # noqa: E402

from tensorswap.flower import BlockService, BlockStrategy, blocks_mod  # noqa: E402

pytestmark = SIMULATION_MARKS

NODES, ROUNDS, FAILING = 4, 3, 1


def faulty_app(mods: list[Any]) -> ClientApp:
    """Node FAILING raises in round 2; in round 3 every reply adds an int64 array."""
    app = ClientApp(mods=mods)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        node = int(context.node_config["partition-id"])
        server_round = int(msg.content["config"]["server-round"])
        if node == FAILING and server_round == 2:
            raise RuntimeError(f"node {node} fails in round {server_round}")
        trained = {}
        for i, (name, array) in enumerate(msg.content["arrays"].items()):
            if name == "steps":
                continue
            rng = np.random.default_rng([node, server_round, i])
            values = array.numpy()
            trained[name] = Array(
                values + 0.1 * rng.standard_normal(values.shape).astype(values.dtype)
            )
        if server_round == 3:
            trained["steps"] = Array(np.full(3, node + server_round, np.int64))
        metrics = MetricRecord({"num-examples": 10 * (node + 1), "loss": float(node + 1)})
        return Message(
            RecordDict({"arrays": ArrayRecord(trained), "metrics": metrics}), reply_to=msg
        )

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        node = int(context.node_config["partition-id"])
        score = float(sum(np.abs(a.numpy()).sum() for a in msg.content["arrays"].values()))
        metrics = MetricRecord({"num-examples": node + 1, "score": score})
        return Message(RecordDict({"metrics": metrics}), reply_to=msg)

    return app


def fedavg() -> FedAvg:
    return FedAvg(min_available_nodes=NODES, min_train_nodes=NODES, min_evaluate_nodes=NODES)


def run(address: str | None) -> dict[str, Any]:
    results: dict[str, Any] = {}
    make: Any = fedavg if address is None else (lambda: BlockStrategy(fedavg(), address))
    mods = [] if address is None else [blocks_mod(address)]
    run_simulation(
        server_app(make, ROUNDS, results),
        faulty_app(mods),
        num_supernodes=NODES,
        backend_config=BACKEND,  # type: ignore[arg-type]
    )
    return results


@pytest.mark.slow
def test_failed_nodes_and_int_arrays_keep_flowers_results(caplog: pytest.LogCaptureFixture) -> None:
    plain = run(None)["result"]
    with caplog.at_level("WARNING", logger="tensorswap.flower"), BlockService() as service:
        bridged_run = run(service.address)
    strategy: BlockStrategy = bridged_run["strategy"]
    strategy.close()
    bridged = bridged_run["result"]
    assert strategy.streamed_rounds == 2  # rounds 1 and 2 (3 replies of 4); not round 3
    assert strategy.arrival_rounds == 1  # round 2's failed node never submitted: afresh
    assert any(
        "round 3: replies aggregated in this process: dtypes ['int64']" in r.getMessage()
        for r in caplog.records
    ), [r.getMessage() for r in caplog.records]
    assert list(bridged.arrays) == list(plain.arrays) == ["dense.w", "dense.b", "embed", "steps"]
    for key in plain.arrays:
        theirs = plain.arrays[key].numpy()
        ours = bridged.arrays[key].numpy()
        assert ours.dtype == theirs.dtype
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6)
    for what in ("train_metrics_clientapp", "evaluate_metrics_clientapp"):
        ours_m, theirs_m = getattr(bridged, what), getattr(plain, what)
        assert sorted(ours_m) == sorted(theirs_m) == list(range(1, ROUNDS + 1))
        for r in theirs_m:
            assert dict(ours_m[r]) == pytest.approx(dict(theirs_m[r]), rel=1e-6), (what, r)
