"""10,000 clients on one coordinator: status latency and memory per client.

A `tensorswap serve` process; 10,000 peers register for runs (``RunClient.register`` over
the connections of one VirtualClients, each peer under its own name), then all of them
contribute a tiny update to one round of 10,001 (so it stays open), batched. Printed:

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


async def scale(coord: Coordinator, clients: int) -> bool:
    rid = RoundId(1, "scale")
    pool = await VirtualClients.connect("127.0.0.1", coord.port, connections=4)
    try:
        names = [f"client-{i:05}" for i in range(clients)]
        rss0, _ = coord.memory()
        threads0 = _threads(coord.proc.pid)
        start = time.perf_counter()
        per = len(pool.clients)

        async def register(k: int) -> None:
            for name in names[k::per]:
                await RunClient(pool.client_for(name, k)).register({"num_samples": 10})

        await asyncio.gather(*(register(k) for k in range(per)))
        registered = time.perf_counter() - start
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
    print(
        f"{clients} clients: registered in {registered:.2f} s, contributed in {submitted:.2f} s "
        f"({clients / submitted:.0f}/s, batched)"
    )
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
    args = parser.parse_args(argv)
    clients = 1000 if args.quick else args.clients
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        coord = Coordinator(Path(tmp) / "c")
        try:
            ok = asyncio.run(scale(coord, clients))
        finally:
            coord.stop()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
