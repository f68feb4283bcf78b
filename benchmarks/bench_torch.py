"""tensorswap against torch.distributed (gloo) on loopback: moving and averaging a tensor.

What a torch.distributed user gets, measured in the same run as tensorswap, taking turns:

1. **move**: one float32 tensor from one process to another. torch: ``dist.send`` /
   ``dist.recv`` into a preallocated tensor (gloo over TCP on 127.0.0.1). tensorswap:
   ``BlockClient.push_tensor`` to a ``BlockServer`` with a ``MemoryStore`` (chunked, blake3
   CIDs offered and checked, CRC32C per frame): bench_wire's end-to-end figure.
2. **average**: two processes each hold a tensor and must both end up with the mean. torch:
   ``dist.all_reduce(SUM)`` then ``/ 2``. tensorswap: each process pushes its tensor to the
   other's ``BlockServer`` at the same time, reads the other's tensor back from its store
   (hash-checked) and averages the two with ``fedavg`` (the pseudo-gradient exchange of
   DiLoCo-style training, with no coordinator).

Each figure is the torch time divided by the tensorswap time of the same turn (above 1:
tensorswap is faster); medians and spreads over ``--reps`` turns. gloo neither hashes nor
checksums anything; tensorswap verifies every byte it keeps. Needs torch (the ``torch``
extra); without it the suite says so and exits 0.

    python benchmarks/bench_torch.py [--quick] [--mib N] [--reps N]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import socket
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

try:
    from benchmarks.__main__ import ratio_line
    from benchmarks.bench_wire import receiver, send_tensorswap
except ModuleNotFoundError:  # run as a script: python benchmarks/bench_torch.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks.__main__ import ratio_line
    from benchmarks.bench_wire import receiver, send_tensorswap


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _values(size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(size).astype(np.float32)


# ── torch.distributed (gloo) ─────────────────────────────────────────────────
def _gloo_worker(rank: int, port: int, size: int, reps: int, conn: Connection) -> None:
    """Join a 2-rank gloo group; per turn, on the parent's word: send/recv, then all_reduce."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        mine = torch.from_numpy(_values(size, rank))
        inbox = torch.empty(size, dtype=torch.float32)
        for _ in range(reps):
            conn.recv()  # the parent's go: the tensorswap turn is over
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                dist.recv(inbox, src=1)
            else:
                dist.send(mine, dst=0)
                dist.recv(inbox[:1], src=0)  # the receiver's acknowledgement
            if rank == 0:
                dist.send(inbox[:1], dst=1)
            moved = time.perf_counter() - start
            if rank == 0 and not torch.equal(inbox, torch.from_numpy(_values(size, 1))):
                raise RuntimeError("gloo delivered other values")
            work = mine.clone()
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(work)
            work /= 2
            averaged = time.perf_counter() - start
            conn.send((moved, averaged))
    finally:
        dist.destroy_process_group()


# ── tensorswap average: two processes push to each other ─────────────────────
def _ts_worker(rank: int, size: int, reps: int, conn: Connection) -> None:
    """Serve blocks; per turn, push this rank's tensor to the other rank's server while it
    pushes to ours, read its tensor back (verified) and average the two."""
    from tensorswap.aggregate import fedavg
    from tensorswap.cid import Cid
    from tensorswap.codec import TensorBlock
    from tensorswap.store import MemoryStore, get_tensor
    from tensorswap.wire import BlockClient, BlockServer, Transport, serve_tcp

    mine = _values(size, rank)
    tensor = TensorBlock("bench", mine)

    async def main() -> None:
        store = MemoryStore()

        async def handle(transport: Transport) -> None:
            await BlockServer(store).handle(transport)

        async with await serve_tcp(handle) as listener:
            conn.send(listener.port)
            other_port = conn.recv()
            for _ in range(reps):
                await asyncio.to_thread(conn.recv)  # go
                start = time.perf_counter()
                async with await BlockClient.connect("127.0.0.1", other_port) as client:
                    result = await client.push_tensor(tensor)
                conn.send(("pushed", str(result.roots[0])))
                root = await asyncio.to_thread(conn.recv)  # the other rank's root, relayed
                theirs = await asyncio.to_thread(get_tensor, store, Cid.parse(root))
                mean = fedavg([(mine, 1), (theirs.values, 1)])
                seconds = time.perf_counter() - start
                if not isinstance(mean.values, np.ndarray) or mean.values.shape != mine.shape:
                    raise RuntimeError("tensorswap averaged the wrong shape")
                conn.send(("done", seconds))
                for cid in list(store):  # the next turn starts from an empty store
                    store.delete(cid)

    asyncio.run(main())


