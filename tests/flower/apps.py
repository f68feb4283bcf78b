"""A small numpy Flower app for the bridge's tests: a deterministic "training" per node, a
ServerApp running a given strategy for some rounds and keeping its Result, and ``simulate``
(both through ``run_simulation``, with or without the bridge)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Strategy
from flwr.simulation import run_simulation

from tensorswap.flower import BlockStrategy, blocks_mod
from tensorswap.flower.mod import shared_link

# Ray's own processes leave /dev/null handles and deprecation notes behind: not ours.
SIMULATION_MARKS = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
    pytest.mark.timeout(600),
]
"""``pytestmark`` of a test module that runs Flower simulations on Ray."""

BACKEND = {"client_resources": {"num_cpus": 1}, "init_args": {"num_cpus": 2}}


def initial_model(floats: int = 64 * 1024) -> ArrayRecord:
    rng = np.random.default_rng(0)
    return ArrayRecord(
        {
            "dense.w": Array(rng.standard_normal((floats // 64, 64)).astype(np.float32)),
            "dense.b": Array(rng.standard_normal(64).astype(np.float32)),
            "embed": Array(rng.standard_normal(floats // 2).astype(np.float32)),
        }
    )


def client_app(mods: list[Any], report_link: str | None = None) -> ClientApp:
    """``report_link``: the train replies' metrics carry this process's link counters for that
    block service so far: ``from-peers`` (bytes had from swarm peers), ``retries`` (calls made
    again on a fresh connection) and ``sent-blocks``."""
    app = ClientApp(mods=mods)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        node = int(context.node_config["partition-id"])
        server_round = int(msg.content["config"]["server-round"])
        arrays = msg.content["arrays"]
        trained = {}
        for i, (name, array) in enumerate(arrays.items()):
            values = array.numpy()
            rng = np.random.default_rng([node, server_round, i])
            values += 0.1 * rng.standard_normal(values.shape).astype(values.dtype)
            trained[name] = Array(values)
        metrics = MetricRecord(
            {"num-examples": 10 * (node + 1), "loss": float(node + 1) / server_round}
        )
        if report_link is not None:
            counters = shared_link(report_link).counters
            metrics["from-peers"] = counters.from_peers
            metrics["retries"] = counters.retries
            metrics["sent-blocks"] = counters.sent_blocks
        return Message(
            RecordDict({"arrays": ArrayRecord(trained), "metrics": metrics}), reply_to=msg
        )

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        node = int(context.node_config["partition-id"])
        arrays = msg.content["arrays"]
        score = float(sum(np.abs(a.numpy()).sum() for a in arrays.values()))
        metrics = MetricRecord({"num-examples": 5 * (node + 1), "score": score})
        return Message(RecordDict({"metrics": metrics}), reply_to=msg)

    return app


def server_app(
    make_strategy: Callable[[], Strategy],
    rounds: int,
    results: dict[str, Any],
    floats: int = 64 * 1024,
) -> ServerApp:
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = make_strategy()
        results["strategy"] = strategy
        results["result"] = strategy.start(grid, initial_model(floats), num_rounds=rounds)

    return app


def simulate(
    make: Callable[[], Strategy],
    address: str | None,
    *,
    nodes: int,
    rounds: int,
    floats: int = 64 * 1024,
    swarm: bool = True,
    report_link: bool = False,
    client_address: str | None = None,
) -> dict[str, Any]:
    """One ``run_simulation`` (Ray, 2 workers of 1 CPU) of ``make()``'s strategy: plain when
    ``address`` is None, else wrapped in a BlockStrategy and the ClientApp given the mod
    (pointed at ``client_address`` when given: a proxy in front of the same service).
    The dict holds the ``strategy`` and its ``result``."""
    results: dict[str, Any] = {}
    if address is None:
        strategy, mods = make, []
    else:
        strategy = lambda: BlockStrategy(make(), address, swarm=swarm)  # noqa: E731
        client_address = client_address or address
        mods = [blocks_mod(client_address)]
    run_simulation(
        server_app(strategy, rounds, results, floats),
        client_app(mods, (client_address or address) if report_link else None),
        num_supernodes=nodes,
        backend_config=BACKEND,  # type: ignore[arg-type]
    )
    return results
