"""Codec encode + decode of a float32 tensor vs pickle, np.save, safetensors, torch.save.

Every figure is a ratio against baselines measured in the same run, interleaved repeat by
repeat so load on a shared machine hits all alike (ratios are medians of per-repeat ratios):

* round trip (encode + decode) of a 256 MiB float32 tensor: tensorswap's hot path
  (``encode_block_into`` a reused buffer, then zero-copy ``decode_block``) vs pickle protocol 5
  in-band, np.save/np.load on BytesIO, safetensors.numpy save/load and torch.save/torch.load on
  BytesIO. Goals: >= 5x the fastest baseline and >= 0.6x a numpy copy (np.copyto into a
  preallocated array) of the same bytes.
* encode throughput of the f16 and int8 encodings (and their decode), for reference.
* lz4 / zstd size ratios on a dense gradient and a 99%-sparse one.

Usage: ``python benchmarks/bench_codec.py [--quick] [--mib N] [--repeats N]``.
Exit status 1 when a goal is missed.
"""

from __future__ import annotations

import argparse
import io
import pickle
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from tensorswap.codec import (
    Encoding,
    TensorBlock,
    decode_block,
    encode_block_into,
    encoded_size,
)
from tensorswap.codec.arrow import Compression

GOAL_VS_FASTEST = 5.0
GOAL_VS_COPY = 0.6


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _baselines(values: np.ndarray) -> dict[str, Callable[[], object]]:
    """Round trips that each turn the array into bytes and back (pickle only as a baseline)."""

    def pickle5() -> object:
        return pickle.loads(pickle.dumps(values, protocol=5))

    def npsave() -> object:
        f = io.BytesIO()
        np.save(f, values, allow_pickle=False)
        f.seek(0)
        return np.load(f, allow_pickle=False)

    found: dict[str, Callable[[], object]] = {"pickle-5": pickle5, "np.save": npsave}
    try:
        from safetensors.numpy import load, save

        found["safetensors"] = lambda: load(save({"t": values}))["t"]
    except ImportError:
        print("  (safetensors not installed: skipped)")
    try:
        import torch

        tensor = torch.from_numpy(values)

        def torchsave() -> object:
            f = io.BytesIO()
            torch.save(tensor, f)
            f.seek(0)
            return torch.load(f)

        found["torch.save"] = torchsave
    except ImportError:
        print("  (torch not installed: skipped)")
    return found


def _round_trip(block: TensorBlock, out: bytearray) -> Callable[[], object]:
    view = memoryview(out)

    def run() -> object:
        n = encode_block_into(block, out)
        decoded = decode_block(view[:n])
        assert decoded.size == block.size
        return decoded

    return run


