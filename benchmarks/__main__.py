"""Run every benchmark module (`python -m benchmarks [--quick] [NAME ...]`).

`tensorswap bench` runs each suite through this entry point and reads the ratios from its
output. A suite may print machine-readable lines for that, which then replace the heuristic
reading of its human-readable lines (see `tensorswap.cli.bench_cmd`)::

    RATIO <name> <value> [>= | <= <goal>]      e.g.  RATIO fedavg_vs_naive 2.31 >= 2

`ratio_line` formats one.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import pkgutil
import sys
import time
from pathlib import Path


def available() -> list[str]:
    """Names of the benchmark modules (bench_<name>.py) in this folder."""
    here = Path(__file__).parent
    return sorted(
        m.name.removeprefix("bench_")
        for m in pkgutil.iter_modules([str(here)])
        if m.name.startswith("bench_")
    )


def ratio_line(name: str, value: float, op: str | None = None, goal: float | None = None) -> str:
    """The machine-readable line for one ratio (``name`` without spaces)."""
    if " " in name or not name:
        raise ValueError(f"a ratio name is one word, got {name!r}")
    tail = "" if op is None or goal is None else f" {op} {goal:g}"
    return f"RATIO {name} {value:.4g}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("names", nargs="*", help=f"subset to run (default all): {available()}")
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    args = parser.parse_args(argv)
    names = args.names or available()
    unknown = sorted(set(names) - set(available()))
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; available: {available()}")
    failed = []
    for name in names:
        print(f"\n=== {name} ===", flush=True)
        start = time.perf_counter()
        module = importlib.import_module(f"benchmarks.bench_{name}")
        bench_argv = ["--quick"] if args.quick else []
        if inspect.signature(module.main).parameters:
            rc = module.main(bench_argv)
        else:  # a main() that parses sys.argv itself
            sys.argv = [f"bench_{name}", *bench_argv]
            rc = module.main()
        if rc:
            failed.append(name)
        print(f"--- {name}: {time.perf_counter() - start:.1f}s", flush=True)
    if failed:
        print(f"\nbenchmarks that missed a goal or failed: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
