"""Compression on a slow link: time to 0.90 test accuracy in the demo for each `--compression`.

Runs `tensorswap demo --netlab` (the coordinator and 4 peers on hosts of their own, 20 Mbit/s
links, 40 ms round-trip time through a delay relay; root only) once per compression
(``none``, ``f16``, ``int8``, ``topk``, with the demo's error feedback) and prints, for each,
the rounds and wall-clock seconds (the rounds' own times, summed) until the global model
first reaches 0.90 test accuracy, the bytes the peers sent, and each one's time as a ratio of
``none``'s, measured in the same run. docs/networks.md records the trade-off; the demo's
default compression is the fastest one here.
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
from pathlib import Path

from rich.console import Console

from benchmarks.__main__ import ratio_line
from tensorswap.demo.config import DemoConfig
from tensorswap.demo.report import DemoReport

TARGET = 0.90
COMPRESSIONS = ("none", "f16", "int8", "topk")


def time_to(report: DemoReport, target: float) -> tuple[int, float] | None:
    """(rounds, seconds) until the first round at ``target`` accuracy (mean over peers)."""
    elapsed = 0.0
    for r in report.rounds:
        elapsed += r.seconds
        if r.accuracy >= target:
            return r.round, elapsed
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--mbit", type=float, default=20.0)
    parser.add_argument("--rtt-ms", type=float, default=40.0)
    args = parser.parse_args(argv)
    from tensorswap.demo.netlab import run_in_lab
    from tensorswap.netlab import NetlabError
    from tensorswap.netlab._sys import check_available

    try:
        check_available()
    except NetlabError as exc:
        print(f"skipped: the network lab is not available here ({exc})")
        return 0
    rounds = args.rounds or (6 if args.quick else 15)
    results: dict[str, tuple[int, float] | None] = {}
    sent: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="bench-compression-") as tmp:
        for compression in COMPRESSIONS:
            cfg = DemoConfig(
                rounds=rounds,
                compression=compression,
                netlab=True,
                link_mbit=args.mbit,
                rtt_ms=args.rtt_ms,
                out=Path(tmp) / compression,
            )
            report = run_in_lab(cfg, Console(file=io.StringIO(), width=160))
            results[compression] = time_to(report, TARGET)
            sent[compression] = sum(r.sent_bytes for r in report.rounds)
            hit = results[compression]
            print(
                f"{compression:>5}: final accuracy {report.final_accuracy:.3f}, sent "
                f"{sent[compression] / 1024:.0f} KiB in {rounds} rounds, {TARGET:.2f} "
                + ("never" if hit is None else f"at round {hit[0]}, after {hit[1]:.2f} s"),
                flush=True,
            )
    base = results["none"]
    print(f"{args.mbit:g} Mbit/s links, {args.rtt_ms:g} ms RTT, 4 peers")
    if base is None:
        print(f"compression none never reached {TARGET:.2f}")
        return 1
    for compression in COMPRESSIONS[1:]:
        hit = results[compression]
        if hit is None:
            print(f"{compression}: never reached {TARGET:.2f}")
            continue
        ratio = hit[1] / base[1]
        print(
            f"{compression}: time to {TARGET:.2f} {ratio:.2f}x none's, bytes sent "
            f"{sent[compression] / max(sent['none'], 1):.2f}x"
        )
        print(ratio_line(f"time_to_0.90_{compression}_over_none", ratio))
    return 0


if __name__ == "__main__":
    sys.exit(main())
