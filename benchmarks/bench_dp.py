"""DP overhead per round: a differentially private run against a plain run of the same shape.

`tensorswap serve` on loopback; 8 registered peers (in this process, one asyncio loop), 4
sampled per round, a 64 MiB model (two float32 tensors), ``fedadam``: a plain run and a DP
run (``dp_clip``, ``dp_noise``: server-side clipping, Gaussian noise on the mean, ε
accounted) in the same server, their rounds alternating (plain 1, DP 1, plain 2, ...) so
both see the same machine load, the same peer code (``next_task`` / ``fetch_model`` /
``submit``; a DP peer's submit takes its delta from the task's model). Each round's time
runs from the tasks to the new version. Goal: DP round <= 1.5x the plain one (medians);
every pair's ratio is printed too.
"""

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
GOAL = 1.5


async def _train(client: RunClient, task: Task | None, step: np.float32) -> None:
    assert task is not None
    model = await client.fetch_model(task)
    await client.submit(task, {k: v + step for k, v in model.items()}, 100)


async def _round(clients: list[RunClient], run: str, number: int, per_round: int) -> float:
    """Seconds of round ``number`` of ``run``: the sampled peers' tasks, training and submits,
    until the version it makes exists."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    names = [c.peer for c in clients]
    chosen = [c for c in clients if c.peer in sample_peers(names, per_round, 1, number)]
    tasks = await asyncio.gather(*(c.next_task(run, timeout=300) for c in chosen))
    step = np.float32(0.01 * number)
    await asyncio.gather(*(_train(c, t, step) for c, t in zip(chosen, tasks, strict=True)))
    while (await clients[0].run(run)).version < number:
        await clients[0].next_task(run, timeout=0.02)  # wakes when the version is made
    return loop.time() - start


async def _interleaved(
    port: int, peers: int, per_round: int, nbytes: int, rounds: int, optimizer: str
) -> dict[str, list[float]]:
    clients = [await RunClient.connect("127.0.0.1", port, peer=f"p{i}") for i in range(peers)]
    try:
        for client in clients:
            await client.register({"num_samples": 100})
        rng = np.random.default_rng(0)
        initial = {
            "w": rng.standard_normal(nbytes // 8, dtype=np.float32),
            "b": rng.standard_normal(nbytes // 8, dtype=np.float32),
        }
        common = {"per_round": per_round, "rounds": rounds, "seed": 1, "optimizer": optimizer}
        await clients[0].create_run("plain", RunSpec(**common), initial)  # type: ignore[arg-type]
        private = RunSpec(dp_clip=1000.0, dp_noise=0.5, **common)  # type: ignore[arg-type]
        await clients[0].create_run("dp", private, initial)
        times: dict[str, list[float]] = {"plain": [], "dp": []}
        for number in range(1, rounds + 1):
            for run, kept in times.items():
                kept.append(await _round(clients, run, number, per_round))
        return times
    finally:
        for client in clients:
            await client.aclose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a 2 MiB model (default 64 MiB)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per run (median)")
    parser.add_argument("--optimizer", default="fedadam", help="both runs' server optimizer")
    args = parser.parse_args(argv)
    nbytes = 2 * MiB if args.quick else 64 * MiB
    with tempfile.TemporaryDirectory(prefix="bench-dp-") as tmp:
        server = Coordinator(Path(tmp) / "data", "--inactive-after", "3600")
        try:
            run = _interleaved(server.port, 8, 4, nbytes, args.rounds, args.optimizer)
            times = asyncio.run(run)
        finally:
            server.stop()
    plain, dp = times["plain"], times["dp"]
    pairs = [d / p for p, d in zip(plain, dp, strict=True)]
    ratio = float(np.median(dp)) / float(np.median(plain))
    print(
        f"round, 8 peers, 4 sampled, a {nbytes // MiB} MiB model, {args.optimizer}, loopback "
        f"(median of {args.rounds}, rounds interleaved):"
    )
    print(f"  plain  {' '.join(f'{t:.3f}' for t in plain)} s")
    print(f"  DP     {' '.join(f'{t:.3f}' for t in dp)} s")
    print(f"  pairs  {' '.join(f'{r:.2f}' for r in pairs)}x")
    print(
        f"  plain {np.median(plain):.3f} s, DP {np.median(dp):.3f} s: {ratio:.2f}x "
        f"(goal <= {GOAL}x)"
    )
    print(ratio_line("dp_round_vs_plain", ratio, "<=", GOAL))
    return 0 if ratio <= GOAL else 1


if __name__ == "__main__":
    sys.exit(main())
