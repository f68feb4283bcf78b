"""All-reduce on loopback: tensorswap.collective against gloo (torch.distributed), one run.

    PYTHONPATH=src python benchmarks/bench_collective.py [--peers 4 --mib 64] [--calls 3]
        [--kill] [--relay]
    PYTHONPATH=src python benchmarks/bench_collective.py --perf /tmp/cb   # + a profile

Every peer is its own process. Prints each system's median call time (the slowest peer's),
CPU-seconds summed over the peers per call, and the ratios. Each peer's input is random and
changes before every call (outside the timing): the same input twice would let the
all-gather skip every reduced block a peer still holds from the call before (content
addressing), and a constant input makes all of a slice's reduced chunks one block.
``--relay``: also the same all-reduce with the last peer behind the relay (``listen=None``)
against all direct, with the rendezvous process's CPU-seconds over the whole run. hivemind is
measured only if importable (it is not installed here). ``--perf PREFIX``
records `perf record -a -g` over each system's timed calls only (not the processes' start
nor the warm-up) into PREFIX-tensorswap.data and PREFIX-gloo.data (`perf report
--no-children --sort pid,sym -i ...`; the peers' process ids are printed).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import resource
import signal
import statistics
import subprocess
import time
from typing import Any

import numpy as np

WARMUP = 2
"""Calls before the timed ones, for both systems: a tensorswap peer holds two calls' blocks
(the last one's stay for late fetchers), so its slab pool reaches its working set in the
second call; until then its buffers are fresh pages (~3 ms/MiB on this VM)."""


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _ts_peer(
    rank: int,
    n: int,
    elems: int,
    calls: int,
    address: str,
    out: Any,
    kill: bool = False,
    marks: Any = None,
    relay: bool = False,
) -> None:
    from tensorswap.collective import Collective

    async def main() -> list[tuple[float, float, int]]:
        x = {"w": np.random.default_rng(rank).standard_normal(elems, np.float32)}
        listen = None if relay and rank == n - 1 else "127.0.0.1:0"
        chosen = os.environ.get("BENCH_CONGESTION", "")
        tuned = {} if not chosen else {"congestion": None if chosen == "system" else chosen}
        g = await Collective.join(
            address, group="bench", peer=f"p{rank}", size=n, key=b"k", listen=listen, **tuned
        )
        times = []
        async with g:
            for _ in range(WARMUP):
                x["w"] += np.float32(1.0)
                await g.all_reduce(x)
            if marks is not None:  # the profile starts now (the loop keeps polling)
                await asyncio.to_thread(_warm, rank, marks)
            for _ in range(calls):
                x["w"] += np.float32(1.0)  # every value, so every chunk, new
                c0, t0 = _cpu(), time.perf_counter()
                await g.all_reduce(x)
                times.append((time.perf_counter() - t0, _cpu() - c0, g.stats.bytes_received))
            if kill:  # one more call, in which the last peer SIGKILLs itself once committed
                x["w"] += np.float32(1.0)
                c0, t0 = _cpu(), time.perf_counter()
                if rank == n - 1:
                    call = asyncio.ensure_future(g.all_reduce(x))
                    while (v := g.view(g.call)) is None or f"p{rank}" not in v.commits:
                        await asyncio.sleep(0.005)
                    os.kill(os.getpid(), signal.SIGKILL)
                    await call
                await g.all_reduce(x)
                times.append((time.perf_counter() - t0, _cpu() - c0, g.stats.bytes_received))
        return times

    try:
        out.put((rank, asyncio.run(main())))
    except Exception as exc:  # a peer dropped (a loaded machine) says so, not a hang
        out.put((rank, f"p{rank} failed: {exc!r}"))
        raise


def _warm(rank: int, marks: Any) -> None:
    """Say this peer is warm (rank 0 speaks for all), then wait for the profiler."""
    warm, go = marks
    if rank == 0:
        warm.set()
    go.wait(120)


class _Profile:
    """`perf record -a -g` from when the peers are warm to when they are done."""

    def __init__(self, ctx: Any, path: str | None) -> None:
        self.path = path
        self.marks = (ctx.Event(), ctx.Event()) if path else None
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        if self.marks is None:
            return
        warm, go = self.marks
        if not warm.wait(600):
            raise RuntimeError("the peers never finished their warm-up")
        argv = ["perf", "record", "-a", "-g", "-F", "499", "-o", str(self.path)]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(1.0)  # perf's start: mmap and its first samples
        go.set()

    def stop(self, procs: list[Any]) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(60)
            pids = ",".join(str(p.pid) for p in procs)
            print(f"  profile: {self.path} (the peers: perf report --pid {pids})")


def _rendezvous(ready: Any, stop: Any) -> None:
    from tensorswap.collective import Rendezvous
    from tensorswap.store import MemoryStore
    from tensorswap.wire import BlockServer

    async def main() -> None:
        server = BlockServer(MemoryStore(), key=b"k")
        Rendezvous().attach(server)
        await server.start("127.0.0.1", 0)
        ready.put(server.port)
        while stop.empty():
            await asyncio.sleep(0.05)
        await server.aclose()

    asyncio.run(main())
    ready.put(_cpu())


def _gloo_peer(
    rank: int, n: int, elems: int, calls: int, port: int, out: Any, marks: Any = None
) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    x = torch.from_numpy(np.random.default_rng(rank).standard_normal(elems, np.float32))
    for _ in range(WARMUP):
        dist.all_reduce(x.clone())
    if marks is not None:
        _warm(rank, marks)
    times = []
    for _ in range(calls):
        x += 1.0
        y = x.clone()
        dist.barrier()
        c0, t0 = _cpu(), time.perf_counter()
        dist.all_reduce(y)
        y /= n
        times.append((time.perf_counter() - t0, _cpu() - c0))
    dist.destroy_process_group()
    out.put((rank, times))


def _results(out: Any, n: int) -> dict[int, Any]:
    """Every peer's timings, by rank (RuntimeError naming a peer that failed)."""
    results = dict(out.get(timeout=600) for _ in range(n))
    failed = [r for r in results.values() if isinstance(r, str)]
    if failed:
        raise RuntimeError("; ".join(failed))
    return results


def _gather(procs: list[Any], out: Any, n: int) -> tuple[float, float]:
    results = dict(out.get(timeout=600) for _ in range(n))
    for p in procs:
        p.join(60)
    return _medians(results, n)


def _medians(results: dict[int, Any], n: int) -> tuple[float, float]:
    calls = len(results[0])
    wall = [max(results[r][c][0] for r in range(n)) for c in range(calls)]
    cpu = [sum(results[r][c][1] for r in range(n)) for c in range(calls)]
    return statistics.median(wall), statistics.median(cpu)


RENDEZVOUS_CPU: list[float] = []
"""The rendezvous process's CPU-seconds, one entry per ``run_tensorswap``."""


def run_tensorswap(
    n: int, elems: int, calls: int, perf: str | None = None, relay: bool = False
) -> tuple[float, float]:
    ctx = mp.get_context("spawn")
    ready, stop, out = ctx.Queue(), ctx.Queue(), ctx.Queue()
    server = ctx.Process(target=_rendezvous, args=(ready, stop))
    server.start()
    address = f"127.0.0.1:{ready.get(timeout=60)}"
    profile = _Profile(ctx, perf)
    procs = [
        ctx.Process(
            target=_ts_peer, args=(r, n, elems, calls, address, out, False, profile.marks, relay)
        )
        for r in range(n)
    ]
    for p in procs:
        p.start()
    try:
        profile.start()
        results = _results(out, n)
        fetched = statistics.median(call[2] for r in results for call in results[r])
        print(f"  tensorswap: each peer fetched {fetched / 2**20:.1f} MiB a call (all-gather)")
        return _medians(results, n)
    finally:
        for p in procs:
            p.join(60)
        profile.stop(procs)
        stop.put(True)
        RENDEZVOUS_CPU.append(ready.get(timeout=60))
        server.join(30)


def run_kill(n: int, elems: int, calls: int) -> tuple[float, float]:
    """Normal calls' median time, and the time of the call in which the last peer is
    SIGKILLed after committing (the survivors' slowest)."""
    ctx = mp.get_context("spawn")
    ready, stop, out = ctx.Queue(), ctx.Queue(), ctx.Queue()
    server = ctx.Process(target=_rendezvous, args=(ready, stop))
    server.start()
    address = f"127.0.0.1:{ready.get(timeout=60)}"
    procs = [
        ctx.Process(target=_ts_peer, args=(r, n, elems, calls, address, out, True))
        for r in range(n)
    ]
    for p in procs:
        p.start()
    try:
        results = _results(out, n - 1)
        normal = _medians({r: results[r][:-1] for r in results}, n - 1)[0]
        killed = max(results[r][-1][0] for r in results)
        return normal, killed
    finally:
        for p in procs:
            p.join(60)
        stop.put(True)
        server.join(30)


def run_gloo(n: int, elems: int, calls: int, perf: str | None = None) -> tuple[float, float]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    profile = _Profile(ctx, perf)
    procs = [
        ctx.Process(target=_gloo_peer, args=(r, n, elems, calls, port, out, profile.marks))
        for r in range(n)
    ]
    for p in procs:
        p.start()
    try:
        profile.start()
        return _gather(procs, out, n)
    finally:
        profile.stop(procs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--kill", action="store_true", help="also: a peer SIGKILLed mid-call")
    parser.add_argument("--perf", metavar="PREFIX", help="perf record the timed calls")
    parser.add_argument("--relay", action="store_true", help="also: the last peer relayed")
    parser.add_argument(
        "--congestion", default="", help="tensorswap's TCP congestion control (system: the default)"
    )
    args = parser.parse_args()
    if args.congestion:  # the peers (spawned) read it from their environment
        os.environ["BENCH_CONGESTION"] = args.congestion
    elems = args.mib * (1 << 20) // 4
    print(f"{args.peers} peers x {args.mib} MiB float32, {os.cpu_count()} CPUs, loopback")
    perf = {k: f"{args.perf}-{k}.data" if args.perf else None for k in ("gloo", "tensorswap")}
    gloo = run_gloo(args.peers, elems, args.calls, perf["gloo"])
    ts = run_tensorswap(args.peers, elems, args.calls, perf["tensorswap"])
    print(f"gloo        {gloo[0]:7.3f} s/call  {gloo[1]:7.2f} CPU-s/call")
    print(f"tensorswap  {ts[0]:7.3f} s/call  {ts[1]:7.2f} CPU-s/call")
    print(f"ratio tensorswap/gloo: time {ts[0] / gloo[0]:.2f}x  CPU {ts[1] / gloo[1]:.2f}x")
    if args.kill:
        normal, killed = run_kill(args.peers, elems, args.calls)
        print(
            f"SIGKILL mid-call: survivors {killed:.3f} s vs a normal call {normal:.3f} s: "
            f"{killed / normal:.2f}x"
        )
    if args.relay:
        direct = run_tensorswap(args.peers, elems, args.calls)
        relayed = run_tensorswap(args.peers, elems, args.calls, relay=True)
        print(
            f"one peer relayed: {relayed[0]:.3f} s/call ({relayed[1]:.2f} CPU-s, peers only) "
            f"vs all direct {direct[0]:.3f} s/call ({direct[1]:.2f} CPU-s): "
            f"{relayed[0] / direct[0]:.2f}x; rendezvous CPU-s over the run: "
            f"{RENDEZVOUS_CPU[-1]:.2f} relayed vs {RENDEZVOUS_CPU[-2]:.2f} direct"
        )
    try:
        import hivemind  # noqa: F401
    except ImportError:
        print("hivemind: not installed, not measured")


if __name__ == "__main__":
    main()