def _measure(subjects: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Seconds per repeat per subject, subjects interleaved within each repeat (after a warm-up)."""
    for fn in subjects.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in subjects}
    for _ in range(repeats):
        for name, fn in subjects.items():
            times[name].append(_seconds(fn))
    return times


def _ratio(times: dict[str, list[float]], slower: str, faster: str) -> float:
    """Median over repeats of time(slower) / time(faster): robust to load drifting between them."""
    return statistics.median(a / b for a, b in zip(times[slower], times[faster], strict=True))


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def bench_round_trip(mib: int, repeats: int) -> bool:
    values = np.random.default_rng(0).standard_normal(mib * 2**18, dtype=np.float32)
    block = TensorBlock("bench", values)
    nbytes = values.nbytes
    out = bytearray(encoded_size(block))
    dst = np.empty_like(values)
    print(f"round trip (encode + decode) of a {mib} MiB float32 tensor, median of {repeats}")
    subjects: dict[str, Callable[[], object]] = {
        "numpy copy": lambda: np.copyto(dst, values),
        "tensorswap": _round_trip(block, out),
        **_baselines(values),
    }
    times = _measure(subjects, repeats)
    for name, ts in times.items():
        print(
            f"  {name:12s} {_gbps(nbytes, statistics.median(ts)):7.2f} GB/s   tensorswap is "
            f"{_ratio(times, name, 'tensorswap'):6.2f}x it"
        )
    baselines = [k for k in times if k not in ("numpy copy", "tensorswap")]
    fastest = min(baselines, key=lambda k: statistics.median(times[k]))
    vs_fastest = _ratio(times, fastest, "tensorswap")
    vs_copy = _ratio(times, "numpy copy", "tensorswap")
    ok_fastest = vs_fastest >= GOAL_VS_FASTEST
    ok_copy = vs_copy >= GOAL_VS_COPY
    print(
        f"  vs fastest baseline ({fastest}): {vs_fastest:.2f}x (goal >= {GOAL_VS_FASTEST:g}x) "
        f"{'OK' if ok_fastest else 'MISSED'}"
    )
    print(
        f"  vs numpy copy: {vs_copy:.2f}x (goal >= {GOAL_VS_COPY:g}x) "
        f"{'OK' if ok_copy else 'MISSED'}"
    )
    return ok_fastest and ok_copy


def _lossy_line(block: TensorBlock, enc: Encoding, options: dict[str, Any], repeats: int) -> str:
    out = bytearray(encoded_size(block, encoding=enc, **options))
    view = memoryview(out)
    times = _measure(
        {
            "encode": lambda: encode_block_into(block, out, encoding=enc, **options),
            "decode": lambda: decode_block(view),
        },
        repeats,
    )
    nbytes = block.nbytes
    encode, decode = (_gbps(nbytes, statistics.median(times[k])) for k in ("encode", "decode"))
    size = len(out) / nbytes
    return f"  {enc.value:5s} encode {encode:6.2f}   decode {decode:6.2f}   size {size:.3f}x dense"


def bench_lossy(mib: int, repeats: int) -> None:
    values = np.random.default_rng(1).standard_normal(mib * 2**18, dtype=np.float32)
    block = TensorBlock("g", values)
    print(f"lossy encodings of a {mib} MiB float32 gradient (GB/s of float32 input)")
    dst = np.empty_like(values)
    copy = statistics.median(_measure({"copy": lambda: np.copyto(dst, values)}, repeats)["copy"])
    print(f"  numpy copy      {_gbps(values.nbytes, copy):7.2f}")
    for enc, options in (
        (Encoding.F16, {}),
        (Encoding.BF16, {}),
        (Encoding.INT8, {}),
        (Encoding.TOPK, {"topk_fraction": 0.01}),
    ):
        print(_lossy_line(block, enc, options, repeats))


def _compression_part(block: TensorBlock, compression: Compression) -> str:
    plain = encoded_size(block)
    out = bytearray(plain + 4096)
    seconds = _seconds(lambda: encode_block_into(block, out, compression=compression))
    size = encoded_size(block, compression=compression)
    return f"{compression} {plain / size:6.2f}x ({_gbps(block.nbytes, seconds):.2f} GB/s)"


def bench_compression(mib: int) -> None:
    rng = np.random.default_rng(2)
    dense = rng.standard_normal(mib * 2**18, dtype=np.float32)
    sparse = dense.copy()
    sparse[rng.random(sparse.size) < 0.99] = 0.0
    print(f"Arrow body compression of a {mib} MiB float32 gradient (size ratio, encode GB/s)")
    for label, values in (("dense", dense), ("99% sparse", sparse)):
        block = TensorBlock("c", values)
        parts = [_compression_part(block, comp) for comp in ("lz4", "zstd")]
        print(f"  {label:10s} " + "   ".join(parts))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="32 MiB, 3 repeats: a smoke run")
    parser.add_argument("--mib", type=int, default=None, help="round-trip tensor size in MiB")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args(argv)
    mib = args.mib or (32 if args.quick else 256)
    repeats = args.repeats or (3 if args.quick else 7)
    ok = bench_round_trip(mib, repeats)
    bench_lossy(max(4, mib // 4), max(3, repeats // 2))
    bench_compression(max(4, mib // 16))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
