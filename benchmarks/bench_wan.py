"""Rounds across shaped links (the network lab): tensorswap round time / raw TCP, same links.

4 peers, each in its own host, send an 8 MiB update up to a coordinator host and receive
the 8 MiB aggregate back. The same bytes are moved by raw TCP (sendall / recv_into, the
server answering once it holds every upload) on the same links, in the same run; the two
take turns, and each round is divided by the raw transfer measured just before it.

1. ``200mbit``: the coordinator's link shaped to 200 Mbit/s (tbf, both directions), the
   peers' unshaped: the coordinator's link is the bottleneck. Goal <= 1.05x.
2. ``50mbit-40ms``: each peer's link 50 Mbit/s, 40 ms RTT between every peer and the
   coordinator (a delay relay: this kernel has no netem), the coordinator's link
   unshaped. Goal <= 1.1x.

Needs root (network namespaces); prints why and exits 0 elsewhere. Connection setup is not
timed in either; the tensorswap round includes hashing the update, offer/want, the submit,
the coordinator's aggregation and storing, the wait and the fetch (a submit that waits for
the round and brings the aggregate behind its answer: ``RoundClient.submit(wait=)``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tensorswap.netlab import Host, Lab, NamespacesUnavailable, wait_listening
from tensorswap.rounds import RoundClient
from tensorswap.rounds.core import RoundId, RoundSpec

try:
    from benchmarks.__main__ import ratio_line
except ImportError:  # run as a file
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.__main__ import ratio_line
from benchmarks._flower import flower_python

MiB = 1024 * 1024
TS_PORT, RAW_PORT, FLOWER_PORT, OVERLAP_PORT = 7000, 7001, 7010, 7002
FLOWER_SCRIPT = Path(__file__).resolve().with_name("_flower_wan.py")
KEY = b"bench-wan-key"


@dataclass(frozen=True)
class Scenario:
    name: str
    coordinator_mbit: float | None
    peer_mbit: float | None
    rtt: float
    goal: float


SCENARIOS = (
    Scenario("200mbit", 200, None, 0.0, 1.05),
    Scenario("50mbit-40ms", None, 50, 0.040, 1.10),
)


UPLOAD_LEAD: int | str | None = "default"  # --upload-lead-kib


# ── raw TCP ──────────────────────────────────────────────────────────────────
def raw_server(address: str, port: int, peers: int, nbytes: int, overlap: bool = False) -> None:
    """Forever: accept ``peers`` connections, read ``nbytes`` from each, then send each
    ``nbytes`` back (the "aggregate"), close. Runs inside the coordinator's host. With
    ``overlap`` each connection is read and written at once (the bound a round that overlaps
    its upload and its download can reach: about max(up, down))."""
    listener = socket.create_server((address, port), backlog=peers)
    print(f"listening on {address}:{port}", file=sys.stderr, flush=True)
    payload = memoryview(bytearray(os.urandom(1024)) * (nbytes // 1024 + 1))[:nbytes]
    while True:
        conns = [listener.accept()[0] for _ in range(peers)]

        def drain(conn: socket.socket) -> None:
            _receive(conn, nbytes, "peer")

        if overlap:
            _all(lambda conn: _both(lambda: drain(conn), lambda: conn.sendall(payload)), conns)
        else:
            _all(drain, conns)
            _all(lambda conn: conn.sendall(payload), conns)
        for conn in conns:
            conn.close()


def _all(fn: Callable[[socket.socket], None], conns: list[socket.socket]) -> None:
    threads = [threading.Thread(target=fn, args=(c,)) for c in conns]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _receive(conn: socket.socket, nbytes: int, other: str) -> None:
    """Read ``nbytes`` from ``conn`` (ConnectionError if the ``other`` side closes first)."""
    buf, got = memoryview(bytearray(4 * MiB)), 0
    while got < nbytes:
        n = conn.recv_into(buf[: min(len(buf), nbytes - got)])
        if not n:
            raise ConnectionError(f"{other} closed early")
        got += n


def _both(first: Callable[[], None], second: Callable[[], None]) -> None:
    thread = threading.Thread(target=second)
    thread.start()
    first()
    thread.join()


def raw_peer(
    target: tuple[str, int], nbytes: int, start: threading.Barrier, overlap: bool = False
) -> float:
    """Connect, wait for the start, send ``nbytes``, receive ``nbytes`` (at once, with
    ``overlap``); the end time."""
    payload = np.random.default_rng().integers(0, 255, nbytes, np.uint8).data
    with socket.create_connection(target, timeout=120) as conn:
        start.wait()

        def receive() -> None:
            _receive(conn, nbytes, "server")

        if overlap:
            _both(receive, lambda: conn.sendall(payload))
        else:
            conn.sendall(payload)
            receive()
    return time.perf_counter()


# ── tensorswap ───────────────────────────────────────────────────────────────
async def ts_peer(
    target: tuple[str, int],
    name: str,
    rid: RoundId,
    values: np.ndarray,
    start: threading.Barrier,
    marks: list[tuple[float, float]],
    cut: bool = True,
) -> float:
    """Connect, wait for the start, submit, wait for the aggregate and fetch it; end time.

    Appends to ``marks`` when its submit was answered and when its fetch ended. ``cut``
    False turns cut-through off (the barrier round of earlier versions)."""
    async with await RoundClient.connect(*target, peer=name, key=KEY) as client:
        client.cut.enabled = cut
        if UPLOAD_LEAD != "default":
            client.cut.lead_bytes = UPLOAD_LEAD
        times = _watch(client)
        start.wait()
        # the submit holds its answer until the round is complete and the aggregate's blocks
        # follow it (rounds/fetch): submit, wait and fetch in one round trip
        times["began"] = time.perf_counter()
        await client.submit(rid, {"w": values}, 1, wait=300)
        submitted = time.perf_counter()
        result = await client.fetch_result(rid, timeout=300)
        assert result["w"].nbytes == values.nbytes
        end = time.perf_counter()
    marks.append((submitted, end))
    if cut:
        began = times["began"]
        TIMELINES.append({k: v - began for k, v in times.items()} | {"end": end - began})
    return end


TIMELINES: list[dict[str, float]] = []  # per peer and round: seconds after its submit began


def _watch(client: RoundClient) -> dict[str, float]:
    """Marks when the client's announcement returned and its push began and ended."""
    times: dict[str, float] = {}
    begin, put = client.cut.begin, client.blocks.put_blocks

    async def timed_begin(*args: Any, **kwargs: Any) -> Any:
        cid = await begin(*args, **kwargs)
        times["announced"] = time.perf_counter()
        return cid

    async def timed_put(*args: Any, **kwargs: Any) -> Any:
        times.setdefault("push began", time.perf_counter())
        sent = await put(*args, **kwargs)
        times["push ended"] = time.perf_counter()
        return sent

    client.cut.begin = timed_begin  # type: ignore[method-assign]
    client.blocks.put_blocks = timed_put  # type: ignore[method-assign]
    return times


