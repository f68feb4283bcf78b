"""The baseline of bench_simulate: the same workload on Flower's simulation engine (Ray).

Run with a Python that has ``flwr[simulation]`` (not tensorswap's venv)::

    .venv-flower/bin/python benchmarks/flower_simulate.py \\
        --clients 1000 --per-round 100 --rounds 5 --model-mib 1 --workers 2

The task is tensorswap's synthetic task (``tensorswap.simulate.task.SyntheticTask``),
written out again here because tensorswap is not installed beside Flower: one float32
``weight`` of shape (rows, 256), client ``i``'s target ``c*`` plus a window of one shared
noise array (both drawn from ``default_rng([seed, 0x5EED])``) at offset
``(i * 7919 + 17) % 65536``, ``epochs`` gradient steps of size ``lr`` on
``0.5 * mean((w - c)^2)``, FedAvg weighted by ``16 + (i * 7919) % 64`` samples, the loss of
the global model ``0.5 * mean((w - c*)^2)`` evaluated on the server after each round (as
tensorswap's driver does). Flower's FedAvg (the Message API) samples ``per_round / clients``
of the nodes per round; no federated evaluation. Prints one JSON line: the seconds of each
round (between the server's evaluations, as tensorswap measures them), the losses, the
total wall time.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import numpy as np

COLUMNS = 256
NOISE_OFFSETS = 1 << 16


def _shape(model_mib: float) -> tuple[int, int]:
    return (max(1, round(model_mib * 1024 * 1024 / 4 / COLUMNS)), COLUMNS)


def _optimum_and_noise(shape: tuple[int, int], seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([seed, 0x5EED])
    optimum = rng.standard_normal(shape, dtype=np.float32)
    noise = rng.standard_normal(shape[0] * shape[1] + NOISE_OFFSETS, dtype=np.float32)
    return optimum, noise


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--per-round", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model-mib", type=float, default=1.0)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    started = time.perf_counter()

    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation

    shape = _shape(args.model_mib)
    seed, epochs, lr = args.seed, args.epochs, np.float32(args.lr)

    def shared() -> tuple[np.ndarray, np.ndarray]:
        """c* and the noise, drawn once per actor process (as a tensorswap worker does).

        Kept in a module of the actor's own ``sys.modules``: Flower hands the ClientApp to
        its actors anew with every message (pickled by Ray), so a closure would not keep it.
        """
        import types

        cache = vars(sys.modules.setdefault("_flower_simulate_cache", types.ModuleType("c")))
        if "arrays" not in cache:
            cache["arrays"] = _optimum_and_noise(shape, seed)
        arrays: tuple[np.ndarray, np.ndarray] = cache["arrays"]
        return arrays

    client_app = ClientApp()

    @client_app.train()
    def train(msg: Message, context: Context) -> Message:
        index = int(context.node_config["partition-id"])
        w = np.array(msg.content["arrays"].to_numpy_ndarrays()[0], dtype=np.float32)
        optimum, noise = shared()
        at = (index * 7919 + 17) % NOISE_OFFSETS
        c = optimum + noise[at : at + optimum.size].reshape(shape)
        losses = []
        for _ in range(epochs):
            diff = w - c
            losses.append(0.5 * float(np.mean(np.square(diff))))
            diff *= lr
            w -= diff
        samples = 16 + (index * 7919) % 64
        metrics = MetricRecord({"num-examples": samples, "train_loss": float(np.mean(losses))})
        content = RecordDict({"arrays": ArrayRecord([w]), "metrics": metrics})
        return Message(content=content, reply_to=msg)

    marks: list[float] = []
    losses: list[float] = []
    optimum = _optimum_and_noise(shape, seed)[0]
    server_app = ServerApp()

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        w = arrays.to_numpy_ndarrays()[0]
        loss = 0.5 * float(np.mean(np.square(w - optimum)))
        losses.append(loss)
        marks.append(time.perf_counter())
        return MetricRecord({"loss": loss})

    @server_app.main()
    def server_main(grid: Grid, context: Context) -> None:
        strategy = FedAvg(
            fraction_train=args.per_round / args.clients,
            fraction_evaluate=0.0,
            min_train_nodes=args.per_round,
            min_available_nodes=args.clients,
        )
        strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord([np.zeros(shape, np.float32)]),
            num_rounds=args.rounds,
            evaluate_fn=evaluate,
        )

    run_simulation(
        server_app=server_app,
        client_app=client_app,
        num_supernodes=args.clients,
        backend_config={
            "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
            "init_args": {"num_cpus": args.workers, "include_dashboard": False},
        },
    )
    rounds = [b - a for a, b in itertools.pairwise(marks)]
    print(
        json.dumps(
            {
                "round_seconds": rounds,
                "losses": losses,
                "total_s": time.perf_counter() - started,
            }
        ),
        flush=True,
    )
    return 0 if len(rounds) == args.rounds else 1


if __name__ == "__main__":
    sys.exit(main())
