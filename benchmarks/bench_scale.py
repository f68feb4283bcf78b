"""10,000 clients on one coordinator: status latency and memory per client.

A `tensorswap serve` process; 10,000 peers register for runs, each under its own name: half
with one ``RunClient.register`` request each over the 4 connections of one VirtualClients
(concurrent registrations are journaled together), half with ``VirtualRuns.register_many``
(``register_batch`` requests of 1,024); then all of them contribute a tiny update to one
round of 10,001 (so it stays open), batched. Printed:

- registrations per second both ways (and, with ``--before-src``, one request each to a
  coordinator from before grouped registrations, in the same run), as ratios;

- the coordinator's RSS growth per registered client and per contribution (goal: a few
  KiB), and its threads before and after (no thread per client);
- how long ``status`` takes with the round holding 10,000 contributions: the one-answer
  ``status`` (every round, every peer name), one ``rounds_page``, one ``peers_page`` of
  1,000 names and the walk over all 10,000 (goal: a page in < 1 s);
- contributions per second of the batched submits, for context.

``--part peers``: ordinary peers, one request each. A `tensorswap serve` process (durable,
``--key``) on its own; the load in separate processes (``benchmarks._peer_load``): N peers,
each its own ``RoundClient`` with its own connection and a distinct 16-float update,
submitting once through the plain ``RoundClient.submit`` (inline), 2 processes x 32 at a
time. Rows: each peer connecting (handshake) for its submit and closing after it; each peer
already connected. Printed per row: contributions per second (best and median of the
reps), the coordinator's CPU per contribution (user + system: on one core, under the GIL,
its capacity is 10^6 / that), the load generators' CPU per contribution, and the load
average. Where uvloop is installed, one more row runs the coordinator on it (``serve
--event-loop uvloop``), its CPU per contribution a ratio to asyncio's loop in the same run.
Goal: >= 3,000/s; where server and load share the 2 cores, the coordinator's CPU
per contribution (<= 333 us for 3,000/s on one core) is the figure that says it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.__main__ import ratio_line
from benchmarks.bench_rounds import Coordinator
from tensorswap._eventloop import uvloop_available
from tensorswap.rounds.client import PeerSubmit, RoundClient, VirtualClients
from tensorswap.rounds.core import Collecting, Complete, RoundId, RoundSpec
from tensorswap.rounds.protocol import page_peers, page_rounds
from tensorswap.runs.client import RunClient
from tensorswap.runs.virtual import VirtualRuns

KiB = 1024


def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return -1


async def _timed(what: str, call: object, rows: list[tuple[str, float]]) -> object:
    start = time.perf_counter()
    result = await call  # type: ignore[misc]
    rows.append((what, time.perf_counter() - start))
    return result


async def register_one_each(pool: VirtualClients, names: list[str]) -> float:
    """Seconds for ``names`` to register with one ``RunClient.register`` request each, over
    every connection of ``pool`` at once."""
    per = len(pool.clients)

    async def register(k: int) -> None:
        for name in names[k::per]:
            await RunClient(pool.client_for(name, k)).register({"num_samples": 10})

    start = time.perf_counter()
    await asyncio.gather(*(register(k) for k in range(per)))
    return time.perf_counter() - start


async def before_registrations(port: int, clients: int) -> float:
    pool = await VirtualClients.connect("127.0.0.1", port, connections=4)
    try:
        return await register_one_each(pool, [f"client-{i:05}" for i in range(clients // 2)])
    finally:
        await pool.aclose()


async def scale(coord: Coordinator, clients: int, before: float | None = None) -> bool:
    rid = RoundId(1, "scale")
    pool = await VirtualClients.connect("127.0.0.1", coord.port, connections=4)
    try:
        names = [f"client-{i:05}" for i in range(clients)]
        rss0, _ = coord.memory()
        threads0 = _threads(coord.proc.pid)
        half = clients // 2
        one_each = await register_one_each(pool, names[:half])
        start = time.perf_counter()
        refused = await VirtualRuns(pool).register_many(
            {n: {"num_samples": 10} for n in names[half:]}
        )
        batched = time.perf_counter() - start
        assert not any(refused), refused[:3]
        registered = one_each + batched
        rss1, _ = coord.memory()
        await pool.clients[0].start_round(rid, RoundSpec(clients + 1))
        items = [
            PeerSubmit(name, {"w": np.full(16, float(i % 97), np.float32)}, 10)
            for i, name in enumerate(names)
        ]
        start = time.perf_counter()
        outcomes = await pool.submit_many(rid, items, batch=500)
        submitted = time.perf_counter() - start
        assert all(isinstance(o, Collecting) for o in outcomes), outcomes[:3]
        rss2, _ = coord.memory()
        threads1 = _threads(coord.proc.pid)
        reader = pool.reader
        rows: list[tuple[str, float]] = []
        report = await _timed("status (one answer, every peer)", reader.server_status(), rows)
        page = await _timed(
            "rounds_page (100 rounds, 6 peers each)",
            page_rounds(reader, 0, 100, peers=6, stats=True),
            rows,
        )
        first = await _timed("peers_page (1,000 names)", page_peers(reader, rid, 0, 1000), rows)
        walk_start = time.perf_counter()
        seen, at = 0, 0
        while at is not None:
            got = await page_peers(reader, rid, at, 1000)
            seen += len(got.peers)
            at = got.next
        rows.append((f"peers_page walk ({seen} names)", time.perf_counter() - walk_start))
        assert seen == clients
        assert page.rounds[0].received == clients  # type: ignore[attr-defined]
        assert len(first.peers) == 1000  # type: ignore[attr-defined]
        assert report.rounds[0].received == clients  # type: ignore[attr-defined]
    finally:
        await pool.aclose()
    per_client = (rss1 - rss0) / clients
    per_contribution = (rss2 - rss1) / clients
    half = clients // 2
    print(
        f"{clients} clients: registered in {registered:.2f} s, contributed in {submitted:.2f} s "
        f"({clients / submitted:.0f}/s, batched)"
    )
    print(
        f"  registrations: one request each {half / one_each:.0f}/s ({one_each:.2f} s for "
        f"{half}), register_batch {(clients - half) / batched:.0f}/s ({batched:.2f} s)"
    )
    print(ratio_line("scale_register_batch_vs_one_each", one_each / batched))
    if before is not None:
        print(
            f"  before (a transaction per registration): one request each {half / before:.0f}/s"
            f" ({before:.2f} s for {half})"
        )
        print(ratio_line("scale_register_one_each_vs_before", before / one_each))
        print(ratio_line("scale_register_batch_vs_before", before / batched))
    print(
        f"  coordinator RSS: {rss0 / 2**20:.1f} MiB at start, +{per_client / KiB:.2f} KiB per "
        f"registered client, +{per_contribution / KiB:.2f} KiB per contribution (goal: a few KiB)"
    )
    print(f"  coordinator threads: {threads0} before, {threads1} after (no thread per client)")
    worst_page = 0.0
    for what, seconds in rows:
        print(f"  {what:42s} {seconds * 1000:8.1f} ms")
        if "page (" in what:
            worst_page = max(worst_page, seconds)
    print(ratio_line("scale_page_seconds", worst_page, "<=", 1.0))
    print(ratio_line("scale_kib_per_client", (per_client + per_contribution) / KiB, "<=", 8))
    return (
        worst_page < 1.0 and (per_client + per_contribution) < 8 * KiB and threads1 <= threads0 + 8
    )


_KEY = "bench-scale-peers"


async def _round(port: int, number: int, peers: int, wait: bool) -> None:
    key = _KEY.encode()
    async with await RoundClient.connect("127.0.0.1", port, peer="driver", key=key) as lead:
        rid = RoundId(number, "bench")
        if not wait:
            await lead.start_round(rid, RoundSpec(peers))
            return
        status = await lead.wait(rid, timeout=600)
        assert isinstance(status, Complete), status


def peer_round(coord: Coordinator, number: int, peers: int, mode: str, procs: int, conc: int):
    """One round of ``peers`` ordinary peers over ``procs`` load processes: (contributions
    per second, coordinator CPU us and load CPU us per contribution)."""
    asyncio.run(_round(coord.port, number, peers, wait=False))
    share = peers // procs
    cmd = [sys.executable, "-m", "benchmarks._peer_load", str(coord.port), _KEY.encode().hex()]
    loads = [
        subprocess.Popen(
            [*cmd, str(number), mode, str(k * share), str(share), str(conc)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for k in range(procs)
    ]
    try:
        for load in loads:
            assert load.stdout is not None and load.stdout.readline().strip() == "ready"
        served, start = coord.cpu_seconds(), time.perf_counter()
        for load in loads:
            assert load.stdin is not None
            load.stdin.write("go\n")
            load.stdin.flush()
        reports = [json.loads(load.communicate(timeout=900)[0]) for load in loads]
        failed = sum(r["failed"] for r in reports)
        assert not failed, [r["errors"] for r in reports]
        asyncio.run(_round(coord.port, number, share * procs, wait=True))
        seconds, used = time.perf_counter() - start, coord.cpu_seconds() - served
    finally:
        for load in loads:
            if load.poll() is None:
                load.kill()
            load.wait()
    n = share * procs
    client = sum(r["user"] + r["sys"] for r in reports)
    return n / seconds, used / n * 1e6, client / n * 1e6


def run_peers(tmp: Path, peers: int, reps: int, before: str | None) -> bool:
    """Ordinary peers' tiny contributions per second (see the module docstring)."""
    procs, conc = 2, 32
    rows: list[tuple[str, str, str | None, tuple[str, ...]]] = []
    if before is not None:
        rows.append((f"before ({before}): each peer already connected", "connected", before, ()))
    main = len(rows)
    rows += [
        ("each peer already connected: one inline submit", "connected", None, ()),
        ("each peer connects (handshake), submits, closes", "fresh", None, ()),
    ]
    fast = None
    if uvloop_available():  # the same coordinator on uvloop, in the same run
        fast = len(rows)
        uvloop = ("--event-loop", "uvloop")
        rows.append(
            ("each peer already connected, coordinator on uvloop", "connected", None, uvloop)
        )
    got: list[list[tuple[float, float, float]]] = [[] for _ in rows]
    loads: list[float] = []
    number = 0
    for rep in range(reps):  # rows take turns, so that the machine's load hits them alike
        for i, (_, mode, src, options) in enumerate(rows):
            number += 1
            loads.append(os.getloadavg()[0])
            extra = ("--key", _KEY, "--max-connections", str(peers + 64), *options)
            coord = Coordinator(tmp / f"peers-{i}-{rep}", *extra, src=src)
            try:
                got[i].append(peer_round(coord, number, peers, mode, procs, conc))
            finally:
                coord.stop()
    print(
        f"{peers} ordinary peers (RoundClient each, tiny distinct updates, durable), "
        f"{procs} load processes x {conc} at a time, {reps} reps; load average "
        f"{min(loads):.1f}-{max(loads):.1f}:"
    )
    for (label, _, _, _), results in zip(rows, got, strict=True):
        rates = [r[0] for r in results]
        server = statistics.median(r[1] for r in results)
        client = statistics.median(r[2] for r in results)
        print(
            f"  {max(rates):6.0f}/s (median {statistics.median(rates):5.0f}, all "
            f"{', '.join(f'{r:.0f}' for r in rates)})  coordinator {server:4.0f} us "
            f"(min {min(r[1] for r in results):.0f}; capacity on one core "
            f"{1e6 / server:,.0f}/s)  load {client:4.0f} us  {label}"
        )
    best_new = max(r[0] for r in got[main])
    cpu_new = statistics.median(r[1] for r in got[main])
    if before is not None:
        print(ratio_line("peers_cpu_vs_before", cpu_new / statistics.median(r[1] for r in got[0])))
    if fast is not None:
        cpu_fast = statistics.median(r[1] for r in got[fast])
        print(ratio_line("peers_cpu_uvloop_vs_asyncio", cpu_fast / cpu_new))
    print(ratio_line("peers_per_second", best_new, ">=", 3000))
    print(ratio_line("peers_coordinator_us", cpu_new, "<=", 333))
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="1,000 clients")
    parser.add_argument("--clients", type=int, default=10_000)
    parser.add_argument("--part", choices=["all", "clients", "peers"], default="all")
    parser.add_argument("--peers", type=int, default=3000, help="peers part: peers per round")
    parser.add_argument("--reps", type=int, default=3, help="peers part: rounds per row")
    parser.add_argument(
        "--before-src",
        metavar="DIR",
        help="also time one-request registrations on a coordinator run from this src "
        "directory (a checkout before grouped registrations)",
    )
    args = parser.parse_args(argv)
    clients = 1000 if args.quick else args.clients
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        if args.part in ("all", "peers"):
            peers = 400 if args.quick else args.peers
            run_peers(Path(tmp), peers, 1 if args.quick else args.reps, args.before_src)
        if args.part == "peers":
            return 0
        before = None
        if args.before_src:
            old = Coordinator(Path(tmp) / "before", src=args.before_src)
            try:
                before = asyncio.run(before_registrations(old.port, clients))
            finally:
                old.stop()
        coord = Coordinator(Path(tmp) / "c")
        try:
            ok = asyncio.run(scale(coord, clients, before))
        finally:
            coord.stop()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