async def start_round(target: tuple[str, int], rid: RoundId, peers: int) -> None:
    async with await RoundClient.connect(*target, peer="lead", key=KEY) as lead:
        await lead.start_round(rid, RoundSpec(peers))


async def aggregation_seconds(target: tuple[str, int]) -> float:
    """The coordinator's time for its last round's aggregate (compute and store)."""
    async with await RoundClient.connect(*target, peer="lead", key=KEY) as lead:
        return float((await lead.server_status()).stats["last_aggregation_seconds"])


def timed(
    peers: list[Host], run: Callable[[int, Host, threading.Barrier], float]
) -> tuple[float, float]:
    """Start every peer (each in its host), release them at once; (when, seconds to the
    last end)."""
    start = threading.Barrier(len(peers) + 1)
    futures = [host.start(lambda i=i, host=host: run(i, host, start)) for i, host in
               enumerate(peers)]  # fmt: skip
    start.wait()
    began = time.perf_counter()
    return began, max(f.result(timeout=600) for f in futures) - began


# ── Flower, in its own interpreter ───────────────────────────────────────────
def flower_rounds(
    lab: Lab, python: str, scenario: Scenario, reps: int, nbytes: int, port: int
) -> list[float]:
    """``reps`` Flower 1.42 FedAvg rounds (gRPC) on the same hosts and links; their times."""
    coord, peers = lab.hosts["coord"], [h for n, h in lab.hosts.items() if n.startswith("peer")]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # flwr's own numpy
    script = str(FLOWER_SCRIPT)
    server = coord.popen(
        [python, script, "server", coord.address, str(port), str(len(peers)), str(reps),
         str(nbytes)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    wait_listening(server, 120, "Flower server")
    target = (coord.address, port)
    if scenario.rtt:
        relay = lab.relay(target, rtt=scenario.rtt, mbit=scenario.peer_mbit or 1000.0)
        target = (relay.address, relay.port)
    clients = [
        host.popen([python, script, "client", target[0], str(target[1]), str(nbytes), str(i)],
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        for i, host in enumerate(peers)
    ]  # fmt: skip
    assert server.stdout is not None
    times = []
    try:
        for line in server.stdout:
            if line.startswith("ROUND "):
                times.append(float(line.split()[1]))
                if len(times) == reps:
                    break
    finally:
        for proc in (*clients, server):
            Host.kill(proc)
    if len(times) < reps:
        raise RuntimeError(f"Flower ran {len(times)} of {reps} rounds")
    return times


# ── one scenario ─────────────────────────────────────────────────────────────
def run_scenario(
    lab: Lab,
    scenario: Scenario,
    reps: int,
    nbytes: int,
    first_round: int,
    flower: str | None = None,
    judge: bool = True,
) -> float:
    coord, peers = lab.hosts["coord"], [h for n, h in lab.hosts.items() if n.startswith("peer")]
    coord.shape(scenario.coordinator_mbit)
    for host in peers:
        host.shape(scenario.peer_mbit)
    ts, raw = (coord.address, TS_PORT), (coord.address, RAW_PORT)
    both = (coord.address, OVERLAP_PORT)
    if scenario.rtt:
        mbit = scenario.peer_mbit or 1000.0
        ts_relay = lab.relay(ts, rtt=scenario.rtt, mbit=mbit)
        raw_relay = lab.relay(raw, rtt=scenario.rtt, mbit=mbit)
        ts, raw = (ts_relay.address, ts_relay.port), (raw_relay.address, raw_relay.port)
    floats = nbytes // 4
    raws, rounds, ratios, barriers, overlaps = [], [], [], [], []
    phases: list[tuple[float, float]] = []
    aggregations: list[float] = []
    for rep in range(reps):
        raws.append(timed(peers, lambda i, host, start: raw_peer(raw, nbytes, start))[1])
        if not scenario.rtt:  # the relays forward the barrier port only
            overlaps.append(
                timed(peers, lambda i, host, start: raw_peer(both, nbytes, start, True))[1]
            )
        rid = RoundId(first_round + rep, "bench")
        direct = (coord.address, TS_PORT)
        coord.call(lambda rid=rid, direct=direct: asyncio.run(start_round(direct, rid, len(peers))))
        # random values: equal chunks would be sent once (dedup), and so would a constant
        # aggregate's
        rng = np.random.default_rng(first_round + rep)  # fresh in every round of the run
        fresh = [rng.standard_normal(floats, np.float32) for _ in peers]

        marks: list[tuple[float, float]] = []

        def one(
            i: int, host: Host, start: threading.Barrier, rid: RoundId = rid, fresh=fresh,
            marks=marks,
        ) -> float:  # fmt: skip
            return asyncio.run(ts_peer(ts, f"peer{i}", rid, fresh[i], start, marks))

        began, seconds = timed(peers, one)
        rounds.append(seconds)
        submitted = max(m[0] for m in marks)
        phases.append((submitted - began, began + seconds - submitted))
        aggregations.append(coord.call(lambda d=direct: asyncio.run(aggregation_seconds(d))))
        ratios.append(rounds[-1] / raws[-1])
        # the same round with cut-through off, in the same turn: what it gains
        bid = RoundId(first_round + 50 + rep, "bench")
        coord.call(lambda rid=bid, direct=direct: asyncio.run(start_round(direct, rid, len(peers))))

        other = [rng.standard_normal(floats, np.float32) for _ in peers]  # no dedup

        def barrier(
            i: int, host: Host, start: threading.Barrier, rid: RoundId = bid, fresh=other,
        ) -> float:  # fmt: skip
            return asyncio.run(ts_peer(ts, f"peer{i}", rid, fresh[i], start, [], cut=False))

        barriers.append(timed(peers, barrier)[1])
    ratio = statistics.median(ratios)
    relay_cpu = sum(_cpu_seconds(relay.proc.pid) for relay in lab.relays)
    print(f"{scenario.name}: {len(peers)} peers x {nbytes // MiB} MiB up and down, {reps} rounds")
    print(f"  raw TCP     {_spread(raws)} s")
    if overlaps:
        print(f"  raw TCP, up and down at once {_spread(overlaps)} s")
    print(f"  tensorswap  {_spread(rounds)} s")
    # the submit's answer waits for the round to complete and brings the aggregate's blocks
    # behind it (rounds/fetch); the fetch then reads them from the peer's own store
    names = ("last submit answered", "  then last result loaded")
    for k, name in enumerate(names):
        print(f"    {name:<22} {_spread([p[k] for p in phases])} s")
    print(f"    coordinator's aggregate  {_spread(aggregations)} s (in the submit phase)")
    print("    each peer, s after its submit began (over peers and rounds, cut-through):")
    for key in ("announced", "push began", "push ended", "end"):
        if seen := [t[key] for t in TIMELINES if key in t]:
            print(f"      {key:<12} {_spread(seen)}")
    TIMELINES.clear()
    print(f"  barrier     {_spread(barriers)} s (cut-through off, same turns)")
    cut_gain = statistics.median(barriers) / statistics.median(rounds)
    print(f"  barrier / cut-through (medians) {cut_gain:.3f}x")
    if overlaps:
        over = statistics.median(rounds) / statistics.median(overlaps)
        print(f"  tensorswap / raw up and down at once (medians) {over:.3f}x (issue 26: <= 1.0x)")
    print(f"  ratio       {_spread(ratios)} -> {ratio:.3f}x (goal <= {scenario.goal}x at 8 MiB)")
    if flower is not None:
        port = FLOWER_PORT + first_round  # a fresh port per scenario
        flowers = flower_rounds(lab, flower, scenario, reps, nbytes, port)
        against = statistics.median(flowers) / statistics.median(raws)
        print(f"  Flower 1.42 {_spread(flowers)} s (FedAvg over gRPC, own rounds)")
        print(f"  Flower / raw (medians) {against:.3f}x")
        name = f"wan_{scenario.name.replace('-', '_')}_flower_vs_raw"
        print(ratio_line(name, against))
    if lab.relays:
        print(f"  relays' CPU time so far: {relay_cpu:.2f} s (they must not be the bottleneck)")
    name = f"wan_{scenario.name.replace('-', '_')}_vs_raw"
    print(ratio_line(name, ratio, "<=", scenario.goal) if judge else ratio_line(name, ratio))
    return ratio


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _spread(values: list[float]) -> str:
    return f"median {statistics.median(values):.3f} (min {min(values):.3f}, max {max(values):.3f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="1 round per scenario, 2 MiB (goals not judged)"
    )
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--mib", type=int, default=8)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--only", choices=[s.name for s in SCENARIOS], default=None)
    parser.add_argument(
        "--result-chunk-kib", type=int, default=4096,
        help="the coordinator's result chunk size (serve --result-chunk): a cut-through "
        "round pipelines chunk by chunk, so smaller chunks overlap more",
    )  # fmt: skip
    parser.add_argument(
        "--upload-lead-kib", type=int, default=None,
        help="how far a peer's upload may run ahead of the result pieces streamed back "
        "(RoundClient.cut.lead_bytes; default: the library's; 0: uploads not paced)",
    )  # fmt: skip
    parser.add_argument(
        "--flower-python",
        default=flower_python(),
        metavar="PYTHON",
        help="an interpreter with flwr==1.42.0 (its own venv): Flower beside tensorswap "
        "(default $TENSORSWAP_FLOWER_PYTHON, else .venv-flower from `make flower-venv`; "
        "none found, or `none`: Flower is not run)",
    )
    parser.add_argument("--raw-server", nargs=4, metavar=("ADDR", "PORT", "PEERS", "BYTES"),
                        help=argparse.SUPPRESS)  # fmt: skip
    parser.add_argument("--overlap", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    global UPLOAD_LEAD
    if args.upload_lead_kib is not None:
        UPLOAD_LEAD = args.upload_lead_kib * 1024 or None
    if args.raw_server:
        address, port, peers, nbytes = args.raw_server
        raw_server(address, int(port), int(peers), int(nbytes), args.overlap)
        return 0
    reps, nbytes = (1, 2 * MiB) if args.quick else (args.reps, args.mib * MiB)
    try:
        lab = Lab()
    except NamespacesUnavailable as exc:
        print(f"skipped: {exc.reason}")
        return 0
    missed = []
    with lab, tempfile.TemporaryDirectory(prefix="tensorswap-wan-") as tmp:
        coord = lab.add_host("coord")
        for i in range(args.peers):
            lab.add_host(f"peer{i}")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        here = str(Path(__file__).resolve().parents[1])
        serve = coord.python(
            "-m", "tensorswap.cli.serve_cmd", "--listen", f"{coord.address}:{TS_PORT}",
            "--data", str(Path(tmp) / "coordinator"), "--key", KEY.decode(),
            "--log-level", "warning", "--result-chunk", str(args.result_chunk_kib * 1024),
            stderr=subprocess.PIPE, text=True, env=env, cwd=here,
        )  # fmt: skip
        wait_listening(serve, 60, "tensorswap serve")
        raw = coord.python(
            "-m", "benchmarks.bench_wan", "--raw-server", coord.address, str(RAW_PORT),
            str(args.peers), str(nbytes), stderr=subprocess.PIPE, text=True, env=env, cwd=here,
        )  # fmt: skip
        wait_listening(raw, 60, "raw TCP server")
        both = coord.python(
            "-m", "benchmarks.bench_wan", "--raw-server", coord.address, str(OVERLAP_PORT),
            str(args.peers), str(nbytes), "--overlap", stderr=subprocess.PIPE, text=True,
            env=env, cwd=here,
        )  # fmt: skip
        wait_listening(both, 60, "raw TCP server, up and down at once")
        flower = args.flower_python if args.flower_python not in ("", "none") else None
        for k, scenario in enumerate(SCENARIOS):
            if args.only and scenario.name != args.only:
                continue
            ratio = run_scenario(
                lab, scenario, reps, nbytes, first_round=1 + 100 * k,
                flower=flower, judge=not args.quick,
            )  # fmt: skip
            if ratio > scenario.goal and not args.quick:  # goals are for 8 MiB updates
                missed.append(scenario.name)
    if missed:
        print(f"missed the goal: {missed}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
