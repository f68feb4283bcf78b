"""Rounds over loopback: round time vs raw transfer, contributions/s, coordinator peak memory.

1. One round, 8 peers each submitting a 64 MiB update to a `tensorswap serve` process:
   round time (first byte sent -> every peer holds the aggregate's CID) as a ratio of the
   time raw sockets (sendall / recv_into, 8 connections) take to move the same bytes to
   another process. Raw transfers and rounds take turns (``--reps`` each, new values every
   round); each round is divided by the raw time measured just before it, and the median
   ratio with its spread is reported. Goal <= 1.5x.
2. The coordinator process's peak RSS during those rounds, as a multiple of one update
   (the worst round, from the RSS before the first). Goal <= 3x (FedAvg folds
   contributions as they arrive; blocks are read memory-mapped).
3. 1,000 peers with tiny updates in one round: contributions per second, durable, as
   RoundClients (one peer per submit: offer + push + submit, or one inline submit request
   carrying the blocks) with and without group commit, and as VirtualClients (batched
   ``submit_batch`` requests); ratios against the first row (a coordinator from before,
   with ``--before-src``), and inline against offer + push + submit. Goal >= 3,000/s.
4. The CPU one small request costs (``status`` over 8 connections, client and server in
   one process), against a ``--before-src`` checkout run the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np

from benchmarks.__main__ import ratio_line
from tensorswap.cid import Cid
from tensorswap.rounds.client import PeerSubmit, RoundClient, VirtualClients
from tensorswap.rounds.core import Complete, RoundId, RoundSpec
from tensorswap.store import ModelUpdate, put_update

MiB = 1024 * 1024


# ── raw socket baseline ──────────────────────────────────────────────────────
def _raw_receiver(
    listener: socket.socket, peers: int, nbytes: int, files: str | None = None
) -> None:
    """Accept ``peers`` connections; read ``nbytes`` from each into one reused buffer; ack.

    With ``files`` (a directory), every 4 MiB received is also written to a new file there,
    as the least any receiver that keeps what it receives on disk does (no hashing).
    """

    def drain(conn: socket.socket) -> None:
        block = 4 * MiB
        buf = memoryview(bytearray(block))
        got = 0
        with conn:
            while got < nbytes:
                want = min(block, nbytes - got)
                filled = 0
                while filled < want:
                    n = conn.recv_into(buf[filled:want])
                    if n == 0:
                        raise SystemExit(f"raw receiver: EOF after {got + filled} bytes")
                    filled += n
                if files is not None:
                    path = os.path.join(files, f"{threading.get_ident()}-{got}")
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                    try:
                        os.write(fd, buf[:want])
                    finally:
                        os.close(fd)
                got += want
            conn.sendall(b"k")

    threads = []
    with listener:
        for _ in range(peers):
            conn, _ = listener.accept()
            t = threading.Thread(target=drain, args=(conn,))
            t.start()
            threads.append(t)
    for t in threads:
        t.join()


def raw_transfer_seconds(peers: int, nbytes: int, files: str | None = None) -> float:
    """Seconds for ``peers`` connections to each move ``nbytes`` into another process
    (which writes them to new files in ``files`` if given)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    ctx = mp.get_context("fork")
    proc = ctx.Process(target=_raw_receiver, args=(listener, peers, nbytes, files))
    proc.start()
    listener.close()
    payload = np.ones(nbytes // 4, np.float32).data.cast("B")
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(peers)]

    def send(sock: socket.socket) -> None:
        sock.sendall(payload)
        sock.recv(1)

    start = time.perf_counter()
    threads = [threading.Thread(target=send, args=(s,)) for s in socks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    for s in socks:
        s.close()
    proc.join()
    return seconds


# ── a coordinator process ────────────────────────────────────────────────────
class Coordinator:
    """`python -m tensorswap.cli.serve_cmd` on a free port, in a fresh data directory."""

    def __init__(self, data: Path, *extra: str, src: str | None = None) -> None:
        cmd = [sys.executable, "-m", "tensorswap.cli.serve_cmd", "--listen", "127.0.0.1:0"]
        cmd += ["--data", str(data), "--log-level", "warning", *extra]
        env = None if src is None else {**os.environ, "PYTHONPATH": src}
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
        )
        assert self.proc.stderr is not None
        while True:
            ready, _, _ = select.select([self.proc.stderr], [], [], 60)
            line = self.proc.stderr.readline() if ready else ""
            if not line:
                self.stop()
                raise RuntimeError("coordinator did not start")
            if line.startswith("listening on "):
                self.port = int(line.rsplit(":", 1)[1])
                return

    def cpu_seconds(self) -> float:
        """CPU time (user + system) the coordinator process has used so far."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def memory(self) -> tuple[int, int]:
        """(VmRSS, VmHWM) in bytes."""
        fields = {}
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) * 1024
        return fields["VmRSS"], fields["VmHWM"]

    def reset_peak(self) -> None:
        """Reset VmHWM to the current RSS (Linux: write 5 to clear_refs)."""
        Path(f"/proc/{self.proc.pid}/clear_refs").write_text("5")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.wait(timeout=60)
        if self.proc.stderr is not None:
            self.proc.stderr.close()


# ── 1 + 2: one round of big updates ──────────────────────────────────────────
async def big_round(
    port: int, peers: int, nbytes: int, rep: int = 0, deterministic: bool = False, cut: bool = True
) -> tuple[float, float, float]:
    """(round seconds, seconds until every submit was accepted, aggregation seconds).

    Round ``rep + 1`` (``RoundSpec.deterministic`` with ``deterministic``). Every update
    holds random values of its own, so every chunk is a
    distinct block and all ``peers * nbytes`` bytes cross the wire (constant values would
    make all chunks of an update one block, sent once). ``cut``: the peers announce, so the
    round cuts through and streams the aggregate back to each of them while it uploads (the
    README's path); False: a barrier round, uploads only.
    """
    rid = RoundId(rep + 1, "bench")
    clients = [await RoundClient.connect("127.0.0.1", port, peer=f"peer-{i}") for i in range(peers)]
    for client in clients:
        client.cut.enabled = cut
    try:
        cids = []
        for i, client in enumerate(clients):
            rng = np.random.default_rng([rep, i])
            values = rng.standard_normal(nbytes // 4, dtype=np.float32)
            cids.append(put_update(client.store, ModelUpdate({"w": values}, 1 + i)))
        spec = RoundSpec(peers, deterministic=deterministic)
        await clients[0].start_round(rid, spec)
        accepted: list[float] = []

        async def one(client: RoundClient, cid: Cid) -> None:
            await client.submit(rid, cid)
            accepted.append(time.perf_counter())
            assert isinstance(await client.wait(rid, timeout=600), Complete)

        start = time.perf_counter()
        await asyncio.gather(*(one(c, cid) for c, cid in zip(clients, cids, strict=True)))
        seconds = time.perf_counter() - start
        report = await clients[0].server_status()
        aggregation = float(report.stats["last_aggregation_seconds"])
        return seconds, max(accepted) - start, aggregation
    finally:
        for client in clients:
            await client.aclose()


def _spread(values: list[float]) -> str:
    return f"median {statistics.median(values):.3f} (min {min(values):.3f}, max {max(values):.3f})"


def run_big(tmp: Path, peers: int, size: int, reps: int) -> bool:
    """Raw transfer and a round take turns, ``reps`` times each, on one coordinator.

    Each round is compared with the raw transfer measured just before it (same load); the
    coordinator's peak RSS is measured from its RSS before the first round.
    """
    coord = Coordinator(tmp / "big")
    raws, rounds, ratios, accepted, aggregation, peaks = [], [], [], [], [], []
    stored, stored_ratios, barriers = [], [], []
    try:
        base_rss, _ = coord.memory()
        for rep in range(reps):
            raws.append(raw_transfer_seconds(peers, size))
            files = tmp / f"raw-files-{rep}"
            files.mkdir()
            stored.append(raw_transfer_seconds(peers, size, str(files)))
            coord.reset_peak()
            seconds, submitted, agg = asyncio.run(big_round(coord.port, peers, size, rep))
            _, peak = coord.memory()
            rounds.append(seconds)
            ratios.append(seconds / raws[-1])
            stored_ratios.append(seconds / stored[-1])
            accepted.append(submitted)
            aggregation.append(agg)
            peaks.append((peak - base_rss) / size)
            barrier = asyncio.run(big_round(coord.port, peers, size, 100 + rep, cut=False))
            barriers.append(barrier[0] / stored[-1])
    finally:
        coord.stop()
    mib = size // MiB
    ratio, memory = statistics.median(ratios), max(peaks)
    print(f"{peers} x {mib} MiB, {reps} rounds, each after a raw transfer (seconds):")
    print(f"  raw sockets          {_spread(raws)}")
    print(f"  raw + files          {_spread(stored)}  (context: raw, each 4 MiB to a new file)")
    print(f"  round                {_spread(rounds)}")
    print(f"    all accepted       {_spread(accepted)}")
    print(f"    final aggregation  {_spread(aggregation)}")
    print(f"  round / raw + files  {_spread(stored_ratios)}  (the aggregate streamed back too)")
    print(f"  barrier round / raw + files {_spread(barriers)}  (cut-through off, uploads only)")
    print(f"  round / raw          {_spread(ratios)} -> {ratio:.2f}x (goal <= 1.5x)")
    # The coordinator keeps every accepted block in its directory store (they must survive a
    # kill -9), so no round can beat moving the bytes and writing them to files, hashing aside.
    floor = statistics.median(s / r for s, r in zip(stored, raws, strict=True))
    print(f"  floor on this machine: raw + files / raw = {floor:.2f}x (no hashing, no Python)")
    print(f"coordinator peak RSS growth: {memory:.2f}x one update, worst round (goal <= 3x)")
    return ratio <= 1.5 and memory <= 3.0


# ── 3: many peers, tiny updates ──────────────────────────────────────────────
async def many_peers(port: int, peers: int, connections: int, inline: bool = True) -> float:
    """``peers`` RoundClient submits over ``connections`` connections, one request each
    (``inline``: the blocks ride in the submit) or offer, push and submit (not ``inline``)."""
    rid = RoundId(2, "bench")
    clients = [
        await RoundClient.connect("127.0.0.1", port, peer=f"c{i}") for i in range(connections)
    ]
    for client in clients:
        client.inline = inline
    try:
        await clients[0].start_round(rid, RoundSpec(peers))
        per = peers // connections

        async def run(k: int, client: RoundClient) -> None:
            for j in range(per):
                client.peer = f"peer-{k}-{j}"
                await client.submit(rid, {"w": np.full(16, float(j), np.float32)}, 1)

        start = time.perf_counter()
        await asyncio.gather(*(run(k, c) for k, c in enumerate(clients)))
        await clients[0].wait(rid, timeout=600)
        return time.perf_counter() - start
    finally:
        for client in clients:
            await client.aclose()


async def many_virtual(port: int, peers: int, connections: int, batch: int | None) -> float:
    """``peers`` virtual peers over ``connections`` connections (one of them for the wait):
    ``batch`` None submits each peer on its own at once (coalesced), else ``submit_many``
    in requests of ``batch`` items."""
    pool = await VirtualClients.connect("127.0.0.1", port, connections=connections)
    rid = RoundId(3, "bench")
    try:
        await pool.clients[0].start_round(rid, RoundSpec(peers))
        items = [
            PeerSubmit(f"peer-{i}", {"w": np.full(16, float(i % 20), np.float32)}, 1)
            for i in range(peers)
        ]
        start = time.perf_counter()
        if batch is None:
            who = [pool.peer(item.peer) for item in items]
            outcomes = await asyncio.gather(
                *(p.submit(rid, item.update, 1) for p, item in zip(who, items, strict=True))
            )
        else:
            outcomes = list(await pool.submit_many(rid, items, batch=batch))
        assert not any(isinstance(o, Exception) for o in outcomes), outcomes[:3]
        assert isinstance(await pool.wait(rid, timeout=600), Complete)
        return time.perf_counter() - start
    finally:
        await pool.aclose()


def run_tiny(
    tmp: Path, peers: int, connections: int, before_src: str | None = None, reps: int = 3
) -> bool:
    """Tiny contributions per second, durable (synchronous=FULL) unless marked, every
    answer after its contribution committed; ratios against the first row: with
    ``before_src`` (the ``src`` of a checkout before this work) a coordinator run from it,
    else this coordinator with a transaction per contribution."""
    rows: list[tuple[str, float, float]] = []
    costs: list[tuple[float, float]] = []
    Config = tuple[str, tuple[str, ...], Callable[[int], Awaitable[float]]]
    configs: list[Config] = []
    if before_src is not None:
        configs.append(
            (
                f"RoundClient x {connections}, coordinator from {before_src} (before)",
                ("--src", before_src),
                lambda port: many_peers(port, peers, connections),
            )
        )
    configs += [
        (
            f"RoundClient x {connections}, offer + push + submit, group commit",
            (),
            lambda port: many_peers(port, peers, connections, inline=False),
        ),
        (
            f"RoundClient x {connections}, inline submit (one request), no group commit",
            ("--no-group-commit",),
            lambda port: many_peers(port, peers, connections),
        ),
        (
            f"RoundClient x {connections}, inline submit (one request), group commit",
            (),
            lambda port: many_peers(port, peers, connections),
        ),
        (
            f"RoundClient x {connections}, inline submit, fast-commit (not durable)",
            ("--fast-commit",),
            lambda port: many_peers(port, peers, connections),
        ),
        (
            "VirtualClients, each peer's submit on its own (coalesced), 3 connections",
            (),
            lambda port: many_virtual(port, peers, 3, None),
        ),
        (
            "VirtualClients.submit_many, batches of 1000, 2 connections",
            (),
            lambda port: many_virtual(port, peers, 2, 1000),
        ),
        (
            "the same, --sync-blocks (blocks flushed before each commit)",
            ("--sync-blocks",),
            lambda port: many_virtual(port, peers, 2, 1000),
        ),
        (
            f"RoundClient x {connections}, inline submit, --sync-blocks",
            ("--sync-blocks",),
            lambda port: many_peers(port, peers, connections),
        ),
    ]
    rates: list[list[float]] = [[] for _ in configs]
    cpus: list[list[tuple[float, float]]] = [[] for _ in configs]
    for rep in range(reps):  # rows take turns, so that the machine's load hits them alike
        for i, (_label, extra, run) in enumerate(configs):
            src = extra[1] if extra[:1] == ("--src",) else None
            coord = Coordinator(tmp / f"tiny-{i}-{rep}", *(() if src else extra), src=src)
            try:
                served, mine = coord.cpu_seconds(), time.process_time()
                rates[i].append(peers / asyncio.run(run(coord.port)))
                cpus[i].append((coord.cpu_seconds() - served, time.process_time() - mine))
            finally:
                coord.stop()
    for (label, _, _), got, cpu in zip(configs, rates, cpus, strict=True):
        rows.append((label, max(got), statistics.median(got)))
        server_us = statistics.median(c[0] for c in cpu) / peers * 1e6
        client_us = statistics.median(c[1] for c in cpu) / peers * 1e6
        costs.append((server_us, client_us))
    base = rows[0][1]
    print(
        f"{peers} peers, tiny updates (16 float32), one round, contributions per second "
        f"(best and median of {reps}; ratio of the bests), and CPU per contribution "
        "(medians; coordinator process + this client process, connecting included):"
    )
    for (label, rate, median), (server_us, client_us) in zip(rows, costs, strict=True):
        print(
            f"  {rate:7.0f}/s (median {median:5.0f})  {rate / base:5.2f}x  "
            f"cpu {server_us:4.0f} + {client_us:4.0f} us  {label}"
        )
    best = max(rate for label, rate, _ in rows if "not durable" not in label)
    print(f"  best durable: {best:.0f}/s, {best / base:.2f}x the first row (goal >= 3000/s)")
    print(ratio_line("tiny_durable_vs_before", best / base))
    labels = [label for label, _, _ in rows]
    plain = next(i for i, label in enumerate(labels) if "offer + push" in label)
    inline = next(i for i, label in enumerate(labels) if "inline submit (one request), g" in label)
    print(
        f"  one request per submit: inline {rows[inline][1]:.0f}/s vs offer + push + submit "
        f"{rows[plain][1]:.0f}/s; CPU per contribution {sum(costs[inline]):.0f} vs "
        f"{sum(costs[plain]):.0f} us (coordinator {costs[inline][0]:.0f} vs {costs[plain][0]:.0f})"
    )
    print(ratio_line("tiny_roundclient_inline_vs_plain", rows[inline][1] / rows[plain][1]))
    print(ratio_line("tiny_cpu_inline_vs_plain", sum(costs[inline]) / sum(costs[plain]), "<=", 1))
    return True


# ── 4: the cost of one small request ───────────────────────────────────────
_REQUESTS = """
import asyncio, sys, tempfile, time
from pathlib import Path
from tensorswap.rounds import Coordinator, RoundClient, RoundId, RoundServer, RoundSpec

async def main(connections, each):
    with tempfile.TemporaryDirectory() as d, Coordinator.open(Path(d), run_timer=False) as co:
        async with await RoundServer(co).start() as server:
            clients = [await RoundClient.connect("127.0.0.1", server.port, peer=f"c{i}")
                       for i in range(connections)]
            rid = RoundId(1, "requests")
            await clients[0].start_round(rid, RoundSpec(2))
            async def loop(client):
                for _ in range(each):
                    await client.status(rid)
            cpu = time.process_time()
            await asyncio.gather(*(loop(c) for c in clients))
            print((time.process_time() - cpu) / (connections * each))
            for client in clients:
                await client.aclose()

asyncio.run(main(int(sys.argv[1]), int(sys.argv[2])))
"""


def request_cpu(src: str | None, connections: int = 8, each: int = 1000) -> float:
    """CPU seconds per ``status`` request, client and server in one process (``src``: run
    from that source tree, else this one)."""
    env = None if src is None else {**os.environ, "PYTHONPATH": src}
    cmd = [sys.executable, "-c", _REQUESTS, str(connections), str(each)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


def run_requests(before_src: str | None, reps: int = 3) -> None:
    """One small request's CPU (both sides: the frames, the wire, the event loop)."""
    mine, before = [], []
    for _ in range(reps):  # taking turns
        mine.append(request_cpu(None))
        if before_src is not None:
            before.append(request_cpu(before_src))
    now = statistics.median(mine)
    print(f"one status request over 8 connections, CPU of both sides: {now * 1e6:.0f} us")
    if before:
        then = statistics.median(before)
        print(f"  a checkout from {before_src}: {then * 1e6:.0f} us (medians of {reps})")
        print(ratio_line("request_cpu_vs_before", now / then, "<=", 1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="8 x 4 MiB, 100 peers")
    parser.add_argument("--part", choices=["all", "big", "tiny", "requests"], default="all")
    parser.add_argument("--reps", type=int, default=5, help="rounds of the big part")
    parser.add_argument(
        "--before-src",
        metavar="DIR",
        help="tiny part: also run a coordinator from this src directory (a checkout before "
        "group commit) as the baseline row",
    )
    args = parser.parse_args(argv)
    peers, size = 8, (4 if args.quick else 64) * MiB
    tiny_peers, connections = (100, 10) if args.quick else (1000, 50)
    ok = True
    with tempfile.TemporaryDirectory(prefix="bench-rounds-") as tmp:
        if args.part in ("all", "big"):
            ok = run_big(Path(tmp), peers, size, 2 if args.quick else args.reps)
        if args.part in ("all", "tiny"):
            run_tiny(Path(tmp), tiny_peers, connections, args.before_src, 1 if args.quick else 3)
        if args.part in ("all", "requests"):
            run_requests(args.before_src, 1 if args.quick else 3)
    print(f"cores: {os.cpu_count()}, load average: {os.getloadavg()[0]:.1f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
