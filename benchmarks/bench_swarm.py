"""Swarm distribution of a result across shaped links: coordinator bytes and download time.

A coordinator host on a 200 Mbit/s link (tbf, both directions) serves a model; 8 peers,
each in its own host on a 200 Mbit/s link of its own, fetch it at the same moment.

- star (the baseline): every peer pulls the whole model from the coordinator
  (``BlockClient.pull``), so the coordinator's uplink carries 8 copies.
- swarm: every peer runs a ``SwarmPeer`` (a read-only seeder on its own port, announced to
  the coordinator's ``SwarmTracker``) and fetches the chunks from the coordinator and from
  the other peers at once, each block CID-checked.

Both take turns in the same run, each on a model of its own (random float32, so no chunk
repeats), medians over ``--reps``. Goals (issue 16): coordinator bytes per round <= 2x one
model (star: 8x), and the swarm's download phase <= 0.4x the star's. The coordinator is a
``BlockServer`` with the tracker attached, as a RoundServer holds one: a round's result is
fetched over the same Get path. Needs root (network namespaces); prints why and exits 0
elsewhere.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tensorswap.cid import Cid
from tensorswap.netlab import Host, Lab, NamespacesUnavailable
from tensorswap.store import MemoryStore, ModelUpdate, put_update
from tensorswap.swarm import SwarmPeer, SwarmTracker
from tensorswap.wire import BlockClient, BlockServer

try:
    from benchmarks.__main__ import ratio_line
except ImportError:  # run as a file
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.__main__ import ratio_line

MiB = 1024 * 1024
PORT = 7100
KEY = b"bench-swarm-key"
BYTES_GOAL, TIME_GOAL = 2.0, 0.4


@dataclass
class Coordinator:
    """The coordinator's server (in its host's thread) and the roots it serves."""

    roots: list[Cid] = field(default_factory=list)
    server: BlockServer | None = None
    ready: threading.Event = field(default_factory=threading.Event)
    stop: threading.Event = field(default_factory=threading.Event)


async def coordinator(
    host: Host, box: Coordinator, models: list[dict[str, np.ndarray]], chunk: int
) -> None:
    store = MemoryStore()
    box.roots = [put_update(store, ModelUpdate(m, 1), chunk_bytes=chunk) for m in models]
    server = BlockServer(store, key=KEY, max_connections=256)
    SwarmTracker(store).attach(server)
    await server.start(host.address, PORT)
    box.server = server
    box.ready.set()
    try:
        await asyncio.to_thread(box.stop.wait)
    finally:
        await server.aclose()


async def peer(
    host: Host,
    name: str,
    root: Cid,
    swarm: bool,
    start: threading.Barrier,
    end: threading.Barrier,
) -> tuple[float, int]:
    """Connect (and start a seeder), wait for the start, fetch ``root``; keep serving until
    every peer is done. (The end time, chunk bytes the coordinator sent this peer.)"""
    store = MemoryStore()
    async with await BlockClient.connect(host.lab.hosts["coord"].address, PORT, key=KEY) as c:
        node = SwarmPeer(store, peer=name, key=KEY, listen=(host.address, 0)) if swarm else None
        if node is not None:
            await node.start()
        try:
            await asyncio.to_thread(start.wait)
            if node is None:
                pulled = await c.pull(root, store)
                from_coordinator = pulled.fetched_bytes
            else:
                report = await node.fetch(c, root)
                from_coordinator = report.from_coordinator
            done = time.perf_counter()
            await asyncio.to_thread(end.wait)  # the others may still fetch from this one
        finally:
            if node is not None:
                await node.aclose()
    return done, from_coordinator


def one_fetch(lab: Lab, box: Coordinator, root: Cid, swarm: bool) -> tuple[float, int]:
    """Every peer fetches ``root`` at once: (seconds to the last, coordinator bytes out)."""
    peers = [h for n, h in lab.hosts.items() if n.startswith("peer")]
    start, end = threading.Barrier(len(peers) + 1), threading.Barrier(len(peers))
    futures = [h.start_async(lambda h=h: peer(h, h.name, root, swarm, start, end)) for h in peers]
    assert box.server is not None
    before = box.server.stats.bytes_out
    start.wait()
    began = time.perf_counter()
    ends = [f.result(timeout=600) for f in futures]
    return max(e for e, _ in ends) - began, box.server.stats.bytes_out - before


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 rep, 4 peers, 4 MiB (no goals)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--mib", type=int, default=16)
    parser.add_argument("--chunk-kib", type=int, default=256)
    parser.add_argument("--peers", type=int, default=8)
    parser.add_argument("--mbit", type=float, default=200.0)
    args = parser.parse_args(argv)
    reps, mib, npeers = (1, 4, 4) if args.quick else (args.reps, args.mib, args.peers)
    try:
        lab = Lab()
    except NamespacesUnavailable as exc:
        print(f"skipped: {exc.reason}")
        return 0
    rng = np.random.default_rng(16)
    models = [{"w": rng.standard_normal(mib * MiB // 4, np.float32)} for _ in range(2 * reps)]
    nbytes = mib * MiB
    box = Coordinator()
    with lab:
        coord = lab.add_host("coord", mbit=args.mbit)
        for i in range(npeers):
            lab.add_host(f"peer{i}", mbit=args.mbit)
        serving = coord.start_async(lambda: coordinator(coord, box, models, args.chunk_kib * 1024))
        if not box.ready.wait(60):
            serving.result(timeout=1)
            raise RuntimeError("the coordinator did not start")
        stars: list[tuple[float, int]] = []
        swarms: list[tuple[float, int]] = []
        try:
            for rep in range(reps):
                stars.append(one_fetch(lab, box, box.roots[2 * rep], swarm=False))
                swarms.append(one_fetch(lab, box, box.roots[2 * rep + 1], swarm=True))
        finally:
            box.stop.set()
            serving.result(timeout=60)
    star_s = statistics.median(s for s, _ in stars)
    swarm_s = statistics.median(s for s, _ in swarms)
    star_b = statistics.median(b for _, b in stars) / nbytes
    swarm_b = statistics.median(b for _, b in swarms) / nbytes
    print(
        f"{npeers} peers fetch {mib} MiB ({args.chunk_kib} KiB chunks) at once; coordinator and "
        f"peers on {args.mbit:g} Mbit/s links; {reps} reps each"
    )
    for name, runs in (("star ", stars), ("swarm", swarms)):
        times = " ".join(f"{s:.2f}" for s, _ in runs)
        copies = " ".join(f"{b / nbytes:.2f}" for _, b in runs)
        print(f"  {name}  download {times} s; coordinator sent {copies} models")
    time_ratio = swarm_s / star_s
    print(f"  download phase: swarm {swarm_s:.2f} s / star {star_s:.2f} s = {time_ratio:.3f}x")
    print(f"  coordinator bytes: swarm {swarm_b:.2f} models, star {star_b:.2f} models")
    judge = not args.quick
    print(ratio_line("swarm_coordinator_models", swarm_b, "<=", BYTES_GOAL) if judge else
          ratio_line("swarm_coordinator_models", swarm_b))  # fmt: skip
    print(ratio_line("swarm_vs_star_download", time_ratio, "<=", TIME_GOAL) if judge else
          ratio_line("swarm_vs_star_download", time_ratio))  # fmt: skip
    missed = judge and (swarm_b > BYTES_GOAL or time_ratio > TIME_GOAL)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
