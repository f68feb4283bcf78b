"""Rounds over loopback: round time vs raw transfer, contributions/s, coordinator peak memory.

1. One round, 8 peers each submitting a 64 MiB update to a `tensorswap serve` process:
   round time (first byte sent -> every peer holds the aggregate's CID) as a ratio of the
   time raw sockets (sendall / recv_into, 8 connections) take to move the same bytes to
   another process. Goal <= 1.5x.
2. The coordinator process's peak RSS during that round, as a multiple of one update.
   Goal <= 3x (FedAvg folds contributions as they arrive; blocks are read memory-mapped).
3. 1,000 peers with tiny updates in one round: contributions per second.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from tensorswap.cid import Cid
from tensorswap.rounds.client import RoundClient
from tensorswap.rounds.state import Complete, RoundId, RoundSpec
from tensorswap.store import ModelUpdate, put_update

MiB = 1024 * 1024


# ── raw socket baseline ──────────────────────────────────────────────────────
def _raw_receiver(listener: socket.socket, peers: int, nbytes: int) -> None:
    """Accept ``peers`` connections; read ``nbytes`` from each into one reused buffer; ack."""

    def drain(conn: socket.socket) -> None:
        buf = memoryview(bytearray(8 * MiB))
        got = 0
        with conn:
            while got < nbytes:
                n = conn.recv_into(buf)
                if n == 0:
                    break
                got += n
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


def raw_transfer_seconds(peers: int, nbytes: int) -> float:
    """Seconds for ``peers`` connections to each move ``nbytes`` into another process."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    ctx = mp.get_context("fork")
    proc = ctx.Process(target=_raw_receiver, args=(listener, peers, nbytes))
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

    def __init__(self, data: Path, *extra: str) -> None:
        cmd = [sys.executable, "-m", "tensorswap.cli.serve_cmd", "--listen", "127.0.0.1:0"]
        cmd += ["--data", str(data), "--log-level", "warning", *extra]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
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
async def big_round(port: int, peers: int, nbytes: int) -> tuple[float, float, float]:
    """(round seconds, seconds until every submit was accepted, aggregation seconds)."""
    rid = RoundId(1, "bench")
    clients = [await RoundClient.connect("127.0.0.1", port, peer=f"peer-{i}") for i in range(peers)]
    try:
        cids = []
        for i, client in enumerate(clients):
            values = np.full(nbytes // 4, float(i), np.float32)
            cids.append(put_update(client.store, ModelUpdate({"w": values}, 1 + i)))
        await clients[0].start_round(rid, RoundSpec(peers))
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


def run_big(tmp: Path, peers: int, size: int) -> bool:
    raw = min(raw_transfer_seconds(peers, size) for _ in range(3))
    coord = Coordinator(tmp / "big")
    try:
        base_rss, _ = coord.memory()
        coord.reset_peak()
        seconds, submitted, aggregation = asyncio.run(big_round(coord.port, peers, size))
        _, peak = coord.memory()
    finally:
        coord.stop()
    ratio = seconds / raw
    memory = (peak - base_rss) / size
    mib = size // MiB
    print(f"raw sockets: {peers} x {mib} MiB in {raw:.3f} s ({peers * mib / raw:.0f} MiB/s)")
    print(
        f"round:       {peers} x {mib} MiB in {seconds:.3f} s -> {ratio:.2f}x raw (goal <= 1.5x);"
        f" all accepted after {submitted:.3f} s, final aggregation {aggregation:.3f} s"
    )
    print(f"coordinator peak RSS growth: {memory:.2f}x one update (goal <= 3x)")
    return ratio <= 1.5 and memory <= 3.0


# ── 3: many peers, tiny updates ──────────────────────────────────────────────
async def many_peers(port: int, peers: int, connections: int) -> float:
    rid = RoundId(2, "bench")
    clients = [
        await RoundClient.connect("127.0.0.1", port, peer=f"c{i}") for i in range(connections)
    ]
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


def run_tiny(tmp: Path, peers: int, connections: int) -> None:
    for label, extra in (("durable", ()), ("fast-commit", ("--fast-commit",))):
        coord = Coordinator(tmp / f"tiny-{label}", *extra)
        try:
            seconds = asyncio.run(many_peers(coord.port, peers, connections))
        finally:
            coord.stop()
        print(
            f"{peers} peers, tiny updates ({label}, {connections} connections): "
            f"{seconds:.2f} s, {peers / seconds:.0f} contributions/s"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="8 x 4 MiB, 100 peers")
    parser.add_argument("--part", choices=["all", "big", "tiny"], default="all")
    args = parser.parse_args(argv)
    peers, size = 8, (4 if args.quick else 64) * MiB
    tiny_peers, connections = (100, 10) if args.quick else (1000, 50)
    ok = True
    with tempfile.TemporaryDirectory(prefix="bench-rounds-") as tmp:
        if args.part in ("all", "big"):
            ok = run_big(Path(tmp), peers, size)
        if args.part in ("all", "tiny"):
            run_tiny(Path(tmp), tiny_peers, connections)
    print(f"cores: {os.cpu_count()}, load average: {os.getloadavg()[0]:.1f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
