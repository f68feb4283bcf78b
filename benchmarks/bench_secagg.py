"""SecAgg+ cost: a secure round against a plain FedAvg round of the same shape, and how a
peer's cost grows with the round's size.

1. Round time: `tensorswap serve` on loopback, 8 peers x 1M float32 parameters (in this
   process, one asyncio loop), a plain run then a secure run (``secagg=True``) of the same
   shape in the same server, the same peer code (``next_task`` / ``fetch_model`` /
   ``submit``). Goal: secure round <= 3x the plain one.
2. Scaling: the protocol library in process for n = 8, 16, 32 peers: per-peer CPU seconds
   and bytes sent. SecAgg+ masks with k = 2 ceil(log2 n) neighbours, so both grow like
   log n (k + 1 = 7, 9, 11), not like n; goal: CPU at n = 32 <= 2x that at n = 8 (n grows 4x).
3. Flower 1.42's SecAgg+ workflow on the same shape, when a venv with
   ``flwr[simulation]==1.42.0`` exists at ``--flower-python`` (default: the environment's
   ``TENSORSWAP_FLOWER_PYTHON``, else the repository's ``.venv-flower`` from ``make
   flower-venv``; flwr is never a dependency of tensorswap): ``flower_secagg.py`` runs
   there, and its SecAgg+ fit stage per round (median, after the engine's first round) is
   compared with tensorswap's whole secure round; goal: tensorswap >= 3x faster.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.__main__ import ratio_line
from benchmarks._flower import flower_python
from benchmarks.bench_rounds import Coordinator
from tensorswap.runs import RunSpec
from tensorswap.runs.client import RunClient
from tensorswap.runs.manager import Task

FLOWER_PYTHON = flower_python()
"""The Python of a venv with ``flwr[simulation]==1.42.0`` (``--flower-python`` overrides)."""


async def _train(client: RunClient, task: Task | None, step: np.float32) -> None:
    assert task is not None
    model = await client.fetch_model(task)
    await client.submit(task, {k: v + step for k, v in model.items()}, 100)


async def _round(clients: list[RunClient], run: str, number: int) -> float:
    """Seconds of round ``number`` of ``run``: tasks, training, submits, the new version."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    tasks = await asyncio.gather(*(c.next_task(run, timeout=300) for c in clients))
    # each peer its own update, as real peers have (equal ones would be stored once, by dedup)
    steps = [np.float32(0.001 * number * (i + 1)) for i in range(len(clients))]
    await asyncio.gather(*(_train(*work) for work in zip(clients, tasks, steps, strict=True)))
    while (await clients[0].run(run)).version < number:
        await clients[0].next_task(run, timeout=0.02)  # wakes when the version is made
    return loop.time() - start


async def _interleaved(port: int, peers: int, dim: int, rounds: int) -> tuple[float, float]:
    """Median seconds per round of a plain and a secure run of the same shape, their rounds
    alternating (plain 1, secure 1, plain 2, ...) so both see the same machine load."""
    clients = [await RunClient.connect("127.0.0.1", port, peer=f"p{i}") for i in range(peers)]
    try:
        for client in clients:
            await client.register({"num_samples": 100})
        rng = np.random.default_rng(0)
        initial = {"w": rng.standard_normal(dim, dtype=np.float32) * np.float32(0.1)}
        common = {"per_round": peers, "min_clients": peers, "rounds": rounds, "seed": 1}
        await clients[0].create_run("plain", RunSpec(**common), initial)  # type: ignore[arg-type]
        secure = RunSpec(secagg=True, secagg_clip=0.5, **common)  # type: ignore[arg-type]
        await clients[0].create_run("secure", secure, initial)
        times: dict[str, list[float]] = {"plain": [], "secure": []}
        for number in range(1, rounds + 1):
            for run, kept in times.items():
                kept.append(await _round(clients, run, number))
        return float(np.median(times["plain"])), float(np.median(times["secure"]))
    finally:
        for client in clients:
            await client.aclose()


def round_time(peers: int, dim: int, rounds: int) -> tuple[float, float]:
    with tempfile.TemporaryDirectory(prefix="bench-secagg-") as tmp:
        server = Coordinator(Path(tmp) / "data", "--inactive-after", "3600")
        try:
            return asyncio.run(_interleaved(server.port, peers, dim, rounds))
        finally:
            server.stop()


