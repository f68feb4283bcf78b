"""A federated run through regions over loopback: 4 regions x 8 peers vs 32 peers flat.

A sync FedAvg run of ``--rounds`` versions; every round samples all 32 peers, each
trains (adds its own random values to the global model, so every chunk is a distinct
block) and submits an ``--mib`` MiB model. Flat: the 32 peers work through one `tensorswap
serve`. Hierarchy: a top `tensorswap serve` (where the run, its sampling and its server
optimizer live) and 4 regional ones (`--upstream`), 8 peers each; each region folds its
peers' updates into one contribution per round and pulls each new global model once.
Reported:

- time per round (run created -> last version made, / rounds), hierarchy / flat, per rep;
- bytes on the top coordinator's links (in + out, its wire counters), hierarchy / flat:
  4/32 = 0.125 per round (one model up and one down per region per round, not per peer);
  over a whole run of R rounds (8 R + 5) / (64 R + 1) of the models moved: the
  initial model goes up once in both, and each region also pulls the final model once
  (its peers ask for the finished run), which flat peers do not fetch here.

All 5 or 6 processes and the 32 peers share this machine's cores (2 here): the time ratio
is what the extra hop costs on one box, not what it saves on a real network.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.__main__ import ratio_line
from benchmarks.bench_rounds import Coordinator
from tensorswap.rounds.client import RoundClient
from tensorswap.runs import RunSpec
from tensorswap.runs.client import RunClient
from tensorswap.store import ModelUpdate

MiB = 1024 * 1024


async def top_bytes(port: int) -> int:
    async with await RoundClient.connect("127.0.0.1", port, peer="bench-stats") as client:
        stats = (await client.server_status()).stats
    return int(stats["bytes_in"]) + int(stats["bytes_out"])


async def one_run(
    top: int, ports: list[int], per_port: int, nbytes: int, rounds: int, name: str
) -> tuple[float, int]:
    """(seconds per round, bytes on the top coordinator's links) of run ``name``."""
    clients = [
        await RunClient.connect("127.0.0.1", port, peer=f"{name}-{r}-{i}")
        for r, port in enumerate(ports)
        for i in range(per_port)
    ]
    try:
        for k, client in enumerate(clients):
            await client.register({"num_samples": 1 + k})
        noise = [
            np.random.default_rng([k, len(name)]).standard_normal(nbytes // 4, dtype=np.float32)
            for k in range(len(clients))
        ]
        initial = ModelUpdate({"w": np.zeros(nbytes // 4, dtype=np.float32)})
        before = await top_bytes(top)

        async def work(k: int, client: RunClient) -> None:
            while (task := await client.next_task(name, timeout=600)) is not None:
                model = await client.fetch_model(task)
                new = {"w": model["w"] + noise[k] * np.float32(1.0 / (1 + task.version))}
                await client.submit(task, new, 1 + k)

        start = time.perf_counter()
        spec = RunSpec(rounds=rounds, min_clients=len(clients))
        async with await RunClient.connect("127.0.0.1", top, peer=f"{name}-driver") as driver:
            await driver.create_run(name, spec, initial)
        await asyncio.gather(*(work(k, c) for k, c in enumerate(clients)))
        seconds = (time.perf_counter() - start) / rounds
        return seconds, await top_bytes(top) - before
    finally:
        for client in clients:
            await client.aclose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="4 regions x 8 peers x 1 MiB")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--regions", type=int, default=4)
    parser.add_argument("--per-region", type=int, default=8)
    parser.add_argument("--mib", type=int, default=8)
    args = parser.parse_args(argv)
    regions, per = args.regions, args.per_region
    nbytes = (1 if args.quick else args.mib) * MiB
    reps, rounds = (1, 2) if args.quick else (args.reps, args.rounds)
    flat_t, hier_t, flat_b, hier_b = [], [], [], []
    for rep in range(reps):  # fresh processes per rep: each run's peers register anew
        with tempfile.TemporaryDirectory(prefix="bench-hierarchy-runs-") as tmp:
            procs: list[Coordinator] = []
            try:
                flat = Coordinator(Path(tmp) / "flat")
                procs.append(flat)
                top = Coordinator(Path(tmp) / "top")
                procs.append(top)
                ports = []
                for r in range(regions):
                    up = ("--upstream", f"127.0.0.1:{top.port}", "--region", f"region-{r}")
                    procs.append(Coordinator(Path(tmp) / f"region-{r}", *up))
                    ports.append(procs[-1].port)
                seconds, moved = asyncio.run(
                    one_run(flat.port, [flat.port], regions * per, nbytes, rounds, f"flat{rep}")
                )
                flat_t.append(seconds)
                flat_b.append(moved)
                seconds, moved = asyncio.run(
                    one_run(top.port, ports, per, nbytes, rounds, f"hier{rep}")
                )
                hier_t.append(seconds)
                hier_b.append(moved)
            finally:
                for proc in procs:
                    proc.stop()
    time_ratios = [h / f for h, f in zip(hier_t, flat_t, strict=True)]
    byte_ratios = [h / f for h, f in zip(hier_b, flat_b, strict=True)]
    mib = nbytes // MiB
    print(
        f"a run of {rounds} rounds: {regions} regions x {per} peers x {mib} MiB vs "
        f"{regions * per} peers flat, {reps} rep(s)"
    )
    print(f"  flat, per round          {_spread(flat_t)} s")
    print(f"  hierarchical, per round  {_spread(hier_t)} s")
    print(f"  top links, flat          {statistics.median(flat_b) / MiB:.1f} MiB in + out")
    print(f"  top links, tiers         {statistics.median(hier_b) / MiB:.1f} MiB in + out")
    print(f"  round time, hierarchy / flat     {', '.join(f'{r:.2f}' for r in time_ratios)}")
    print(f"  upstream bytes, hierarchy / flat {', '.join(f'{r:.3f}' for r in byte_ratios)}")
    ideal = (2 * regions * rounds + regions + 1) / (2 * regions * per * rounds + 1)
    print(f"  (models moved, hierarchy / flat: {ideal:.3f}; per round {1 / per:.3f})")
    time_ratio, byte_ratio = statistics.median(time_ratios), statistics.median(byte_ratios)
    print(ratio_line("hierarchy_run_round_time", time_ratio))
    print(ratio_line("hierarchy_run_upstream_bytes", byte_ratio, "<=", 0.15))
    print(f"cores: {os.cpu_count()}, load average: {os.getloadavg()[0]:.1f}")
    return 0 if byte_ratio <= 0.15 else 1


def _spread(values: list[float]) -> str:
    return f"median {statistics.median(values):.3f} (min {min(values):.3f}, max {max(values):.3f})"


if __name__ == "__main__":
    sys.exit(main())
