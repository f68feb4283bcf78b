"""Flower's side of bench_wan: a Flower 1.42 server or client, run by Flower's own interpreter.

Not a benchmark module (no ``bench_`` prefix) and never imported by tensorswap: bench_wan
starts it with ``--flower-python`` (a virtual environment holding flwr==1.42.0) inside the
lab's hosts. The server runs FedAvg over gRPC with an 8 MiB initial model, ``rounds`` rounds
of ``peers`` clients, no evaluation, and prints one ``ROUND <seconds>`` line per round: from
the moment the clients are sampled (all connected) to the end of aggregation, so a round is
the model sent down to each client, each client's 8 MiB update sent up, and FedAvg.
bench_round_loopback runs it too, on 127.0.0.1, with ``fixed`` clients: their noise is
drawn once at start instead of in every fit, so that a round times no random numbers
(drawing 64 MiB of them costs about 0.4 s of CPU here).

    python _flower_wan.py server ADDRESS PORT PEERS ROUNDS NBYTES
    python _flower_wan.py client ADDRESS PORT NBYTES SEED [fixed]
"""

from __future__ import annotations

import sys
import time
from typing import Any

import flwr
import numpy as np
from flwr.server.strategy import FedAvg


class TimedFedAvg(FedAvg):  # type: ignore[misc]
    """FedAvg that prints how long each round took, sampling to aggregation."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.began = 0.0

    def configure_fit(self, server_round: int, parameters: Any, client_manager: Any) -> Any:
        chosen = super().configure_fit(server_round, parameters, client_manager)
        self.began = time.perf_counter()
        return chosen

    def aggregate_fit(self, server_round: int, results: Any, failures: Any) -> Any:
        aggregated = super().aggregate_fit(server_round, results, failures)
        print(f"ROUND {time.perf_counter() - self.began:.6f}", flush=True)
        return aggregated


class Peer(flwr.client.NumPyClient):  # type: ignore[misc]
    def __init__(self, nbytes: int, seed: int, fixed: bool = False) -> None:
        self.rng = np.random.default_rng(seed)
        self.floats = nbytes // 4
        self.noise = self.rng.standard_normal(self.floats, np.float32) if fixed else None

    def get_parameters(self, config: Any) -> list[np.ndarray]:
        return [self.rng.standard_normal(self.floats, np.float32)]

    def fit(self, parameters: list[np.ndarray], config: Any) -> Any:
        noise = self.noise
        if noise is None:
            noise = self.rng.standard_normal(self.floats, np.float32)
        update = parameters[0] + noise
        return [update], 1, {}


def main(argv: list[str]) -> int:
    role, address, port = argv[0], argv[1], int(argv[2])
    if role == "server":
        peers, rounds, nbytes = int(argv[3]), int(argv[4]), int(argv[5])
        initial = np.random.default_rng(0).standard_normal(nbytes // 4, np.float32)
        strategy = TimedFedAvg(
            fraction_fit=1.0,
            fraction_evaluate=0.0,
            min_fit_clients=peers,
            min_available_clients=peers,
            min_evaluate_clients=0,
            initial_parameters=flwr.common.ndarrays_to_parameters([initial]),
        )
        print(f"listening on {address}:{port}", file=sys.stderr, flush=True)
        flwr.server.start_server(
            server_address=f"{address}:{port}",
            config=flwr.server.ServerConfig(num_rounds=rounds),
            strategy=strategy,
        )
        return 0
    nbytes, seed, fixed = int(argv[3]), int(argv[4]), argv[5:] == ["fixed"]
    flwr.client.start_client(
        server_address=f"{address}:{port}",
        client=Peer(nbytes, seed, fixed).to_client(),
        insecure=True,
        max_retries=100,
        max_wait_time=60,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
