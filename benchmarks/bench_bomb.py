"""Decompression bombs against `tensorswap serve`: its resident memory before, during, after.

Six connections send, between them, 40 BLOCK frames that claim zstd-compressed 256 MiB of
zeros (8 KB on the wire each) under a CID they do not match. Each connection sends a frame,
waits up to ``--pause`` seconds for the server to answer or close, reconnects if it did, and
sends the next. Measured from ``/proc/PID/status`` of the server process: VmRSS at baseline
(started, idle), the peak (VmHWM, reset after start, and VmRSS sampled every 10 ms) while the
bombs arrive, and VmRSS ``--after`` seconds once the last bomb was answered. Then one honest
4 MiB push checks the server still stores blocks. Goal: RSS after <= 1.5x baseline.

``--src DIR`` runs the server from another source tree (an unfixed checkout, to compare);
``--max-inflight-bytes`` is passed to it when given; ``--command recv`` attacks `tensorswap
recv` instead (a plain BlockServer, without serve's allocator settings).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import select
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from tensorswap.cid import Cid
from tensorswap.store import MemoryStore
from tensorswap.wire.auth import client_handshake
from tensorswap.wire.client import BlockClient
from tensorswap.wire.connection import FrameConnection, Timeouts, prepare_block
from tensorswap.wire.errors import WireError
from tensorswap.wire.frames import Compression, FrameHeader, FrameKind, crc32c, pack_block_prefix
from tensorswap.wire.tcp import connect_tcp

try:
    from benchmarks.__main__ import ratio_line
except ImportError:  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks.__main__ import ratio_line

MiB = 1 << 20
GOAL_AFTER = 1.5
_CLI = "import sys; from tensorswap.cli import main; sys.exit(main(sys.argv[1:]))"


class Server:
    """`tensorswap serve` (or `recv`) on a free port, its memory read from /proc."""

    def __init__(self, command: str, data: Path, src: str | None, extra: list[str]) -> None:
        cmd = [sys.executable, "-c", _CLI, command, "--listen", "127.0.0.1:0", *extra]
        if command == "serve":
            cmd += ["--data", str(data), "--log-level", "error"]
        else:
            cmd += ["--out", str(data)]
        env = dict(os.environ)
        if src is not None:
            env["PYTHONPATH"] = src
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
        )
        assert self.proc.stderr is not None
        while True:
            ready, _, _ = select.select([self.proc.stderr], [], [], 60)
            line = self.proc.stderr.readline() if ready else ""
            if not line:
                self.stop()
                raise RuntimeError("the server did not start")
            if line.startswith("listening on "):
                self.port = int(line.rsplit(":", 1)[1])
                break
        # the rest of stderr is drained, so that a chatty server never blocks on it
        threading.Thread(target=self.proc.stderr.read, daemon=True).start()

    def status(self, *keys: str) -> dict[str, int]:
        fields = {}
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in keys:
                fields[key] = int(value.split()[0]) * 1024
        return fields

    def rss(self) -> int:
        return self.status("VmRSS")["VmRSS"]

    def reset_peak(self) -> None:
        Path(f"/proc/{self.proc.pid}/clear_refs").write_text("5")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.wait(timeout=60)


class Sampler:
    """The highest VmRSS seen, read every ``interval`` seconds in a thread."""

    def __init__(self, server: Server, interval: float = 0.01) -> None:
        self.server = server
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(OSError, KeyError):
                self.peak = max(self.peak, self.server.rss())
            self._stop.wait(self.interval)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def bomb_frame(raw_len: int) -> bytes:
    packed = bytes(prepare_block(Cid.of(b"x"), bytes(raw_len), Compression.ZSTD).parts[0])
    payload = pack_block_prefix(Cid.of(b"not 256 MiB of zeros"), raw_len) + packed
    header = FrameHeader(FrameKind.BLOCK, len(payload), crc32c(payload), 0, int(Compression.ZSTD))
    return header.pack() + payload


class Bombs:
    """``total`` frames shared out over ``connections`` workers (see the module docstring)."""

    def __init__(self, port: int, frame: bytes, total: int, pause: float) -> None:
        self.port = port
        self.frame = frame
        self.left = total
        self.pause = pause
        self.sent = 0
        self.connects = 0
        self.answered = 0  # connections the server answered (ERROR) or closed
        self.refused = 0  # connect or handshake refused (over max-connections, ...)

    async def _connect(self) -> FrameConnection | None:
        try:
            transport = await connect_tcp("127.0.0.1", self.port, timeout=10)
            conn = FrameConnection(transport, timeouts=Timeouts(read=60, handshake=30))
            await client_handshake(conn, None)
        except (WireError, OSError):
            self.refused += 1
            return None
        self.connects += 1
        return conn

    async def worker(self) -> None:
        conn: FrameConnection | None = None
        ended: asyncio.Future[object] | None = None
        try:
            while self.left > 0:
                if conn is None or ended is None or ended.done():
                    if conn is not None:
                        conn.transport.abort()
                    conn = await self._connect()
                    if conn is None:
                        await asyncio.sleep(0.1)
                        continue
                    ended = asyncio.ensure_future(conn.receive_frame(timeout=None))
                if self.left <= 0:  # others sent the rest while this one connected
                    break
                self.left -= 1
                try:
                    await conn.transport.send(self.frame)
                except (WireError, OSError):
                    continue  # closed under us: reconnect
                self.sent += 1
                done, _ = await asyncio.wait([ended], timeout=self.pause)
                if done:
                    self.answered += 1
                    with contextlib.suppress(Exception):
                        ended.result()
            if ended is not None and not ended.done():  # the last frame's answer, if any
                done, _ = await asyncio.wait([ended], timeout=max(self.pause, 5.0))
                self.answered += len(done)
        finally:
            if ended is not None:
                ended.cancel()
                with contextlib.suppress(BaseException):
                    await ended
            if conn is not None:
                conn.transport.abort()


async def honest_push(port: int) -> bool:
    """Push one 4 MiB block (zstd) and commit it; True if the server confirmed it."""
    store = MemoryStore()
    cid = store.put(np.arange(MiB, dtype=np.float32).tobytes())
    try:
        async with await BlockClient.connect("127.0.0.1", port) as client:
            await client.put_blocks(store, [cid], compression=Compression.ZSTD)
            committed = await client.commit([cid])
    except (WireError, OSError) as exc:
        print(f"honest push failed: {exc}")
        return False
    return committed.blocks == 1


def run(args: argparse.Namespace) -> float:
    extra = []
    if args.max_inflight_bytes is not None:
        extra += ["--max-inflight-bytes", args.max_inflight_bytes]
    frame = bomb_frame(args.raw_mib * MiB)
    with tempfile.TemporaryDirectory(prefix="bench-bomb-") as tmp:
        server = Server(args.command, Path(tmp) / "data", args.src, extra)
        try:
            time.sleep(1.0)  # let start-up allocations settle
            baseline = server.rss()
            server.reset_peak()
            sampler = Sampler(server)
            bombs = Bombs(server.port, frame, args.frames, args.pause)
            start = time.perf_counter()

            async def attack() -> None:
                await asyncio.gather(*(bombs.worker() for _ in range(args.connections)))

            asyncio.run(attack())
            seconds = time.perf_counter() - start
            peak = max(sampler.stop(), server.status("VmHWM")["VmHWM"])
            at_end = server.rss()
            time.sleep(args.after)
            after = server.rss()
            pushed = asyncio.run(honest_push(server.port))
        finally:
            server.stop()
    tree = args.src or "this tree"
    budget = args.max_inflight_bytes or "default"
    traffic = bombs.sent * len(frame) / 1e3
    print(f"`tensorswap {args.command}` from {tree}, --max-inflight-bytes {budget}:")
    print(
        f"  {bombs.sent} frames of {len(frame)} bytes ({traffic:.0f} KB, raw_len "
        f"{args.raw_mib} MiB each) over {bombs.connects} connections ({args.connections} at "
        f"once) in {seconds:.1f} s; {bombs.answered} answered or closed by the server, "
        f"{bombs.refused} connects refused"
    )
    print(f"  RSS baseline          {baseline / MiB:8.0f} MiB")
    print(f"  RSS peak              {peak / MiB:8.0f} MiB")
    print(f"  RSS when bombs ended  {at_end / MiB:8.0f} MiB")
    print(f"  RSS {args.after:g} s after         {after / MiB:8.0f} MiB")
    print(f"  honest 4 MiB push afterwards: {'stored' if pushed else 'FAILED'}")
    return after / baseline


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="12 frames of 64 MiB")
    parser.add_argument("--frames", type=int, default=40)
    parser.add_argument("--connections", type=int, default=6)
    parser.add_argument("--raw-mib", type=int, default=256, help="raw_len each frame claims")
    parser.add_argument("--pause", type=float, default=0.5, help="seconds between frames")
    parser.add_argument("--after", type=float, default=3.0, help="seconds before 'after'")
    parser.add_argument("--command", choices=["serve", "recv"], default="serve")
    parser.add_argument("--src", help="run the server from this source tree (its src/)")
    parser.add_argument("--max-inflight-bytes", help="passed to tensorswap serve")
    args = parser.parse_args(argv)
    if args.quick:
        args.frames, args.raw_mib = 12, 64
    ratio = run(args)
    print(ratio_line("bomb_rss_after_vs_baseline", ratio, "<=", GOAL_AFTER))
    print(f"cores: {os.cpu_count()}, load average: {os.getloadavg()[0]:.1f}")
    return 0 if ratio <= GOAL_AFTER else 1


if __name__ == "__main__":
    sys.exit(main())
