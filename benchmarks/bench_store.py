"""Store + load of a float32 tensor in the memory store (blake3 CIDs) vs a numpy copy."""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import numpy as np

from tensorswap.codec import TensorBlock
from tensorswap.store import DEFAULT_CHUNK_BYTES, MemoryStore, get_tensor, put_tensor

GOAL = 0.4  # store + load time vs one fresh numpy copy of the same bytes (.copy())


def _best(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="16 MiB instead of 256 MiB")
    parser.add_argument("--mib", type=int, default=None, help="tensor size in MiB")
    parser.add_argument("--chunk-mib", type=float, default=DEFAULT_CHUNK_BYTES / 2**20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workers", type=int, default=None, help="threads (default: per core)")
    args = parser.parse_args(argv)
    mib = args.mib or int(os.environ.get("TENSORSWAP_BENCH_STORE_MIB", 16 if args.quick else 256))
    chunk_bytes = int(args.chunk_mib * 2**20)
    values = np.random.default_rng(0).standard_normal(mib * 2**18, dtype=np.float32)
    block = TensorBlock("bench", values)
    nbytes = values.nbytes
    print(f"store + load of a {mib} MiB float32 tensor, {args.chunk_mib:g} MiB chunks, blake3")

    dst = np.empty_like(values)
    memcpy = _best(lambda: np.copyto(dst, values), args.repeats)
    fresh_copy = _best(values.copy, args.repeats)

    store = MemoryStore()
    cid = put_tensor(store, block, chunk_bytes=chunk_bytes, workers=args.workers)
    back = get_tensor(store, cid, workers=args.workers)
    if back != block:
        print("  round trip differs from the input")
        return 1
    del back

    def put() -> None:
        put_tensor(MemoryStore(), block, chunk_bytes=chunk_bytes, workers=args.workers)

    def load() -> None:
        get_tensor(store, cid, workers=args.workers)

    def round_trip() -> None:
        fresh = MemoryStore()
        fresh_cid = put_tensor(fresh, block, chunk_bytes=chunk_bytes, workers=args.workers)
        get_tensor(fresh, fresh_cid, workers=args.workers)

    t_put = _best(put, args.repeats)
    t_load = _best(load, args.repeats)
    t_both = _best(round_trip, args.repeats)
    memcpy = min(memcpy, _best(lambda: np.copyto(dst, values), args.repeats))  # noisy machine
    fresh_copy = min(fresh_copy, _best(values.copy, args.repeats))

    def gbps(t: float) -> str:
        return f"{nbytes / t / 1e9:6.2f} GB/s"

    print(f"  numpy copyto (preallocated): {memcpy * 1e3:8.1f} ms  {gbps(memcpy)}")
    print(f"  numpy .copy() (fresh array): {fresh_copy * 1e3:8.1f} ms  {gbps(fresh_copy)}")
    print(f"  put_tensor (encode + hash):  {t_put * 1e3:8.1f} ms  {gbps(t_put)}")
    print(f"  get_tensor (decode + copy):  {t_load * 1e3:8.1f} ms  {gbps(t_load)}")
    print(f"  store + load:                {t_both * 1e3:8.1f} ms  {gbps(t_both)}")
    vs_memcpy = memcpy / t_both
    vs_fresh = fresh_copy / t_both
    print(
        f"Store + load ratio vs numpy copy: {vs_fresh:.2f}x vs .copy() (goal >= {GOAL}x), "
        f"{vs_memcpy:.2f}x vs copyto into preallocated memory"
    )
    if mib < 256:
        print("  (goal judged at 256 MiB only: small arrays copy from cache)")
        return 0
    return 0 if vs_fresh >= GOAL else 1


if __name__ == "__main__":
    raise SystemExit(main())
