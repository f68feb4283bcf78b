"""FedAvg rounds on loopback through the README's four calls, against Flower 1.42 (issue 26).

4 peers, each its own process, each with a 64 MiB float32 update (fresh random values every
round, drawn before the round: equal chunks would be sent once), and one ``tensorswap
serve`` coordinator on 127.0.0.1. Each peer makes the README's calls: ``RoundClient.connect``
(once), then every round ``start_round`` (or join: False when another peer started it),
``submit(rid, {"w": values}, num_samples=...)`` and ``fetch_result(rid, timeout=...)``.
One warm-up round, then ``--reps`` measured rounds. Per round:

1. Wall time, from the first peer's submit starting to the last peer holding the aggregate
   (``fetch_result`` returned; every peer checks a slice of it against the FedAvg of the
   seeds' values).
2. CPU seconds summed over all processes (coordinator + peers: utime + stime from
   /proc/<pid>/stat), from just before the peers are told to go to 0.25 s after the last
   fetch (the coordinator's work after its answers included). Drawing the random values is
   outside it; the driver process (which only relays go/done lines) is not counted.
3. The coordinator's peak RSS (VmHWM, reset by clear_refs before the warm-up round) over
   all rounds, as a multiple of one update; its growth over the idle RSS is shown beside.

Flower 1.42 FedAvg (gRPC, ``benchmarks/_flower_wan.py``, Flower's own interpreter) runs the
same peers and sizes on 127.0.0.1 right after, as many rounds after one warm-up round: its
round time (the server's configure_fit to the end of aggregate_fit: the model down to each
client, each update up, FedAvg) and CPU seconds of server + clients between consecutive
round ends. Its clients draw their noise once at start (``fixed``), so its rounds time no
random numbers either; each fit adds it to the model (a 64 MiB add, kept in Flower's round).

Goals (issue 26, judged at 4 x 64 MiB): tensorswap's median round >= 5x faster than
Flower's, coordinator peak RSS <= 3x one update, CPU <= 1.5 s per round.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tensorswap.netlab.lab import read_line, wait_listening
from tensorswap.rounds import RoundClient, RoundId, RoundSpec

try:
    from benchmarks.__main__ import ratio_line
except ImportError:  # run as a file
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.__main__ import ratio_line
from benchmarks._flower import flower_python
from benchmarks.bench_rounds import Coordinator
from benchmarks.bench_wan import FLOWER_SCRIPT

MiB = 1024 * 1024
KEY = b"bench-round-loopback"
CHECK = 1024  # leading floats of the aggregate each peer reports for the check
SETTLE = 0.25  # seconds after the last fetch before the CPU is read
WAIT = 600.0  # seconds any one step may take before the run is abandoned
ROUND_GOAL, RSS_GOAL, CPU_GOAL = 5.0, 3.0, 1.5
TICK = os.sysconf("SC_CLK_TCK")


# ── /proc ────────────────────────────────────────────────────────────────────
def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def vm_bytes(pid: int, key: str) -> int:
    """A /proc/<pid>/status memory field (VmRSS, VmHWM) in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name == key:
            return int(value.split()[0]) * 1024
    raise KeyError(key)


