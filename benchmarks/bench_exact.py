"""What ``--deterministic`` costs: 8 peers each submitting a 64 MiB update to one `tensorswap
serve` process, rounds taking turns between the default (contributions folded into the sums as
they arrive, in arrival order) and ``RoundSpec(deterministic=True)`` (nothing folded on
arrival; at the close the contributions are read back chunk by chunk and folded in peer-name
order, so the bits never depend on arrival order). Per pair of rounds, deterministic / default
round time (first byte sent -> every peer holds the aggregate's CID) and peak RSS growth of
the coordinator over that round; the medians are reported. Goals: time <= 1.3x, RSS <= 1.1x.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.__main__ import ratio_line
from benchmarks.bench_rounds import Coordinator, MiB, big_round


def _round(coord: Coordinator, peers: int, size: int, rep: int, exact: bool) -> tuple[float, int]:
    """(seconds, peak RSS growth in bytes over the round) of round ``rep + 1``."""
    before, _ = coord.memory()
    coord.reset_peak()
    seconds, _, _ = asyncio.run(big_round(coord.port, peers, size, rep, deterministic=exact))
    _, peak = coord.memory()
    return seconds, peak - before


def run(tmp: Path, peers: int, size: int, reps: int) -> bool:
    coord = Coordinator(tmp / "exact")
    default: list[tuple[float, int]] = []
    exact: list[tuple[float, int]] = []
    try:
        _round(coord, peers, size, 0, False)  # warm-up: imports, first files, page cache
        for rep in range(reps):  # which one goes first alternates
            order = (False, True) if rep % 2 == 0 else (True, False)
            for flag in order:
                (exact if flag else default).append(
                    _round(coord, peers, size, 1 + 2 * rep + flag, flag)
                )
    finally:
        coord.stop()
    times = [e[0] / d[0] for e, d in zip(exact, default, strict=True)]
    rss = [e[1] / max(d[1], 1) for e, d in zip(exact, default, strict=True)]
    mib = size // MiB

    def row(name: str, values: list[tuple[float, int]]) -> str:
        secs = statistics.median(v[0] for v in values)
        grow = statistics.median(v[1] for v in values) / size
        times = f"round {secs:.3f} s (median of {len(values)})"
        return f"  {name:14} {times}, peak RSS +{grow:.2f}x one update"

    print(f"{peers} x {mib} MiB, {reps} rounds of each, taking turns:")
    print(row("default", default))
    print(row("deterministic", exact))
    time_ratio, rss_ratio = statistics.median(times), statistics.median(rss)
    print(
        f"  deterministic / default: time {time_ratio:.2f}x "
        f"(min {min(times):.2f}, max {max(times):.2f}), "
        f"peak RSS {rss_ratio:.2f}x (min {min(rss):.2f}, max {max(rss):.2f})"
    )
    print(ratio_line("deterministic_time_vs_default", time_ratio, "<=", 1.3))
    print(ratio_line("deterministic_rss_vs_default", rss_ratio, "<=", 1.1))
    print(f"cores: {os.cpu_count()}, load average: {os.getloadavg()[0]:.1f}")
    return time_ratio <= 1.3 and rss_ratio <= 1.1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="8 x 4 MiB, 2 rounds of each")
    parser.add_argument("--reps", type=int, default=5, help="rounds of each kind")
    args = parser.parse_args(argv)
    size = (4 if args.quick else 64) * MiB
    with tempfile.TemporaryDirectory(prefix="bench-exact-") as tmp:
        ok = run(Path(tmp), 8, size, 2 if args.quick else args.reps)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
