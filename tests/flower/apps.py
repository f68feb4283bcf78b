"""A small numpy Flower app for the bridge's tests: a deterministic "training" per node, a
ServerApp running a given strategy for some rounds and keeping its Result."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Strategy


def initial_model(floats: int = 64 * 1024) -> ArrayRecord:
    rng = np.random.default_rng(0)
    return ArrayRecord(
        {
            "dense.w": Array(rng.standard_normal((floats // 64, 64)).astype(np.float32)),
            "dense.b": Array(rng.standard_normal(64).astype(np.float32)),
            "embed": Array(rng.standard_normal(floats // 2).astype(np.float32)),
        }
    )


def client_app(mods: list[Any]) -> ClientApp:
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
    make_strategy: Callable[[], Strategy], rounds: int, results: dict[str, Any]
) -> ServerApp:
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = make_strategy()
        results["strategy"] = strategy
        results["result"] = strategy.start(grid, initial_model(), num_rounds=rounds)

    return app
