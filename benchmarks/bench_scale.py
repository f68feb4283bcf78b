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
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.__main__ import ratio_line
from benchmarks.bench_rounds import Coordinator
from tensorswap.rounds.paging import page_peers, page_rounds
from tensorswap.rounds.state import Collecting, RoundId, RoundSpec
from tensorswap.rounds.virtual import PeerSubmit, VirtualClients
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="1,000 clients")
    parser.add_argument("--clients", type=int, default=10_000)
    parser.add_argument(
        "--before-src",
        metavar="DIR",
        help="also time one-request registrations on a coordinator run from this src "
        "directory (a checkout before grouped registrations)",
    )
    args = parser.parse_args(argv)
    clients = 1000 if args.quick else args.clients
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
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
