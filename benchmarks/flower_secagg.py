"""Flower 1.42's SecAgg+ workflow on the shape of bench_secagg (run in the flwr venv only).

`python benchmarks/flower_secagg.py --peers 8 --dim 1048576` with the Python of a venv holding
``flwr[simulation]==1.42.0`` (never a tensorswap dependency): Flower's simulation engine, 8
supernodes, a FedAvg strategy sampling all of them, the ``DefaultWorkflow`` with
``SecAggPlusWorkflow`` as its fit workflow (num_shares = k + 1 = 7, threshold 4: the same
graph degree and threshold as tensorswap's defaults for 8 peers) and ``secaggplus_mod`` on
the clients, whose ``fit`` returns the global model plus a step. Prints the median seconds
of the SecAgg+ fit stage of each round after the first (``ROUND_SECONDS x``; the first also
starts the engine's workers; evaluation is off).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from flwr.client import ClientApp, NumPyClient
from flwr.client.mod import secaggplus_mod
from flwr.common import Context, ndarrays_to_parameters
from flwr.server import Grid, LegacyContext, ServerApp, ServerConfig
from flwr.server.strategy import FedAvg
from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
from flwr.simulation import run_simulation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--peers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=1 << 20)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    initial = [np.random.default_rng(0).standard_normal(args.dim).astype(np.float32) * 0.1]
    times: list[float] = []

    class Peer(NumPyClient):  # type: ignore[misc]
        def __init__(self, index: int) -> None:
            self.step = np.float32(0.001 * (index + 1))  # each peer's own update

        def fit(self, parameters, config):  # type: ignore[no-untyped-def]
            return [p + self.step for p in parameters], 100, {}

    def client_fn(context: Context):  # type: ignore[no-untyped-def]
        return Peer(int(context.node_config["partition-id"])).to_client()

    class Timed(SecAggPlusWorkflow):  # type: ignore[misc]
        def __call__(self, grid, context):  # type: ignore[no-untyped-def]
            start = time.perf_counter()
            super().__call__(grid, context)
            times.append(time.perf_counter() - start)

    server = ServerApp()

    @server.main()  # type: ignore[misc]
    def run(grid: Grid, context: Context) -> None:
        strategy = FedAvg(
            fraction_fit=1.0,
            min_fit_clients=args.peers,
            min_available_clients=args.peers,
            fraction_evaluate=0.0,
            initial_parameters=ndarrays_to_parameters(initial),
        )
        legacy = LegacyContext(
            context=context, config=ServerConfig(num_rounds=args.rounds), strategy=strategy
        )
        fit = Timed(num_shares=7, reconstruction_threshold=4, clipping_range=0.5)
        DefaultWorkflow(fit_workflow=fit)(grid, legacy)

    client = ClientApp(client_fn=client_fn, mods=[secaggplus_mod])
    run_simulation(
        server_app=server,
        client_app=client,
        num_supernodes=args.peers,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
    )
    print(f"rounds {[round(t, 3) for t in times]}")
    warm = times[1:] or times  # the first round also starts the engine's workers
    print(f"ROUND_SECONDS {statistics.median(warm):.4f}")


if __name__ == "__main__":
    main()
