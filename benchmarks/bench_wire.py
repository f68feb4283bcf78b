"""Wire throughput: a float32 tensor to another process over loopback TCP, verified and stored.

Compares, in one run and against the same receiver-process setup:

- raw socket: ``sendall`` / ``recv_into`` of the tensor bytes into a preallocated buffer;
  beside it, for context, a naive verifying receiver: each 4 MiB received into fresh memory
  that it keeps (as a store must) and blake3-hashed, one after the other;
- tensorswap: ``BlockClient.push_tensor`` (chunking, blake3 and CRC32C in worker threads
  while earlier chunks are on the wire; offer/want dedup) to a ``BlockServer`` that checks
  CRC32C per frame and the CID per block and stores into a MemoryStore ("end to end");
  "push only" sends blocks already chunked and hashed into a local store (``push``);
- Arrow Flight DoPut of the same values (4 MiB record batches), read whole by the server;
- the ipfrs framing (seed 001): ``GradientStreamSession.stream_to`` / ``receive_from``.

Goals: tensorswap >= 0.6x raw socket and >= 1.5x Flight DoPut. Run ``python -m benchmarks
wire`` (or ``python benchmarks/bench_wire.py [--quick] [--mib N] [--reps N]``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

try:
    from benchmarks import best_pass_seconds
except ModuleNotFoundError:  # run as a script: python benchmarks/bench_wire.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks import best_pass_seconds

GOAL_VS_RAW = 0.6
GOAL_VS_FLIGHT = 1.5
_ACK = b"k"


# ── receivers (run in a child process) ───────────────────────────────────────
def _announce(port: int) -> None:
    print(port, flush=True)


def serve_raw(nbytes: int, reps: int, *, verify: bool = False) -> None:
    """Receive into one preallocated buffer; with ``verify``, as a naive verifying receiver
    would: each 4 MiB into fresh memory (kept, as a store keeps it), then blake3-hashed."""
    import blake3

    block = 4 * 1024 * 1024
    with socket.create_server(("127.0.0.1", 0)) as server:
        _announce(server.getsockname()[1])
        buf = memoryview(bytearray(nbytes))
        for _ in range(reps):
            conn, _ = server.accept()
            kept = []
            with conn:
                got = 0
                while got < nbytes:
                    if verify:
                        piece = memoryview(np.empty(min(block, nbytes - got), np.uint8))
                        _recv_exactly(conn, piece)
                        blake3.blake3(piece).digest()
                        kept.append(piece)
                        got += piece.nbytes
                        continue
                    n = conn.recv_into(buf[got:])
                    if not n:
                        raise SystemExit(f"raw: EOF after {got} bytes")
                    got += n
                conn.sendall(_ACK)


def _recv_exactly(conn: socket.socket, view: memoryview) -> None:
    got = 0
    while got < view.nbytes:
        n = conn.recv_into(view[got:])
        if not n:
            raise SystemExit("raw: EOF")
        got += n


def serve_tensorswap(reps: int, directory: str | None) -> None:
    from tensorswap.store import DirectoryStore, MemoryStore
    from tensorswap.store.base import BlockStore
    from tensorswap.wire import BlockServer, Transport, serve_tcp

    async def main() -> None:
        finished = asyncio.Semaphore(0)
        count = 0

        async def handle(transport: Transport) -> None:
            nonlocal count
            count += 1
            store: BlockStore = (
                DirectoryStore(Path(directory) / str(count)) if directory else MemoryStore()
            )
            server = BlockServer(store)
            await server.handle(transport)
            if server.errors:
                print(f"tensorswap receiver error: {server.errors[-1]}", file=sys.stderr)
            finished.release()

        async with await serve_tcp(handle) as listener:
            _announce(listener.port)
            for _ in range(reps):
                await finished.acquire()

    asyncio.run(main())


def serve_ipfrs(reps: int) -> None:
    from tensorswap.wire import GradientStreamSession, Transport, serve_tcp

    async def main() -> None:
        finished = asyncio.Semaphore(0)

        async def handle(transport: Transport) -> None:
            await GradientStreamSession("bench").receive_from(transport)
            await transport.send(_ACK)
            finished.release()

        async with await serve_tcp(handle) as listener:
            _announce(listener.port)
            for _ in range(reps):
                await finished.acquire()

    asyncio.run(main())


def serve_flight(reps: int) -> None:
    import pyarrow.flight as flight

    class Server(flight.FlightServerBase):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__("grpc://127.0.0.1:0")
            self.count = 0

        def do_put(self, context: object, descriptor: object, reader: object, writer: object):  # type: ignore[no-untyped-def]
            reader.read_all()  # type: ignore[attr-defined]
            self.count += 1

    server = Server()
    _announce(server.port)
    while server.count < reps:
        time.sleep(0.05)
    server.shutdown()


# ── senders (this process) ───────────────────────────────────────────────────
@contextlib.contextmanager
def receiver(kind: str, *args: str) -> Iterator[tuple[int, int]]:
    """Start ``kind``'s receiver in a child process; yield its port and process id."""
    here = Path(__file__).resolve().parent.parent
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")])
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.bench_wire", "--serve", kind, *args],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=here,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.strip().isdigit():
            raise RuntimeError(f"{kind} receiver did not start: {line!r}")
        yield int(line), proc.pid
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` so far (Linux /proc), or None."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """User + system CPU seconds of this process (all threads) so far."""
    return time.process_time()


def hashing_seconds(values: np.ndarray) -> tuple[float, float]:
    """Best-of-3 seconds to blake3 (one thread, 4 MiB blocks, as the wire does per block) and
    to CRC32C the bytes of ``values``: what each end must spend at least."""
    import blake3

    from tensorswap.wire.frames import crc32c

    data = memoryview(values).cast("B")
    block = 4 * 1024 * 1024
    pieces = [data[i : i + block] for i in range(0, data.nbytes, block)]

    blake = best_pass_seconds(lambda p: blake3.blake3(p, max_threads=1).digest(), pieces)
    return blake, best_pass_seconds(crc32c, pieces)


def send_raw(port: int, data: memoryview) -> float:
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(data)
        if conn.recv(1) != _ACK:
            raise RuntimeError("raw: no acknowledgement")
    return time.perf_counter() - start


def send_tensorswap(port: int, values: np.ndarray) -> tuple[float, float]:
    """(end-to-end seconds of the pipelined push_tensor, seconds of a push of stored blocks).

    Two connections; the receiver starts each with an empty store.
    """
    from tensorswap.codec import TensorBlock
    from tensorswap.store import MemoryStore, put_tensor
    from tensorswap.wire import BlockClient

    tensor = TensorBlock("bench", values)

    async def main() -> tuple[float, float]:
        start = time.perf_counter()
        async with await BlockClient.connect("127.0.0.1", port) as client:
            result = await client.push_tensor(tensor)
        end_to_end = time.perf_counter() - start
        if result.sent_bytes < values.nbytes:
            raise RuntimeError(f"tensorswap sent only {result.sent_bytes} bytes")
        store = MemoryStore()
        root = await asyncio.to_thread(put_tensor, store, tensor)
        start = time.perf_counter()
        async with await BlockClient.connect("127.0.0.1", port) as client:
            await client.push(store, root)
        return end_to_end, time.perf_counter() - start

    return asyncio.run(main())


def send_ipfrs(port: int, values: np.ndarray) -> float:
    from tensorswap.wire import GradientStreamSession, connect_tcp

    async def main() -> float:
        start = time.perf_counter()
        async with await connect_tcp("127.0.0.1", port) as transport:
            await GradientStreamSession("bench").stream_to(values, transport)
            ack = bytearray(1)
            await transport.receive_exactly(ack, "ack")
        return time.perf_counter() - start

    return asyncio.run(main())


def send_flight(port: int, values: np.ndarray) -> float:
    import pyarrow as pa
    import pyarrow.flight as flight

    per_batch = 1 << 20  # 4 MiB of float32 per record batch
    schema = pa.schema([pa.field("value", pa.float32(), nullable=False)])
    batches = [
        pa.record_batch([pa.array(values[i : i + per_batch])], schema=schema)
        for i in range(0, values.size, per_batch)
    ]
    client = flight.connect(f"grpc://127.0.0.1:{port}")
    try:
        start = time.perf_counter()
        writer, _ = client.do_put(flight.FlightDescriptor.for_path("bench"), schema)
        for batch in batches:
            writer.write_batch(batch)
        writer.close()
        return time.perf_counter() - start
    finally:
        client.close()


# ── driver ───────────────────────────────────────────────────────────────────
def _gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def run(mib: int, reps: int, directory: str | None) -> dict[str, float]:
    values = np.random.default_rng(0).standard_normal(mib * 1024 * 1024 // 4).astype(np.float32)
    nbytes = values.nbytes
    times: dict[str, list[float]] = {}

    def record(name: str, seconds: float) -> None:
        times.setdefault(name, []).append(seconds)

    flight_ok = True
    try:
        import pyarrow.flight  # noqa: F401
    except ImportError as exc:
        print(f"pyarrow.flight unavailable ({exc}); Flight is not measured")
        flight_ok = False

    raw = memoryview(values).cast("B")
    raw_cpu: list[float] = []

    def timed_raw(port: int, pid: int) -> None:
        before = (own_cpu_seconds(), process_cpu_seconds(pid))
        record("raw socket", send_raw(port, raw))
        after = (own_cpu_seconds(), process_cpu_seconds(pid))
        if before[1] is not None and after[1] is not None:
            raw_cpu.append(after[0] - before[0] + after[1] - before[1])

    ts_args = ["--dir", directory] if directory else []
    runs: list[tuple[str, list[str], Callable[[int, int], None]]] = [
        ("raw", ["--bytes", str(nbytes)], timed_raw),
        (
            "raw-verify",
            ["--bytes", str(nbytes)],
            lambda p, _: record("raw, naive store+blake3", send_raw(p, raw)),
        ),
        ("tensorswap", ts_args, lambda p, _: _ts(p, values, record)),
        ("ipfrs", [], lambda p, _: record("ipfrs framing", send_ipfrs(p, values))),
    ]
    if flight_ok:
        runs.append(("flight", [], lambda p, _: record("flight DoPut", send_flight(p, values))))
    # All receivers run at once and the methods take turns, so that a change in the
    # machine's load during the run affects every method alike.
    with contextlib.ExitStack() as stack:
        started = []
        for kind, extra, _ in runs:
            count = 2 * reps if kind == "tensorswap" else reps
            started.append(stack.enter_context(receiver(kind, "--reps", str(count), *extra)))
        for _ in range(reps):
            for (_, _, sender), (port, pid) in zip(runs, started, strict=True):
                sender(port, pid)
    rates = {name: _gbps(nbytes, secs) for name, secs in times.items()}
    print(f"\n{mib} MiB float32, loopback TCP, median of {reps} (GB/s = 1e9 bytes/s):")
    for name, rate in rates.items():
        secs = times[name]
        spread = f"{nbytes / max(secs) / 1e9:.2f}-{nbytes / min(secs) / 1e9:.2f}"
        median_ms = statistics.median(secs) * 1e3
        print(f"  {name:28s} {rate:6.2f} GB/s   ({median_ms:7.1f} ms; spread {spread} GB/s)")
    raw = times["raw socket"]
    for name in ("tensorswap (end to end)", "flight DoPut"):
        if name in times:  # each rep against the raw transfer of the same turn
            ratios = [r / t for r, t in zip(raw, times[name], strict=True)]
            print(
                f"  per turn, {name} / raw: median {statistics.median(ratios):.2f}"
                f" (min {min(ratios):.2f}, max {max(ratios):.2f})"
            )
    if raw_cpu:
        _print_ceiling(values, statistics.median(raw), statistics.median(raw_cpu))
    return rates


def _print_ceiling(values: np.ndarray, raw_wall: float, raw_cpu: float) -> None:
    """The best ratio to raw this machine allows a verified transfer, from costs measured now.

    Both processes share the machine's cores. A raw transfer costs ``raw_cpu`` CPU-seconds
    (both ends); a verified one costs at least that plus blake3 of every byte at each end
    (the sender to name blocks, the receiver to check them), or at one end for blocks hashed
    beforehand ("push only"). Block frames carry no CRC32C by default (lean blocks: the CID
    covers the bytes); with ``block_crc`` add CRC32C at both ends (shown for reference).
    With every core busy all the time and nothing else spent, its wall time is that CPU
    time over the cores.
    """
    cores = os.cpu_count() or 1
    blake, crc = hashing_seconds(values)
    for label, ends in (("end to end", 2), ("push only", 1)):
        cpu = raw_cpu + ends * blake
        best = max(raw_wall, cpu / cores)
        with_crc = max(raw_wall, (cpu + 2 * crc) / cores)
        print(
            f"  ceiling, {label}: raw CPU {raw_cpu * 1e3:.0f} ms + blake3 {blake * 1e3:.0f} ms"
            f" x {ends} on {cores} core(s) -> tensorswap / raw <= {raw_wall / best:.2f}x"
            f" (with block_crc, + CRC32C {crc * 1e3:.0f} ms x 2: <= {raw_wall / with_crc:.2f}x)"
        )


def _ts(port: int, values: np.ndarray, record: Callable[[str, float], None]) -> None:
    total, push = send_tensorswap(port, values)
    record("tensorswap (end to end)", total)
    record("tensorswap (push only)", push)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 MiB, 2 repetitions")
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", help="receiver stores blocks in a DirectoryStore here")
    parser.add_argument("--serve", choices=["raw", "raw-verify", "tensorswap", "ipfrs", "flight"])
    parser.add_argument("--bytes", type=int, default=0)
    args = parser.parse_args(argv)
    if args.serve:
        if args.serve in ("raw", "raw-verify"):
            serve_raw(args.bytes, args.reps, verify=args.serve == "raw-verify")
        elif args.serve == "tensorswap":
            serve_tensorswap(args.reps, args.dir)
        elif args.serve == "ipfrs":
            serve_ipfrs(args.reps)
        else:
            serve_flight(args.reps)
        return 0
    mib, reps = (16, 2) if args.quick else (args.mib, args.reps)
    rates = run(mib, reps, args.dir)
    ts = rates["tensorswap (end to end)"]
    vs_raw = ts / rates["raw socket"]
    print(f"  tensorswap / raw socket:   {vs_raw:.2f}x (goal >= {GOAL_VS_RAW}x)")
    ok = vs_raw >= GOAL_VS_RAW
    if "flight DoPut" in rates:
        vs_flight = ts / rates["flight DoPut"]
        print(f"  tensorswap / Flight DoPut: {vs_flight:.2f}x (goal >= {GOAL_VS_FLIGHT}x)")
        ok = ok and vs_flight >= GOAL_VS_FLIGHT
    print(f"  ipfrs framing / raw:       {rates['ipfrs framing'] / rates['raw socket']:.2f}x")
    if args.quick:
        return 0  # sizes too small for the goals to mean much
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