def _kill(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_BARRIER = "TENSORSWAP_BENCH_BARRIER"
_LEAD = "TENSORSWAP_BENCH_UPLOAD_LEAD"  # --upload-lead-kib, for the peer processes


# ── a peer process ───────────────────────────────────────────────────────────
async def peer(port: int, index: int, peers: int, nbytes: int) -> None:
    """One peer: connect, then obey stdin: ``prep R`` (draw round R's values, answer
    ``ready``), ``go R`` (the round's three calls, answer ``done`` with its instants and a
    checksum of the aggregate), ``quit``."""
    name = f"peer-{index}"
    async with await RoundClient.connect("127.0.0.1", port, peer=name, key=KEY) as client:
        client.cut.enabled = os.environ.get(_BARRIER) != "1"
        if (lead := os.environ.get(_LEAD)) is not None:
            client.cut.lead_bytes = int(lead) or None
        print("connected", flush=True)
        values = np.empty(0, np.float32)
        while (line := await asyncio.to_thread(sys.stdin.readline)).strip() not in ("", "quit"):
            verb, number = line.split()
            rid = RoundId(int(number), "bench")
            if verb == "prep":
                values = round_values(rid.round, index, nbytes // 4)
                print("ready", flush=True)
                continue
            await client.start_round(rid, RoundSpec(expected_peers=peers, timeout_s=WAIT))
            began = time.perf_counter()
            await client.submit(rid, {"w": values}, num_samples=index + 1)
            accepted = time.perf_counter()
            result = await client.fetch_result(rid, timeout=WAIT)
            ended = time.perf_counter()
            got = result["w"]
            check = float(got[:CHECK].astype(np.float64).sum())
            print(f"done {began!r} {accepted!r} {ended!r} {check!r} {got.nbytes}", flush=True)


def round_values(round_no: int, index: int, floats: int) -> np.ndarray:
    """Peer ``index``'s update in round ``round_no`` (the first ``k`` of ``floats`` values
    are those of ``round_values(round_no, index, k)``)."""
    return np.random.default_rng([round_no, index]).standard_normal(floats, np.float32)


def expected_check(round_no: int, peers: int) -> float:
    """What a peer's checksum must be: FedAvg (weights index + 1) of the leading floats."""
    weights = np.arange(1, peers + 1, dtype=np.float64)
    rows = [round_values(round_no, i, CHECK).astype(np.float64) for i in range(peers)]
    return float((weights @ np.stack(rows)).sum() / weights.sum())


class Peer:
    """A peer process (``--peer``) driven over its stdin and stdout."""

    def __init__(self, port: int, index: int, peers: int, nbytes: int) -> None:
        here = str(Path(__file__).resolve().parents[1])
        cmd = [sys.executable, "-m", "benchmarks.bench_round_loopback", "--peer", str(port)]
        cmd += [str(index), str(peers), str(nbytes)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=here, env=env
        )

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def expect(self, word: str) -> list[str]:
        assert self.proc.stdout is not None
        line = read_line(self.proc.stdout, time.monotonic() + WAIT)
        if not line.startswith(word):
            raise RuntimeError(f"peer {self.proc.args!r}: expected {word!r}, got {line!r}")
        return line.split()[1:]

    def stop(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.send("quit")
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        _kill(self.proc)


# ── tensorswap ───────────────────────────────────────────────────────────────
@dataclass
class Rounds:
    """What the measured rounds of one system took."""

    seconds: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    parts: list[tuple[float, float]] = field(default_factory=list)  # (coordinator, peers) CPU
    phases: list[tuple[float, float]] = field(default_factory=list)  # accepted, then fetched
    peak: int = 0  # the server's VmHWM, bytes
    idle: int = 0  # the server's VmRSS before the rounds, bytes
    pool: int = 0  # the server's slab pool working set after the rounds, bytes


def one_round(coord: Coordinator, peers: list[Peer], round_no: int) -> tuple[float, ...]:
    """One round; (seconds, coordinator CPU, peers' CPU, last accept, then last fetch)."""
    for p in peers:
        p.send(f"prep {round_no}")
    for p in peers:
        p.expect("ready")
    pids = [p.proc.pid for p in peers]
    coord0, peers0 = cpu_seconds(coord.proc.pid), sum(map(cpu_seconds, pids))
    for p in peers:
        p.send(f"go {round_no}")
    done = [[float(x) for x in p.expect("done")] for p in peers]
    time.sleep(SETTLE)
    coord_cpu = cpu_seconds(coord.proc.pid) - coord0
    peers_cpu = sum(map(cpu_seconds, pids)) - peers0
    want = expected_check(round_no, len(peers))
    for *_, check, _nbytes in done:
        if abs(check - want) > 1e-3 * max(1.0, abs(want)):
            raise RuntimeError(f"round {round_no}: aggregate checksum {check} != {want}")
    first, accepted, last = (
        min(d[0] for d in done),
        max(d[1] for d in done),
        max(d[2] for d in done),
    )
    return last - first, coord_cpu, peers_cpu, accepted - first, last - accepted


async def pool_working_set(port: int) -> int:
    """The coordinator's slab pool working set (its status), bytes."""
    async with await RoundClient.connect("127.0.0.1", port, peer="bench", key=KEY) as client:
        stats = (await client.server_status()).stats
    return int(stats.get("pool_working_set_bytes", 0))


def run_tensorswap(
    tmp: Path, peers: int, nbytes: int, reps: int, chunk: int | None = None
) -> Rounds:
    """A coordinator and ``peers`` peer processes; one warm-up round and ``reps`` more.
    ``chunk``: the coordinator's result chunk size in bytes (``serve --result-chunk``)."""
    out = Rounds()
    extra = () if chunk is None else ("--result-chunk", str(chunk))
    coord = Coordinator(tmp / "coordinator", "--key", KEY.decode(), *extra)
    procs: list[Peer] = []
    try:
        procs = [Peer(coord.port, i, peers, nbytes) for i in range(peers)]
        for p in procs:
            p.expect("connected")
        with contextlib.suppress(OSError):  # without clear_refs the peak includes start-up
            coord.reset_peak()
        out.idle = vm_bytes(coord.proc.pid, "VmRSS")
        for round_no in range(1, reps + 2):
            seconds, coord_cpu, peers_cpu, accepted, fetched = one_round(coord, procs, round_no)
            if round_no > 1:  # round 1 warms up
                out.seconds.append(seconds)
                out.cpu.append(coord_cpu + peers_cpu)
                out.parts.append((coord_cpu, peers_cpu))
                out.phases.append((accepted, fetched))
        out.peak = vm_bytes(coord.proc.pid, "VmHWM")
        out.pool = asyncio.run(pool_working_set(coord.port))
    finally:
        for p in procs:
            p.stop()
        try:
            coord.stop()
        except subprocess.TimeoutExpired:
            _kill(coord.proc)
    return out


# ── Flower 1.42, in its own interpreter ──────────────────────────────────────
def _drain(stream: object, tail: list[bytes]) -> None:
    """Read a child's pipe to its end (Flower logs to stderr), keeping its last 4 KiB."""
    fd = stream.fileno()  # type: ignore[attr-defined]
    while chunk := os.read(fd, 65536):
        tail[:] = [(b"".join(tail) + chunk)[-4096:]]


def run_flower(python: str, peers: int, nbytes: int, reps: int) -> Rounds:
    """Flower 1.42 FedAvg, a server and ``peers`` clients on 127.0.0.1: one warm-up round
    and ``reps`` more; each round's CPU is that of all its processes since the round before."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # flwr's own numpy
    port, script, out = str(_free_port()), str(FLOWER_SCRIPT), Rounds()
    server = subprocess.Popen(
        [python, script, "server", "127.0.0.1", port, str(peers), str(reps + 1), str(nbytes)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    clients: list[subprocess.Popen[str]] = []
    tail: list[bytes] = []
    try:
        wait_listening(server, 120, "Flower server")
        threading.Thread(target=_drain, args=(server.stderr, tail), daemon=True).start()
        client = [python, script, "client", "127.0.0.1", port, str(nbytes)]
        clients = [
            subprocess.Popen([*client, str(i), "fixed"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, text=True, env=env)
            for i in range(peers)
        ]  # fmt: skip
        pids = [server.pid, *(c.pid for c in clients)]
        marks: list[tuple[float, float]] = []  # (server CPU, clients' CPU) at each round's end
        times: list[float] = []
        assert server.stdout is not None
        while len(times) < reps + 1:
            line = read_line(server.stdout, time.monotonic() + WAIT)
            if not line:
                raise RuntimeError(f"Flower ran {len(times)} rounds: {b''.join(tail)[-2000:]!r}")
            if line.startswith("ROUND "):
                marks.append((cpu_seconds(pids[0]), sum(map(cpu_seconds, pids[1:]))))
                times.append(float(line.split()[1]))
        out.peak = vm_bytes(server.pid, "VmHWM")
    finally:
        for proc in (*clients, server):
            _kill(proc)
    out.seconds = times[1:]
    for (s0, c0), (s1, c1) in itertools.pairwise(marks):
        out.parts.append((s1 - s0, c1 - c0))
        out.cpu.append(s1 - s0 + c1 - c0)
    return out


# ── the report ───────────────────────────────────────────────────────────────
def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):6.3f} ({min(values):.3f}-{max(values):.3f})"


def report(ts: Rounds, flower: Rounds | None, peers: int, nbytes: int, judge: bool) -> bool:
    """Print the table and the RATIO lines; whether every judged goal was met."""
    mib, n = nbytes // MiB, len(ts.seconds)
    print(f"FedAvg on 127.0.0.1, {peers} peer processes x {mib} MiB float32, {n} rounds after")
    print("one warm-up round; medians (min-max); CPU: seconds of all processes per round")
    print(f"  {'':30} {'round s':>21}   {'CPU s':>21}   {'server + peers CPU':>18}")
    rows = [("tensorswap (README's 4 calls)", ts)]
    if flower is not None:
        rows.append(("Flower 1.42 FedAvg (gRPC)", flower))
    for label, got in rows:
        server = statistics.median(p[0] for p in got.parts)
        clients = statistics.median(p[1] for p in got.parts)
        print(f"  {label:30} {_spread(got.seconds):>21}   {_spread(got.cpu):>21}   "
              f"{server:7.2f} + {clients:5.2f}")  # fmt: skip
    accepted, fetched = ([p[k] for p in ts.phases] for k in (0, 1))
    print(f"  tensorswap: last submit accepted {_spread(accepted)} s, then every result "
          f"fetched {_spread(fetched)} s")  # fmt: skip
    peak, growth = ts.peak / nbytes, (ts.peak - ts.idle) / nbytes
    print(f"  coordinator peak RSS {ts.peak / MiB:.0f} MiB = {peak:.2f}x one update "
          f"(idle {ts.idle / MiB:.0f} MiB; growth {growth:.2f}x; slab pool working set "
          f"{ts.pool / MiB:.0f} MiB)")  # fmt: skip
    ok = True
    cpu = statistics.median(ts.cpu)
    if flower is not None:
        print(f"  Flower server peak RSS {flower.peak / MiB:.0f} MiB = {flower.peak / nbytes:.2f}x")
        speedup = statistics.median(flower.seconds) / statistics.median(ts.seconds)
        print(f"  round: Flower / tensorswap = {speedup:.2f}x (goal >= {ROUND_GOAL:g}x); CPU: "
              f"{statistics.median(flower.cpu) / cpu:.2f}x")  # fmt: skip
        print(ratio_line("round_vs_flower", speedup, ">=", ROUND_GOAL) if judge
              else ratio_line("round_vs_flower", speedup))  # fmt: skip
        ok = speedup >= ROUND_GOAL
    else:
        print("  Flower: none found (TENSORSWAP_FLOWER_PYTHON, or make flower-venv); not run")
    for name, value, goal in (
        ("coordinator_rss_per_update", peak, RSS_GOAL),
        ("cpu_seconds_per_round", cpu, CPU_GOAL),
    ):
        print(ratio_line(name, value, "<=", goal) if judge else ratio_line(name, value))
        ok = ok and value <= goal
    return ok or not judge


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 MiB, 2 rounds (goals not judged)")
    parser.add_argument("--reps", type=int, default=5, help="measured rounds (after a warm-up)")
    parser.add_argument("--mib", type=int, default=64, help="MiB of each peer's update")
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument(
        "--flower-python",
        default=flower_python(),
        metavar="PYTHON",
        help="an interpreter with flwr==1.42.0 (default $TENSORSWAP_FLOWER_PYTHON, else "
        ".venv-flower; none: Flower is not run)",
    )
    parser.add_argument("--no-flower", action="store_true", help="tensorswap's rounds only")
    parser.add_argument(
        "--barrier", action="store_true", help="cut-through off: every round a barrier"
    )
    parser.add_argument(
        "--result-chunk-kib", type=int, default=None,
        help="the coordinator's result chunk size (serve --result-chunk); peers cut so too",
    )  # fmt: skip
    parser.add_argument(
        "--upload-lead-kib", type=int, default=None,
        help="how far a peer's upload may run ahead of the result pieces streamed back "
        "(RoundClient.cut.lead_bytes; default: the library's; 0: uploads not paced)",
    )  # fmt: skip
    parser.add_argument("--peer", nargs=4, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.barrier:
        os.environ[_BARRIER] = "1"  # the peer processes inherit it
    if args.upload_lead_kib is not None:
        os.environ[_LEAD] = str(args.upload_lead_kib * 1024)
    if args.peer:
        port, index, peers, nbytes = args.peer
        asyncio.run(peer(port, index, peers, nbytes))
        return 0
    reps, mib = (2, 8) if args.quick else (args.reps, args.mib)
    nbytes, judge = mib * MiB, not args.quick and (args.peers, mib) == (4, 64)
    python = None if args.no_flower else args.flower_python
    with tempfile.TemporaryDirectory(prefix="bench-round-loopback-") as tmp:
        chunk = None if args.result_chunk_kib is None else args.result_chunk_kib * 1024
        ts = run_tensorswap(Path(tmp), args.peers, nbytes, reps, chunk)
    flower = None if python is None else run_flower(python, args.peers, nbytes, reps)
    ok = report(ts, flower, args.peers, nbytes, judge)
    print(f"cores: {os.cpu_count()}, load average: {os.getloadavg()[0]:.1f}")
    if not ok:
        print("missed a goal (issue 26)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
