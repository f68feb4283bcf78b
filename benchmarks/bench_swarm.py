"""Swarm distribution of a result across shaped links: coordinator bytes and download time.

A coordinator host on a 200 Mbit/s link (tbf, both directions) serves a model; 8 peers,
each in its own host on a 200 Mbit/s link of its own, fetch it at the same moment.

- star (the baseline): every peer pulls the whole model from the coordinator
  (``BlockClient.pull``), so the coordinator's uplink carries 8 copies.
- swarm: every peer runs a ``SwarmPeer`` (a read-only seeder on its own port, announced to
  the coordinator's ``SwarmTracker``) and fetches the chunks from the coordinator and from
  the other peers at once, each block CID-checked.

Both take turns in the same run, each on a model of its own (random float32, so no chunk
repeats), medians over ``--reps``. Each peer is a process of its own in its host
(``--threads``: threads of this process, sharing its interpreter lock). Goals (issue 16):
coordinator bytes per round <= 2x one model (star: 8x), and the swarm's download phase
<= 0.4x the star's. The coordinator is a ``BlockServer`` with the tracker attached, as a
RoundServer holds one: a round's result is fetched over the same Get path. Needs root
(network namespaces); prints why and exits 0 elsewhere.

``--round``: the same on an actual round's result. The coordinator is a ``RoundServer``
(``Coordinator.result_chunk_bytes`` = ``--chunk-kib``, as ``serve --result-chunk`` sets it)
with the tracker attached; in each round every peer submits an update of ``--mib`` MiB of
its own, waits for the round, and fetches the aggregate: star with
``RoundClient.fetch_result``, swarm with ``SwarmPeer.fetch_result``. Coordinator bytes are
all it sent during the round (the uploads' answers included); the download phase runs from
the first peer learning the round is complete to the last holding its result.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tensorswap.cid import Cid
from tensorswap.netlab import Host, Lab, NamespacesUnavailable
from tensorswap.rounds import Coordinator as RoundCoordinator
from tensorswap.rounds import RoundClient, RoundServer
from tensorswap.rounds.core import RoundId, RoundSpec
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
    rounds: RoundCoordinator | None = None  # --round
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
    address: str,
    coordinator_address: str,
    name: str,
    root: Cid,
    swarm: bool,
    start: Callable[[], object],
    end: Callable[[float], object],
) -> tuple[float, int]:
    """Connect (and start a seeder), wait for ``start()``, fetch ``root``; keep serving
    until ``end(when it was done)`` returns. (The end time, chunk bytes the coordinator
    sent this peer.)"""
    store = MemoryStore()
    async with await BlockClient.connect(coordinator_address, PORT, key=KEY) as c:
        node = SwarmPeer(store, peer=name, key=KEY, listen=(address, 0)) if swarm else None
        if node is not None:
            await node.start()
        try:
            await asyncio.to_thread(start)
            if node is None:
                pulled = await c.pull(root, store)
                from_coordinator = pulled.fetched_bytes
            else:
                report = await node.fetch(c, root)
                from_coordinator = report.from_coordinator
            done = time.monotonic()
            await asyncio.to_thread(end, done)  # the others may still fetch from this one
        finally:
            if node is not None:
                await node.aclose()
    return done, from_coordinator


async def round_coordinator(host: Host, box: Coordinator, chunk: int) -> None:
    """``--round``: a RoundServer whose aggregates are cut into ``chunk``-byte chunks."""
    rounds = RoundCoordinator(MemoryStore())
    rounds.result_chunk_bytes = chunk
    server = RoundServer(rounds, key=KEY, max_connections=256)
    SwarmTracker(rounds.store).attach(server.blocks)
    await server.start(host.address, PORT)
    box.server, box.rounds = server.blocks, rounds
    box.ready.set()
    try:
        await asyncio.to_thread(box.stop.wait)
    finally:
        await server.aclose()
        rounds.close()


async def round_peer(
    address: str,
    coordinator_address: str,
    name: str,
    rid: RoundId,
    mib: int,
    swarm: bool,
    start: Callable[[], object],
    end: Callable[[float, float], object],
) -> tuple[float, float, int]:
    """``--round``: submit an update of its own to ``rid``, wait for the round, fetch the
    aggregate; keep serving until ``end(known, done)`` returns. (When the round was known
    complete, when its result was held, coordinator chunk bytes of the fetch.)"""
    seed = int(name.removeprefix("peer")) + 1000 * rid.round
    values = np.random.default_rng(seed).standard_normal(mib * MiB // 4, np.float32)
    async with await RoundClient.connect(coordinator_address, PORT, peer=name, key=KEY) as c:
        # the submit waits for the round, but the result is fetched apart (star: one Get;
        # swarm: from every source), not brought behind the submit's answer (rounds/fetch)
        c.push_results = False
        node = None
        if swarm:
            node = SwarmPeer(c.store, peer=name, key=KEY, listen=(address, 0))
            await node.start()
        try:
            await asyncio.to_thread(start)
            await c.submit(rid, {"w": values}, 1, wait=300)
            cid = await c.result(rid, timeout=300)
            known = time.monotonic()
            if node is None:
                before = c.blocks.transport.bytes_received
                await c.fetch_result(rid, timeout=300)
                from_coordinator = c.blocks.transport.bytes_received - before
            else:
                report = await node.fetch(c.blocks, cid)
                from_coordinator = report.from_coordinator
            done = time.monotonic()
            await asyncio.to_thread(end, known, done)  # the others may still fetch from it
        finally:
            if node is not None:
                await node.aclose()
    return known, done, from_coordinator


def round_fetch(
    procs: list[subprocess.Popen[str]], box: Coordinator, rid: RoundId, swarm: bool
) -> tuple[float, int]:
    """``--round``: one round with every peer (a process each); (download phase seconds,
    coordinator bytes out in the round)."""
    assert box.rounds is not None and box.server is not None
    box.rounds.start_round(rid, RoundSpec(len(procs)))
    for proc in procs:
        _say(proc, f"round {'swarm' if swarm else 'star'} {rid.round}")
    for proc in procs:
        _expect(proc, "ready")
    before = box.server.stats.bytes_out
    for proc in procs:
        _say(proc, "go")
    marks = [_expect(proc, "done").split()[1:3] for proc in procs]
    for proc in procs:
        _say(proc, "end")
    for proc in procs:
        _expect(proc, "closed")
    known = min(float(k) for k, _ in marks)
    return max(float(d) for _, d in marks) - known, box.server.stats.bytes_out - before


def one_fetch(lab: Lab, box: Coordinator, root: Cid, swarm: bool) -> tuple[float, int]:
    """Every peer (a thread in its host) fetches ``root`` at once: (seconds to the last,
    coordinator bytes out)."""
    peers = [h for n, h in lab.hosts.items() if n.startswith("peer")]
    start, end = threading.Barrier(len(peers) + 1), threading.Barrier(len(peers))
    coord = lab.hosts["coord"].address
    futures = [
        h.start_async(
            lambda h=h: peer(h.address, coord, h.name, root, swarm, start.wait, _wait(end))
        )
        for h in peers
    ]
    assert box.server is not None
    before = box.server.stats.bytes_out
    start.wait()
    began = time.monotonic()
    ends = [f.result(timeout=600) for f in futures]
    return max(e for e, _ in ends) - began, box.server.stats.bytes_out - before


def _wait(barrier: threading.Barrier) -> Callable[[float], object]:
    return lambda _done: barrier.wait()


def process_fetch(
    procs: list[subprocess.Popen[str]], box: Coordinator, root: Cid, swarm: bool
) -> tuple[float, int]:
    """``one_fetch`` with every peer a process of its own (``--peer-process``): no
    interpreter lock shared between peers, as in a deployment."""
    for proc in procs:
        _say(proc, f"fetch {'swarm' if swarm else 'star'} {root}")
    for proc in procs:
        _expect(proc, "ready")
    assert box.server is not None
    before = box.server.stats.bytes_out
    began = time.monotonic()
    for proc in procs:
        _say(proc, "go")
    ends = [float(_expect(proc, "done").split()[1]) for proc in procs]
    for proc in procs:
        _say(proc, "end")
    for proc in procs:
        _expect(proc, "closed")
    return max(ends) - began, box.server.stats.bytes_out - before


def _say(proc: subprocess.Popen[str], line: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


def _expect(proc: subprocess.Popen[str], word: str) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith(word):
        raise RuntimeError(f"a peer process said {line!r}, expected {word!r}")
    return line


def peer_process(address: str, coordinator_address: str, name: str, mib: int) -> None:
    """A peer process's loop: ``fetch star|swarm ROOT`` or ``round star|swarm N`` (answers
    ``ready``), ``go`` (then ``done T`` or ``done KNOWN T``, on the monotonic clock every
    process shares), ``end`` (``closed``)."""

    def line() -> str:
        return sys.stdin.readline().strip()

    while command := line():
        kind, mode, root = command.split()

        def start() -> None:
            print("ready", flush=True)
            if line() != "go":
                raise RuntimeError("expected go")

        def end(done: float) -> None:
            print(f"done {done}", flush=True)
            if line() != "end":
                raise RuntimeError("expected end")

        def ended(known: float, done: float) -> None:
            print(f"done {known} {done}", flush=True)
            if line() != "end":
                raise RuntimeError("expected end")

        if kind == "round":
            rid = RoundId(int(root), "bench")
            asyncio.run(
                round_peer(address, coordinator_address, name, rid, mib, mode == "swarm",
                           start, ended)
            )  # fmt: skip
        else:
            asyncio.run(
                peer(address, coordinator_address, name, Cid.parse(root), mode == "swarm",
                     start, end)
            )  # fmt: skip
        print("closed", flush=True)


def start_processes(lab: Lab, mib: int) -> list[subprocess.Popen[str]]:
    """A ``--peer-process`` in every peer host, talking over its stdin / stdout."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    here = str(Path(__file__).resolve().parents[1])
    coord = lab.hosts["coord"].address
    procs = []
    for name, host in lab.hosts.items():
        if name.startswith("peer"):
            procs.append(host.python(
                "-m", "benchmarks.bench_swarm", "--peer-process", host.address, coord, name,
                str(mib),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=here,
            ))  # fmt: skip
    return procs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 rep, 4 peers, 4 MiB (no goals)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--mib", type=int, default=16)
    parser.add_argument("--chunk-kib", type=int, default=256)
    parser.add_argument("--peers", type=int, default=8)
    parser.add_argument("--mbit", type=float, default=200.0)
    parser.add_argument(
        "--threads",
        action="store_true",
        help="peers as threads of this process (sharing one interpreter lock), not processes",
    )
    parser.add_argument(
        "--round",
        action="store_true",
        help="distribute an actual round's result (peers submit, then fetch the aggregate)",
    )
    parser.add_argument("--peer-process", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.peer_process:
        address, coord_address, name, peer_mib = args.peer_process
        peer_process(address, coord_address, name, int(peer_mib))
        return 0
    if args.round and args.threads:
        parser.error("--round runs every peer as a process of its own")
    reps, mib, npeers = (1, 4, 4) if args.quick else (args.reps, args.mib, args.peers)
    try:
        lab = Lab()
    except NamespacesUnavailable as exc:
        print(f"skipped: {exc.reason}")
        return 0
    rng = np.random.default_rng(16)
    models = [
        {"w": rng.standard_normal(mib * MiB // 4, np.float32)}
        for _ in range(0 if args.round else 2 * reps)
    ]
    nbytes = mib * MiB
    box = Coordinator()
    with lab:
        coord = lab.add_host("coord", mbit=args.mbit)
        for i in range(npeers):
            lab.add_host(f"peer{i}", mbit=args.mbit)
        chunk = args.chunk_kib * 1024
        serving = coord.start_async(
            (lambda: round_coordinator(coord, box, chunk))
            if args.round
            else (lambda: coordinator(coord, box, models, chunk))
        )
        if not box.ready.wait(60):
            serving.result(timeout=1)
            raise RuntimeError("the coordinator did not start")
        stars: list[tuple[float, int]] = []
        swarms: list[tuple[float, int]] = []
        procs = [] if args.threads else start_processes(lab, mib)
        try:
            for rep in range(reps):
                for k, swarm, into in ((2 * rep, False, stars), (2 * rep + 1, True, swarms)):
                    if args.round:
                        into.append(round_fetch(procs, box, RoundId(k + 1, "bench"), swarm))
                        continue
                    root = box.roots[k]
                    into.append(
                        one_fetch(lab, box, root, swarm)
                        if args.threads
                        else process_fetch(procs, box, root, swarm)
                    )
        finally:
            for proc in procs:
                if proc.stdin is not None:
                    proc.stdin.close()
            box.stop.set()
            serving.result(timeout=60)
    star_s = statistics.median(s for s, _ in stars)
    swarm_s = statistics.median(s for s, _ in swarms)
    star_b = statistics.median(b for _, b in stars) / nbytes
    swarm_b = statistics.median(b for _, b in swarms) / nbytes
    how = "threads of one process" if args.threads else "a process each"
    what = "a round's result of" if args.round else ""
    print(
        f"{npeers} peers ({how}) fetch {what} {mib} MiB ({args.chunk_kib} KiB chunks) at "
        f"once; coordinator and peers on {args.mbit:g} Mbit/s links; {reps} reps each"
    )
    if args.round:
        print("  (coordinator bytes: all it sent in the round; download: from the first peer "
              "knowing the round complete to the last holding its result)")  # fmt: skip
    for name, runs in (("star ", stars), ("swarm", swarms)):
        times = " ".join(f"{s:.2f}" for s, _ in runs)
        copies = " ".join(f"{b / nbytes:.2f}" for _, b in runs)
        print(f"  {name}  download {times} s; coordinator sent {copies} models")
    time_ratio = swarm_s / star_s
    print(f"  download phase: swarm {swarm_s:.2f} s / star {star_s:.2f} s = {time_ratio:.3f}x")
    print(f"  coordinator bytes: swarm {swarm_b:.2f} models, star {star_b:.2f} models")
    judge = not args.quick
    tag = "swarm_round" if args.round else "swarm"
    print(ratio_line(f"{tag}_coordinator_models", swarm_b, "<=", BYTES_GOAL) if judge else
          ratio_line(f"{tag}_coordinator_models", swarm_b))  # fmt: skip
    print(ratio_line(f"{tag}_vs_star_download", time_ratio, "<=", TIME_GOAL) if judge else
          ratio_line(f"{tag}_vs_star_download", time_ratio))  # fmt: skip
    missed = judge and (swarm_b > BYTES_GOAL or time_ratio > TIME_GOAL)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
