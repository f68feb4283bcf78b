"""Hierarchical aggregation over loopback: 4 regions x 8 peers vs 32 peers flat.

Each round: 32 peers submit an 8 MiB update of their own (random values, so every chunk
is a distinct block) and fetch the global result. Flat: all 32 talk to one `tensorswap
serve`. Hierarchy: a top `tensorswap serve` and 4 regional ones (`--upstream`), 8 peers
each; each region submits one partial aggregate upstream and pulls the global result once.
Flat and hierarchical rounds take turns (``--reps`` each) on the same processes; reported:

- global round time (first submit -> every peer holds the global result's values), hierarchy
  / flat, median over the reps;
- bytes on the top coordinator's links (in + out, the wire's counters), hierarchy / flat:
  the upstream traffic a tier saves (ideal 4/32 = 0.125).

All processes share this machine's cores (2 here), so the hierarchy's 5 coordinators do
not get a machine each as they would in a deployment: the time ratio is a floor on what
the extra hop costs, not what it saves on a real network.
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
from tensorswap.cid import Cid
from tensorswap.rounds.client import RoundClient
from tensorswap.rounds.core import Complete, RoundId, RoundSpec
from tensorswap.store import ModelUpdate, put_update

MiB = 1024 * 1024


async def top_bytes(port: int) -> int:
    async with await RoundClient.connect("127.0.0.1", port, peer="bench-stats") as client:
        stats = (await client.server_status()).stats
    return int(stats["bytes_in"]) + int(stats["bytes_out"])


async def one_round(
    top: int, ports: list[int], per_port: int, nbytes: int, rep: int, hierarchical: bool
) -> tuple[float, int]:
    """(seconds, bytes on the top coordinator's links) of round ``rep``."""
    rid = RoundId(rep + 1, "hier" if hierarchical else "flat")
    clients = [
        await RoundClient.connect("127.0.0.1", port, peer=f"peer-{r}-{i}")
        for r, port in enumerate(ports)
        for i in range(per_port)
    ]
    try:
        cids = []
        for k, client in enumerate(clients):
            rng = np.random.default_rng([rep, k, hierarchical])
            values = rng.standard_normal(nbytes // 4, dtype=np.float32)
            cids.append(put_update(client.store, ModelUpdate({"w": values}, 1 + k)))
        if hierarchical:
            async with await RoundClient.connect("127.0.0.1", top, peer="driver") as driver:
                await driver.start_round(rid, RoundSpec(len(ports)))
        for r in range(len(ports)):
            await clients[r * per_port].start_round(rid, RoundSpec(per_port))
        before = await top_bytes(top)

        async def one(client: RoundClient, cid: object) -> None:
            await client.submit(rid, cid)  # type: ignore[arg-type]
            status = await client.wait(rid, timeout=600)
            assert isinstance(status, Complete), status
            await client.fetch(Cid.parse(status.cid))

        start = time.perf_counter()
        await asyncio.gather(*(one(c, cid) for c, cid in zip(clients, cids, strict=True)))
        seconds = time.perf_counter() - start
        return seconds, await top_bytes(top) - before
    finally:
        for client in clients:
            await client.aclose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="4 regions x 8 peers x 1 MiB")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--regions", type=int, default=4)
    parser.add_argument("--per-region", type=int, default=8)
    parser.add_argument("--mib", type=int, default=8)
    args = parser.parse_args(argv)
    regions, per = args.regions, args.per_region
    nbytes = (1 if args.quick else args.mib) * MiB
    reps = 1 if args.quick else args.reps
    flat_t, hier_t, flat_b, hier_b = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="bench-hierarchy-") as tmp:
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
            for rep in range(reps):
                seconds, moved = asyncio.run(
                    one_round(flat.port, [flat.port], regions * per, nbytes, rep, False)
                )
                flat_t.append(seconds)
                flat_b.append(moved)
                seconds, moved = asyncio.run(one_round(top.port, ports, per, nbytes, rep, True))
                hier_t.append(seconds)
                hier_b.append(moved)
        finally:
            for proc in procs:
                proc.stop()
    time_ratios = [h / f for h, f in zip(hier_t, flat_t, strict=True)]
    byte_ratios = [h / f for h, f in zip(hier_b, flat_b, strict=True)]
    mib = nbytes // MiB
    print(f"{regions} regions x {per} peers x {mib} MiB vs {regions * per} peers flat, {reps} reps")
    print(f"  flat round          {_spread(flat_t)} s")
    print(f"  hierarchical round  {_spread(hier_t)} s")
    print(f"  top links, flat     {statistics.median(flat_b) / MiB:.1f} MiB in + out")
    print(f"  top links, tiers    {statistics.median(hier_b) / MiB:.1f} MiB in + out")
    time_ratio, byte_ratio = statistics.median(time_ratios), statistics.median(byte_ratios)
    print(f"  round time, hierarchy / flat   {time_ratio:.2f}x")
    print(f"  upstream bytes, hierarchy / flat {byte_ratio:.3f}x (ideal {1 / per:.3f})")
    print(ratio_line("hierarchy_round_time", time_ratio))
    print(ratio_line("hierarchy_upstream_bytes", byte_ratio, "<=", 0.15))
    print(f"cores: {os.cpu_count()}, load average: {os.getloadavg()[0]:.1f}")
    return 0 if byte_ratio <= 0.15 else 1


def _spread(values: list[float]) -> str:
    return f"median {statistics.median(values):.3f} (min {min(values):.3f}, max {max(values):.3f})"


if __name__ == "__main__":
    sys.exit(main())
