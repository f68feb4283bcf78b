"""Run every benchmark module (`python -m benchmarks [--quick] [NAME ...]`)."""

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
