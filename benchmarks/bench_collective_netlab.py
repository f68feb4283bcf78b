"""The collective all-reduce across shaped links (the network lab): the bandwidth bound, gloo, int8.

    PYTHONPATH=src python -m benchmarks.bench_collective_netlab [--peers 4 --mib 32 --calls 3]

n peers, each in a host of its own whose link is shaped to 200 Mbit/s both ways (tbf on
both ends of its veth); the rendezvous (`tensorswap serve`) in a host of its own,
unshaped. An all-reduce of S bytes per peer moves 2(n-1)/n x S out of and into every peer
(a butterfly as a ring), so over these links no all-reduce takes less than the bandwidth
bound 2(n-1)/n x S / B (B: the link's rate, 25 MB/s). Printed: the fraction of the bound
each system reaches (bound / median call time, a call's time being its slowest peer's):
tensorswap (goal >= 0.85) and gloo (torch.distributed all_reduce, its ranks in the same
hosts, its TCP store on peer0) in the same lab. tbf counts whole Ethernet frames, so TCP
over a 1500-byte MTU reaches at most ~0.95 of the bound. Then int8 compression: the bytes
each peer's interface sent during a call (its tx_bytes: pushes, served slices, headers,
ACKs, polls) against float32's (goal >= 3.5x fewer), the pushed bytes
(``stats.bytes_sent``) likewise, and its time.

Every timed call follows a barrier (a one-value all-reduce, gloo's ``barrier``) so that no
peer's time includes waiting for another to arrive (the bytes are counted up to the next
barrier, by when every peer has fetched what this one serves); inputs are random and change before
every call (content addressing would skip a block a peer still holds). Needs root (network
namespaces); prints why and exits 0 elsewhere. Every process and namespace is removed at
the end, also on failure (``Lab``).
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
import threading
import time
from collections import deque
from pathlib import Path
from typing import IO, Any

import numpy as np

from tensorswap.netlab import DEVICE, Host, Lab, NamespacesUnavailable, wait_listening

try:
    from benchmarks.__main__ import ratio_line
except ImportError:  # run as a file
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.__main__ import ratio_line

MiB = 1 << 20
TS_PORT, GLOO_PORT = 7200, 7201
KEY = "bench-collective-netlab"
WARMUP = 2
"""Calls before the timed ones (a peer's slab pool reaches its working set in the second)."""
GOAL_BOUND, GOAL_INT8 = 0.85, 3.5


def _link(counter: str) -> int:
    """This host's interface counter (``ip netns exec`` mounts the namespace's own /sys)."""
    return int(Path(f"/sys/class/net/{DEVICE}/statistics/{counter}").read_text())


# ── one peer, inside its host ────────────────────────────────────────────────
async def _ts_peer(
    rank: int, n: int, target: str, elems: int, calls: int, compression: Any
) -> dict[str, list[float]]:
    from tensorswap.collective import Collective

    address = os.environ["BENCH_ADDRESS"]
    g = await Collective.join(
        target, group=f"bench-{compression}", peer=f"p{rank}", size=n, key=KEY.encode(),
        listen=f"{address}:0", compression=compression, timeout=300, **_congestion(),
    )  # fmt: skip
    x = {"w": np.random.default_rng(rank).standard_normal(elems, np.float32)}
    barrier = {"barrier": np.zeros(1, np.float32)}
    out: dict[str, list[float]] = {"seconds": [], "tx": [], "rx": [], "pushed": []}
    async with g:
        for _ in range(WARMUP):
            x["w"] += np.float32(1.0)
            await g.all_reduce(x)
        x["w"] += np.float32(1.0)  # every value, so every chunk, new
        await g.all_reduce(barrier)
        for _ in range(calls):
            tx, rx, start = _link("tx_bytes"), _link("rx_bytes"), time.perf_counter()
            await g.all_reduce(x)
            out["seconds"].append(time.perf_counter() - start)
            out["pushed"].append(g.stats.bytes_sent)
            x["w"] += np.float32(1.0)
            # after the barrier every peer has its result, so this one has served its slice
            await g.all_reduce(barrier)
            out["tx"].append(_link("tx_bytes") - tx)
            out["rx"].append(_link("rx_bytes") - rx)
    return out


def _congestion() -> dict[str, Any]:
    """``join``'s ``congestion`` as ``--congestion`` chose it (the library's default if not)."""
    chosen = os.environ.get("BENCH_CONGESTION", "")
    return {} if not chosen else {"congestion": None if chosen == "system" else chosen}


def _gloo_peer(rank: int, n: int, master: str, elems: int, calls: int) -> dict[str, list[float]]:
    """torch.distributed's gloo all_reduce (a sum, divided after: the same mean)."""
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://{master}:{GLOO_PORT}", rank=rank, world_size=n,
        timeout=datetime.timedelta(seconds=300),
    )  # fmt: skip
    x = torch.from_numpy(np.random.default_rng(rank).standard_normal(elems, np.float32))
    for _ in range(WARMUP):
        dist.all_reduce(x.clone())
    out: dict[str, list[float]] = {"seconds": [], "tx": [], "rx": [], "pushed": []}
    y = x + 1.0
    dist.barrier()
    for _ in range(calls):
        tx, rx, start = _link("tx_bytes"), _link("rx_bytes"), time.perf_counter()
        dist.all_reduce(y)
        y /= n
        out["seconds"].append(time.perf_counter() - start)
        x += 1.0
        y = x.clone()
        dist.barrier()
        out["tx"].append(_link("tx_bytes") - tx)
        out["rx"].append(_link("rx_bytes") - rx)
    dist.destroy_process_group()
    return out


