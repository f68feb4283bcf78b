"""A run's coordinator memory: 8 peers, 4 sampled per round, 20 rounds (fedadam, or
``--optimizer``); the
`tensorswap serve` process's peak RSS growth as a multiple of one update. Goal <= 3x (the
streaming fold holds one model of sums; the optimizer step holds the global model, the
aggregate, its state and the new model, a few models at most, then lets them go)."""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.__main__ import ratio_line
from benchmarks.bench_rounds import Coordinator
from tensorswap.runs import RunSpec, sample_peers
from tensorswap.runs.client import RunClient
from tensorswap.runs.manager import Task

MiB = 1 << 20


async def _train(client: RunClient, task: Task | None, step: np.float32) -> None:
    assert task is not None
    model = await client.fetch_model(task)
    await client.submit(task, {k: v + step for k, v in model.items()}, 100)


async def _federation(
    port: int, peers: int, per_round: int, rounds: int, nbytes: int, optimizer: str, dp: bool
) -> float:
    names = tuple(f"p{i}" for i in range(peers))
    clients = [await RunClient.connect("127.0.0.1", port, peer=n) for n in names]
    try:
        for client in clients:
            await client.register({"num_samples": 100})
        rng = np.random.default_rng(0)
        initial = {
            "w": rng.standard_normal(nbytes // 8, dtype=np.float32),
            "b": rng.standard_normal(nbytes // 8, dtype=np.float32),
        }
        private = {"dp_clip": 1000.0, "dp_noise": 0.5} if dp else {}
        spec = RunSpec(per_round=per_round, rounds=rounds, seed=1, optimizer=optimizer, **private)
        await clients[0].create_run("mem", spec, initial)
        loop = asyncio.get_running_loop()
        start = loop.time()
        for number in range(1, rounds + 1):
            chosen = [c for c in clients if c.peer in sample_peers(names, per_round, 1, number)]
            tasks = await asyncio.gather(*(c.next_task("mem", timeout=120) for c in chosen))

            step = np.float32(0.01 * number)
            await asyncio.gather(*(_train(c, t, step) for c, t in zip(chosen, tasks, strict=True)))
        assert await clients[0].next_task("mem", timeout=120) is None
        return loop.time() - start
    finally:
        for client in clients:
            await client.aclose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a 2 MiB model, 5 rounds (64 MiB, 20)")
    parser.add_argument("--optimizer", default="fedadam", help="the run's server optimizer")
    parser.add_argument("--rounds", type=int, help="rounds (default 20; 5 with --quick)")
    parser.add_argument("--dp", action="store_true", help="a differentially private run")
    args = parser.parse_args(argv)
    nbytes, rounds = (2 * MiB, 5) if args.quick else (64 * MiB, 20)
    rounds = args.rounds or rounds
    with tempfile.TemporaryDirectory(prefix="bench-runs-") as tmp:
        server = Coordinator(Path(tmp) / "data")
        try:
            base, _ = server.memory()
            server.reset_peak()
            seconds = asyncio.run(
                _federation(server.port, 8, 4, rounds, nbytes, args.optimizer, args.dp)
            )
            _, peak = server.memory()
        finally:
            server.stop()
    growth = (peak - base) / nbytes
    print(
        f"run: 8 peers, 4 per round, {rounds} rounds of a {nbytes // MiB} MiB model, "
        f"{args.optimizer}{' with DP' if args.dp else ''}"
    )
    print(f"  {seconds:.1f} s, {seconds / rounds:.2f} s per round")
    print(f"  coordinator RSS {base / MiB:.0f} MiB -> peak {peak / MiB:.0f} MiB")
    print(f"  peak growth: {growth:.2f}x one update (goal <= 3x)")
    print(ratio_line("run_peak_rss_per_update", growth, "<=", 3))
    return 0 if growth <= 3 else 1


if __name__ == "__main__":
    sys.exit(main())
