"""FedAvg of K float32 contributions vs a naive numpy `avg += w * g` loop, measured in one run."""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import numpy as np

from tensorswap.aggregate import Contribution, ContributionMatrix, StreamingAccumulator, fedavg

GOAL = 2.0


def _best(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="1M values per contribution")
    parser.add_argument("--contributions", type=int, default=8)
    parser.add_argument("--values", type=int, default=None, help="values per contribution")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    k = args.contributions
    m = args.values or int(
        os.environ.get("TENSORSWAP_BENCH_AGG_VALUES", 1 << 20 if args.quick else 16 << 20)
    )
    rng = np.random.default_rng(0)
    samples = [int(n) for n in rng.integers(10, 1000, size=k)]
    weights = np.array(samples, dtype=np.float64) / sum(samples)
    weights32 = weights.astype(np.float32)

    matrix = ContributionMatrix(k, (m,), np.float32)
    grads = []
    for i in range(k):
        g = rng.standard_normal(m, dtype=np.float32)
        matrix.fill(i, g, samples[i])
        grads.append(g)
    contributions = [Contribution(g, n) for g, n in zip(grads, samples, strict=True)]
    print(f"FedAvg of {k} x {m:,} float32 contributions ({k * m * 4 / 2**20:.0f} MiB)")

    def naive() -> np.ndarray:
        avg = np.zeros(m, dtype=np.float32)
        for w, g in zip(weights32, grads, strict=True):
            avg += w * g
        return avg

    def rows_inplace(chunk: int = 1 << 15) -> np.ndarray:
        out = np.empty(m, dtype=np.float32)
        tmp = np.empty(chunk, dtype=np.float32)
        for start in range(0, m, chunk):
            stop = min(start + chunk, m)
            o, t = out[start:stop], tmp[: stop - start]
            np.multiply(grads[0][start:stop], weights32[0], out=o)
            for w, g in zip(weights32[1:], grads[1:], strict=True):
                np.multiply(g[start:stop], w, out=t)
                np.add(o, t, out=o)
        return out

    def streaming() -> object:
        acc = StreamingAccumulator()
        for g, n in zip(grads, samples, strict=True):
            acc.add(g, n)
        return acc.result()

    variants: dict[str, Callable[[], object]] = {
        "fedavg(ContributionMatrix), one matvec": lambda: fedavg(matrix),
        "fedavg(list of arrays), blocked matvec": lambda: fedavg(contributions),
        "in-place out= loop over rows, chunked": rows_inplace,
        "StreamingAccumulator, add x K + result": streaming,
    }
    reference = naive()
    for name, fn in variants.items():
        got = fn()
        values = got if isinstance(got, np.ndarray) else got.values  # type: ignore[attr-defined]
        err = float(np.max(np.abs(values - reference))) if m else 0.0
        if err > 1e-4:
            print(f"  {name}: result differs from the naive loop by {err}")
            return 1
    timings = {"naive": 0.0, **dict.fromkeys(variants, 0.0)}
    baseline = _best(naive, args.repeats)
    for name, fn in variants.items():
        timings[name] = _best(fn, args.repeats)
    baseline = min(baseline, _best(naive, args.repeats))  # again, after: the machine is noisy
    print(f"  naive `avg += w * g` loop: {baseline * 1e3:8.1f} ms   (1.00x)")
    for name in variants:
        t = timings[name]
        print(f"  {name}: {t * 1e3:8.1f} ms   ({baseline / t:.2f}x)")
    headline = baseline / timings["fedavg(ContributionMatrix), one matvec"]
    listed = baseline / timings["fedavg(list of arrays), blocked matvec"]
    print(f"FedAvg ratio vs naive: {headline:.2f}x (goal >= {GOAL}x); list input {listed:.2f}x")
    stream = baseline / timings["StreamingAccumulator, add x K + result"]
    print(f"Streaming accumulator ratio vs naive: {stream:.2f}x")
    return 0 if headline >= GOAL else 1


if __name__ == "__main__":
    raise SystemExit(main())