def peer_main(argv: list[str]) -> int:
    """``--peer SYSTEM RANK N TARGET MIB CALLS COMPRESSION OUT``: one peer; JSON to OUT."""
    system, rank, n, target, mib, calls, compression, path = argv
    elems = int(float(mib) * MiB) // 4
    if system == "gloo":
        result = _gloo_peer(int(rank), int(n), target, elems, int(calls))
    else:
        result = asyncio.run(_ts_peer(int(rank), int(n), target, elems, int(calls), compression))
    Path(path).write_text(json.dumps(result))
    return 0


# ── the driver ───────────────────────────────────────────────────────────────
def _drain(stream: IO[str], keep: deque[str]) -> None:
    """Read a child's pipe to its end (a full pipe would stop it), keeping the last lines."""
    for line in stream:
        keep.append(line)


def run_peers(
    peers: list[Host], system: str, target: str, mib: float, calls: int, compression: str,
    tmp: Path, timeout: float,
) -> list[dict[str, list[float]]]:  # fmt: skip
    """Start one process per peer (in its host), wait for all; their results, by rank.
    A failed or late peer stops them all (RuntimeError with its log's tail)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    here = str(Path(__file__).resolve().parents[1])
    runs = []
    for rank, host in enumerate(peers):
        name = f"{system}-{compression}-{rank}"
        out, log = tmp / f"{name}.json", tmp / f"{name}.log"
        argv = [system, str(rank), str(len(peers)), target, repr(mib), str(calls), compression]
        with log.open("w") as sink:
            proc = host.python(
                "-m", "benchmarks.bench_collective_netlab", "--peer", *argv, str(out),
                stdout=sink, stderr=subprocess.STDOUT, cwd=here,
                env={**env, "GLOO_SOCKET_IFNAME": DEVICE, "BENCH_ADDRESS": host.address},
            )  # fmt: skip
        runs.append((proc, out, log))
    deadline = time.monotonic() + timeout
    try:
        for proc, _, log in runs:
            try:
                rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                rc = None
            if rc != 0:
                tail = log.read_text()[-3000:]
                why = f"exited {rc}" if rc is not None else f"still running after {timeout:.0f} s"
                raise RuntimeError(f"{system} ({compression}) peer {why}:\n{tail}")
    finally:
        for proc, _, _ in runs:
            Host.kill(proc)
    return [json.loads(out.read_text()) for _, out, _ in runs]


def per_call(results: list[dict[str, list[float]]], key: str, how: Any = max) -> list[float]:
    """Per timed call, ``how`` (max: the slowest peer) of ``key`` over the peers."""
    calls = len(results[0][key])
    return [float(how(r[key][c] for r in results)) for c in range(calls)]


def _spread(values: list[float]) -> str:
    return f"median {statistics.median(values):.3f} (min {min(values):.3f}, max {max(values):.3f})"


def report(
    n: int, mib: float, mbit: float, f32: list[Any], gloo: list[Any], int8: list[Any],
    judge: bool,
) -> list[str]:  # fmt: skip
    """Print the numbers and RATIO lines; the goals missed."""
    nbytes = mib * MiB
    bound = 2 * (n - 1) / n * nbytes / (mbit * 1e6 / 8)
    print(f"{n} peers x {mib:g} MiB float32, every peer's link {mbit:g} Mbit/s both ways")
    print(f"  bandwidth bound 2(n-1)/n x S / B = {bound:.3f} s")
    fractions = {}
    for name, results in (("tensorswap", f32), ("gloo", gloo), ("tensorswap int8", int8)):
        seconds = per_call(results, "seconds")
        fractions[name] = bound / statistics.median(seconds)
        moved = statistics.median(per_call(results, "tx", statistics.mean)) / MiB
        print(f"  {name:<16} {_spread(seconds)} s -> {fractions[name]:.3f} of the bound; "
              f"sent {moved:.1f} MiB per peer (link)")  # fmt: skip
    ideal = 2 * (n - 1) / n * mib
    print(f"  (the data alone: {ideal:.1f} MiB per peer each way)")
    tx = statistics.median(per_call(f32, "tx", statistics.mean))
    tx8 = statistics.median(per_call(int8, "tx", statistics.mean))
    pushed = statistics.median(per_call(f32, "pushed", statistics.mean))
    pushed8 = statistics.median(per_call(int8, "pushed", statistics.mean))
    fewer, fewer_pushed = tx / tx8, pushed / pushed8
    slower = fractions["tensorswap"] / fractions["tensorswap int8"]
    print(f"  int8: {fewer:.2f}x fewer bytes on each peer's link than float32 "
          f"({fewer_pushed:.2f}x fewer pushed), time {slower:.2f}x float32's")  # fmt: skip
    ts_vs_gloo = fractions["gloo"] / fractions["tensorswap"]
    print(f"  tensorswap / gloo time: {ts_vs_gloo:.2f}x")
    goal = (lambda op, g: (op, g)) if judge else (lambda op, g: (None, None))
    print(ratio_line("collective_netlab_bound", fractions["tensorswap"], *goal(">=", GOAL_BOUND)))
    print(ratio_line("collective_netlab_gloo_bound", fractions["gloo"]))
    print(ratio_line("collective_netlab_vs_gloo", ts_vs_gloo))
    print(ratio_line("collective_netlab_int8_fewer_bytes", fewer, *goal(">=", GOAL_INT8)))
    missed = []
    if judge and fractions["tensorswap"] < GOAL_BOUND:
        missed.append("bound")
    if judge and fewer < GOAL_INT8:
        missed.append("int8 bytes")
    return missed


def _retransmitted(peers: list[Host]) -> int:
    return sum(host.tcp_counters().get("RetransSegs", 0) for host in peers)


def run_lab(args: argparse.Namespace, lab: Lab, tmp: Path) -> list[str]:
    """Build the hosts, start the rendezvous, run the three systems; the goals missed."""
    rdv = lab.add_host("rdv")
    peers = [lab.add_host(f"peer{i}", mbit=args.mbit) for i in range(args.peers)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    serve = rdv.python(
        "-m", "tensorswap.cli.serve_cmd", "--listen", f"{rdv.address}:{TS_PORT}",
        "--data", str(tmp / "rendezvous"), "--key", KEY, "--log-level", "warning",
        stderr=subprocess.PIPE, text=True, env=env, cwd=str(Path(__file__).resolve().parents[1]),
    )  # fmt: skip
    wait_listening(serve, 60, "tensorswap serve")
    assert serve.stderr is not None
    logged: deque[str] = deque(maxlen=50)
    threading.Thread(target=_drain, args=(serve.stderr, logged), daemon=True).start()
    bound = 2 * (args.peers - 1) / args.peers * args.mib * MiB / (args.mbit * 1e6 / 8)
    timeout = 180 + 20 * bound * (WARMUP + args.calls)
    target = f"{rdv.address}:{TS_PORT}"
    common = (args.mib, args.calls)
    systems = {}
    for name, system, where, compression in (
        ("tensorswap", "tensorswap", target, "none"),
        ("gloo", "gloo", peers[0].address, "none"),
        ("tensorswap int8", "tensorswap", target, "int8"),
    ):
        before = _retransmitted(peers)
        systems[name] = run_peers(peers, system, where, *common, compression, tmp, timeout)
        lost = _retransmitted(peers) - before
        print(f"  {name}: {lost} TCP segments retransmitted by the peers (the whole run)")
    f32, gloo, int8 = systems.values()
    return report(args.peers, args.mib, args.mbit, f32, gloo, int8, judge=not args.quick)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 MiB, 1 call (goals not judged)")
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--mib", type=float, default=32.0, help="MiB of float32 per peer")
    parser.add_argument("--calls", type=int, default=3, help="timed calls per system")
    parser.add_argument("--mbit", type=float, default=200.0, help="every peer's link rate")
    parser.add_argument(
        "--congestion", default="", help="tensorswap's TCP congestion control (system: the default)"
    )
    parser.add_argument("--peer", nargs=8, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.congestion:
        os.environ["BENCH_CONGESTION"] = args.congestion
    if args.peer:
        return peer_main(args.peer)
    if args.quick:
        args.mib, args.calls = 2.0, 1
    try:
        lab = Lab()
    except NamespacesUnavailable as exc:
        print(f"skipped: {exc.reason}")
        return 0
    with lab, tempfile.TemporaryDirectory(prefix="tensorswap-cnetlab-") as tmp:
        missed = run_lab(args, lab, Path(tmp))
    if missed:
        print(f"missed the goal: {missed}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
