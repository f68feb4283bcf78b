"""Benchmark the DWE delta path: extract+serialize vs a numpy copy, and the bus over loopback.

Every figure is printed as a ratio against a baseline measured in the same run:

* extract + serialize of an ~8 MiB delta, as a multiple of the time of a numpy copy of the
  same bytes (with the SHA-256 state hash alone for reference: it is most of the cost);
* fragments/s and MB/s from one sender to 4 listeners (in a child process) over loopback,
  persistent connections vs a connection per fragment (axiom 0.1.5): the ratio is the goal
  (>= 3x on small fragments).

Usage: ``python benchmarks/bench_delta.py [--quick]``; sizes via ``BENCH_DELTA_SMALL_COUNT``,
``BENCH_DELTA_LARGE_COUNT``, ``BENCH_DELTA_SMALL_VALUES``, ``BENCH_DELTA_LARGE_VALUES``,
``BENCH_DELTA_REPEATS``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np

from tensorswap.delta import (
    MAX_DWE_FRAGMENT_BYTES,
    DweBus,
    DweConfig,
    DweListener,
    SendMode,
    Verdict,
    encode_frame,
    encoded_size,
    extract_delta_fragment,
)

LISTENERS = 4


def _seconds(func: Callable[[], object]) -> float:
    start = time.perf_counter()
    func()
    return time.perf_counter() - start


def _interleaved_ratios(
    baseline: Callable[[], object], subjects: dict[str, Callable[[], object]], repeats: int
) -> tuple[float, dict[str, float]]:
    """Median baseline time and, per subject, the median of per-repeat time ratios.

    Each repeat times the baseline right before the subjects, so load on this shared machine
    hits both alike.
    """
    base_times: list[float] = []
    ratios: dict[str, list[float]] = {name: [] for name in subjects}
    for _ in range(repeats):
        t_base = _seconds(baseline)
        base_times.append(t_base)
        for name, func in subjects.items():
            ratios[name].append(_seconds(func) / t_base)
    return statistics.median(base_times), {k: statistics.median(v) for k, v in ratios.items()}


def bench_extract(repeats: int) -> None:
    """Extract + serialize an ~8 MiB delta (8 layers) against a numpy copy of the same bytes."""
    values = (MAX_DWE_FRAGMENT_BYTES - 4096) // 4
    per_layer = values // 8
    rng = np.random.default_rng(0)
    base = [rng.standard_normal(per_layer).astype(np.float32) for _ in range(8)]
    new = [b + np.float32(0.01) for b in base]
    nbytes = 8 * per_layer * 4

    def copy() -> object:
        return [layer.copy() for layer in new]

    def extract_and_serialize() -> object:
        return encode_frame(extract_delta_fragment("bench", 1, new, base))

    def sha256_only() -> object:
        return [hashlib.sha256(layer.data).digest() for layer in new]

    fragment = extract_delta_fragment("bench", 1, new, base)

    def serialize_only() -> object:
        return encode_frame(fragment)

    subjects = {
        "extract+serialize": extract_and_serialize,
        "  of which serialize": serialize_only,
        "  sha256 alone (state hash)": sha256_only,
    }
    t_copy, ratios = _interleaved_ratios(copy, subjects, repeats)
    print(f"extract+serialize of {nbytes / 2**20:.2f} MiB in 8 layers (median of {repeats}):")
    print(f"  {'numpy copy (baseline)':<28} {nbytes / t_copy / 1e9:6.2f} GB/s  1.00x the copy time")
    for name, ratio in ratios.items():
        rate = nbytes / (t_copy * ratio) / 1e9
        print(f"  {name:<28} {rate:6.2f} GB/s {ratio:5.2f}x the copy time")


# ── network: child process hosting 4 listeners ───────────────────────────────
async def _listener_main() -> None:
    counts = [0] * LISTENERS
    target = {"count": 0, "session": ""}
    rejected: list[str] = []
    all_done = asyncio.Event()

    def make_counter(index: int) -> Callable[[Verdict], None]:
        def seen(verdict: Verdict) -> None:
            if not verdict.accepted:
                rejected.append(f"{verdict.reason}: {verdict.detail}")
            elif verdict.session_id == target["session"]:
                counts[index] += 1
                if min(counts) >= target["count"]:
                    all_done.set()

        return seen

    listeners = [DweListener(on_verdict=make_counter(i)) for i in range(LISTENERS)]
    for listener in listeners:
        await listener.start()
    print(json.dumps({"ports": [lis.endpoint.port for lis in listeners]}), flush=True)
    loop = asyncio.get_running_loop()
    try:
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line.strip():
                break
            count, session = line.split()
            counts[:] = [0] * LISTENERS
            all_done.clear()
            target.update(count=int(count), session=session)
            print("ready", flush=True)
            await all_done.wait()
            print(json.dumps({"done": session, "rejected": len(rejected)}), flush=True)
    finally:
        for listener in listeners:
            await listener.aclose()


class ListenerProcess:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--listener-role"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None and self.proc.stdin is not None
        self.ports = json.loads(self.proc.stdout.readline())["ports"]

    def expect(self, count: int, session: str) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{count} {session}\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "ready"

    async def wait_done(self) -> dict[str, object]:
        assert self.proc.stdout is not None
        line = await asyncio.to_thread(self.proc.stdout.readline)
        return json.loads(line)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        self.proc.wait(timeout=30)


async def _one_round(
    child: ListenerProcess, mode: SendMode, count: int, values: int, session: str
) -> tuple[float, int]:
    rng = np.random.default_rng(1)
    base = [np.zeros(values, np.float32)]
    fragments = [
        extract_delta_fragment(session, seq, [rng.standard_normal(values).astype(np.float32)], base)
        for seq in range(count)
    ]
    size = encoded_size(fragments[0])
    child.expect(count, session)
    config = DweConfig(peers=tuple(f"127.0.0.1:{p}" for p in child.ports), mode=mode)
    async with DweBus(config=config) as bus:
        start = time.perf_counter()
        waiter = asyncio.create_task(child.wait_done())
        for fragment in fragments:
            await bus.put(fragment)
        await bus.flush()
        done = await waiter
        elapsed = time.perf_counter() - start
        stats = bus.telemetry()
    if stats.sent != count * LISTENERS or done["rejected"]:
        raise RuntimeError(f"lost or rejected fragments: {stats}, {done}")
    return elapsed, size


async def bench_bus(small: tuple[int, int], large: tuple[int, int]) -> None:
    child = ListenerProcess()
    try:
        print(
            f"\none sender -> {LISTENERS} listeners over loopback (listeners in a child process):"
        )
        for label, (count, values) in (("small", small), ("large", large)):
            results = {}
            for mode in (SendMode.PERSISTENT, SendMode.PER_FRAGMENT):
                session = f"{label}-{mode.value}-{time.time_ns()}"
                elapsed, size = await _one_round(child, mode, count, values, session)
                rate = count / elapsed
                results[mode] = rate
                mbps = rate * size * LISTENERS / 1e6
                print(
                    f"  {label:>5} ({size:>7} B) {mode.value:<12} {rate:9.0f} fragments/s "
                    f"{mbps:8.1f} MB/s delivered"
                )
            ratio = results[SendMode.PERSISTENT] / results[SendMode.PER_FRAGMENT]
            print(f"  {label:>5}: persistent / per-fragment = {ratio:.2f}x")
    finally:
        child.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, a few seconds")
    parser.add_argument("--listener-role", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.listener_role:
        asyncio.run(_listener_main())
        return
    env = os.environ.get
    repeats = int(env("BENCH_DELTA_REPEATS", "3" if args.quick else "9"))
    small = (
        int(env("BENCH_DELTA_SMALL_COUNT", "200" if args.quick else "2000")),
        int(env("BENCH_DELTA_SMALL_VALUES", "64")),
    )
    large = (
        int(env("BENCH_DELTA_LARGE_COUNT", "10" if args.quick else "60")),
        int(env("BENCH_DELTA_LARGE_VALUES", str(1 << 18))),
    )
    bench_extract(repeats)
    asyncio.run(bench_bus(small, large))


if __name__ == "__main__":
    main()