def _turn_tensorswap_average(conns: list[Connection]) -> float:
    for conn in conns:
        conn.send("go")
    roots = [conn.recv() for conn in conns]
    for conn, (_, root) in zip(conns, reversed(roots), strict=True):
        conn.send(root)
    return max(conn.recv()[1] for conn in conns)


def _spread(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="tensor size in MiB")
    parser.add_argument("--reps", type=int, default=5, help="turns of each method")
    parser.add_argument("--quick", action="store_true", help="32 MiB, 2 turns")
    args = parser.parse_args(argv)
    mib, reps = (32, 2) if args.quick else (args.mib, args.reps)
    try:
        import torch  # noqa: F401
    except ImportError:
        print("torch is not installed (pip install 'tensorswap[torch]'): nothing to compare")
        return 0
    size = mib * 1024 * 1024 // 4
    nbytes = size * 4
    ctx = mp.get_context("spawn")
    port = _free_port()
    gloo_pipes = [ctx.Pipe() for _ in range(2)]
    gloo = [
        ctx.Process(target=_gloo_worker, args=(rank, port, size, reps, gloo_pipes[rank][1]))
        for rank in range(2)
    ]
    ts_pipes = [ctx.Pipe() for _ in range(2)]
    peers = [
        ctx.Process(target=_ts_worker, args=(rank, size, reps, ts_pipes[rank][1]))
        for rank in range(2)
    ]
    for process in gloo + peers:
        process.start()
    ts_conns = [parent for parent, _ in ts_pipes]
    gloo_conns = [parent for parent, _ in gloo_pipes]
    ports = [conn.recv() for conn in ts_conns]
    ts_conns[0].send(ports[1])
    ts_conns[1].send(ports[0])
    values = _values(size, 1)
    move: dict[str, list[float]] = {"torch": [], "tensorswap": []}
    average: dict[str, list[float]] = {"torch": [], "tensorswap": []}
    try:
        with receiver("tensorswap", "--reps", str(2 * reps)) as (ts_port, _):
            for _ in range(reps):
                move["tensorswap"].append(send_tensorswap(ts_port, values)[0])
                average["tensorswap"].append(_turn_tensorswap_average(ts_conns))
                for conn in gloo_conns:
                    conn.send("go")
                results = [conn.recv() for conn in gloo_conns]
                move["torch"].append(max(moved for moved, _ in results))
                average["torch"].append(max(averaged for _, averaged in results))
    finally:
        for process in gloo + peers:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
    print(f"torch.distributed (gloo) vs tensorswap, {mib} MiB float32, loopback, {reps} turns")
    print(f"  {'':10} {'torch GB/s':>11} {'tensorswap GB/s':>16} {'torch time / ours':>18}")
    for name, times in (("move", move), ("average", average)):
        ratios = [t / s for t, s in zip(times["torch"], times["tensorswap"], strict=True)]
        torch_gbps = nbytes / statistics.median(times["torch"]) / 1e9
        ts_gbps = nbytes / statistics.median(times["tensorswap"]) / 1e9
        ratio = statistics.median(ratios)
        print(f"  {name:10} {torch_gbps:11.2f} {ts_gbps:16.2f} {ratio:11.2f}x ({_spread(ratios)})")
        print(ratio_line(f"{name}_vs_gloo", ratio))
    print(
        "  (gloo neither hashes nor checksums; tensorswap checks the CID of every block it "
        "keeps and the CRC32C of every frame)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
