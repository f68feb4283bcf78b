"""The test ServerApp: FedAvg over every node, wrapped in BlockStrategy when the run config
names a block service; the final arrays (npz) and the message bytes (json) written to out."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from apps import initial_model
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg, Strategy

from tensorswap.flower import BlockStrategy

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    config = context.run_config
    nodes = int(config["nodes"])
    address, out = str(config["blocks"]), Path(str(config["out"]))
    strategy: Strategy = FedAvg(
        min_available_nodes=nodes, min_train_nodes=nodes, min_evaluate_nodes=nodes
    )
    if address:
        strategy = BlockStrategy(strategy, address)
    result = strategy.start(grid, initial_model(), num_rounds=int(config["rounds"]))
    np.savez(out / "arrays.npz", **{key: array.numpy() for key, array in result.arrays.items()})
    if isinstance(strategy, BlockStrategy):
        counted = {"carried": strategy.bytes.carried, "referenced": strategy.bytes.referenced}
        (out / "bytes.json").write_text(json.dumps(counted))
        strategy.close()