def scaling(n: int, dim: int) -> tuple[float, float, int]:
    """(max per-peer CPU seconds, mean per-peer CPU seconds, max bytes a peer sends) of one
    in-process SecAgg+ round of ``n`` peers (msgpack encode/decode included)."""
    from tensorswap.privacy.secagg import SecAggClient, SecAggServer, decode, encode, make_config

    rng = np.random.default_rng(n)
    config = make_config(range(n), dim, clip=0.5, max_weight=1000)
    server = SecAggServer(config)
    clients = {
        p: SecAggClient(p, rng.uniform(-0.5, 0.5, dim).astype(np.float32), 100, rng=rng)
        for p in config.peers
    }
    cpu = dict.fromkeys(config.peers, 0.0)
    sent = dict.fromkeys(config.peers, 0)
    outbox = {p: encode(m) for p, m in server.setup_messages().items()}
    for _ in range(4):
        for peer, data in outbox.items():
            start = time.thread_time()
            reply = encode(clients[peer].handle(decode(data)))
            cpu[peer] += time.thread_time() - start
            sent[peer] += len(reply)
            server.receive(decode(reply))
        outbox = {p: encode(m) for p, m in server.close_phase().items()}
    assert server.result is not None and len(server.result.survivors) == n
    return max(cpu.values()), float(np.mean(list(cpu.values()))), max(sent.values())


def flower(python: str | None, peers: int, dim: int) -> float | None:
    """Flower's SecAgg+ round time (seconds) from ``flower_secagg.py`` in its own venv."""
    script = Path(__file__).with_name("flower_secagg.py")
    if python is None or not Path(python).exists():
        print(f"  flower: no Flower venv ({python or 'none named'}; `make flower-venv`); skipped")
        return None
    env = {**os.environ, "PYTHONPATH": ""}
    out = subprocess.run(
        [python, str(script), "--peers", str(peers), "--dim", str(dim)],
        capture_output=True,
        text=True,
        timeout=3600,
        env=env,
        check=False,
    )
    for line in out.stdout.splitlines():
        if line.startswith("ROUND_SECONDS "):
            return float(line.split()[1])
    print(f"  flower failed (rc {out.returncode}): {out.stderr[-2000:]}")
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="64K parameters (default 1M)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per run (median)")
    parser.add_argument("--no-flower", action="store_true", help="skip Flower's SecAgg+")
    parser.add_argument("--flower-python", default=FLOWER_PYTHON)
    args = parser.parse_args(argv)
    dim = 1 << 16 if args.quick else 1 << 20
    ok = True

    plain, secure = round_time(8, dim, args.rounds)
    ratio = secure / plain
    print(f"round, 8 peers x {dim} float32, loopback (median of {args.rounds}):")
    print(f"  plain FedAvg {plain:.3f} s, SecAgg+ {secure:.3f} s: {ratio:.2f}x (goal <= 3x)")
    print(ratio_line("secagg_round_vs_plain", ratio, "<=", 3))
    ok &= ratio <= 3

    print(f"scaling, in process, {dim} float32 per peer:")
    rows = {n: scaling(n, dim) for n in (8, 16, 32)}
    for n, (top, mean, nbytes) in rows.items():
        k = min(n - 1, 2 * int(np.ceil(np.log2(n))))
        print(
            f"  n={n:2d} k={k:2d}: per-peer CPU max {top:.3f} s, mean {mean:.3f} s; "
            f"sent {nbytes / 1e6:.3f} MB ({(nbytes - 4 * (dim + 1)) / 1e3:.1f} kB besides the "
            f"masked vector)"
        )
    growth = rows[32][1] / rows[8][1]
    small = (rows[32][2] - 4 * (dim + 1)) / (rows[8][2] - 4 * (dim + 1))
    print(f"  n 8 -> 32 (4x): mean CPU {growth:.2f}x, protocol bytes {small:.2f}x (k+1: 11/7)")
    print(ratio_line("secagg_cpu_32_vs_8", growth, "<=", 2))
    ok &= growth <= 2

    if not (args.no_flower or args.quick):
        theirs = flower(args.flower_python, 8, dim)
        if theirs is not None:
            faster = theirs / secure
            print(f"  Flower 1.42 SecAgg+ round {theirs:.3f} s: tensorswap {faster:.2f}x faster")
            print(ratio_line("secagg_vs_flower", faster, ">=", 3))
            ok &= faster >= 3
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
