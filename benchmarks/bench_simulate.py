"""Simulation vs Flower's simulation engine on the same workload (``tensorswap simulate``).

1,000 clients, 100 sampled per round, 5 rounds, a 1 MiB model (the synthetic task: each
client's update a real, distinct 1 MiB tensor), ``--workers`` workers (default: the CPU
cores) on both sides: tensorswap's driver, coordinator (``tensorswap serve``) and worker
processes (``--backend process``, and ``--backend ray`` where Ray is installed), and
Flower 1.42's ``run_simulation`` (Ray backend, one CPU per ClientApp actor) running
``benchmarks/flower_simulate.py`` under ``--flower-python`` (a venv with
``flwr[simulation]==1.42.0``; skipped, and said so, without one).

Per side, measured from outside with one sampler (``tensorswap.simulate.memory``): the
peak summed RSS of the whole process tree (for Ray: GCS, raylet, actors, workers), and
the seconds per round as each side times them (between the server's evaluations of
consecutive global models). The medians of rounds 2..R are compared ("steady": round 1 of
Flower also starts its actors); the mean of all rounds and the wall time of the whole
command are printed too. Goals, for the default ``process`` backend: >= 3x faster per
round, <= 1/2 the peak memory. The ``ray`` backend's ratios are printed without goals: it
carries Ray's own processes (GCS, raylet, dashboard and runtime-env agents, about 0.5 GiB)
as Flower does, so its memory ratio says more about Ray than about either engine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.__main__ import ratio_line
from benchmarks._flower import VENV, flower_python
from tensorswap.demo.fleet import child_env
from tensorswap.simulate.memory import PeakMemory

HERE = Path(__file__).resolve().parent
#: flwr[simulation]==1.42.0 with Ray, in a venv of its own (benchmarks/_flower.py)
DEFAULT_FLOWER_PYTHON = Path(flower_python() or VENV / "bin" / "python")
MiB = 1024 * 1024


def _run(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[str, int, int, float]:
    """Run ``cmd``; its stdout, peak tree RSS, processes at the peak, wall seconds."""
    start = time.perf_counter()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=HERE.parent)
        memory = PeakMemory(proc.pid, interval=0.05).start()
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        finally:
            memory.stop()
        wall = time.perf_counter() - start
        out.seek(0)
        err.seek(0)
        text, log = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    if rc != 0:
        tail = "\n".join(log.strip().splitlines()[-15:])
        raise RuntimeError(f"{cmd[:4]} exited {rc}:\n{tail}")
    return text, memory.peak_bytes, memory.peak_processes, wall


def run_tensorswap(args: argparse.Namespace, backend: str, tmp: Path) -> dict[str, Any]:
    out = tmp / f"tensorswap-{backend}"
    cmd = [
        sys.executable,
        "-m",
        "tensorswap.cli.simulate_cmd",
        *("--clients", str(args.clients), "--per-round", str(args.per_round)),
        *("--rounds", str(args.rounds), "--model-mib", str(args.model_mib)),
        *("--backend", backend, "--workers", str(args.workers), "--out", str(out), "--no-plot"),
    ]
    _, peak, procs, wall = _run(cmd, child_env(), args.timeout)
    summary = json.loads((out / "summary.json").read_text())
    return {
        "rounds": [r["seconds"] for r in summary["rounds"]],
        "losses": [r["loss"] for r in summary["rounds"]],
        "peak": peak,
        "procs": procs,
        "wall": wall,
    }


def run_flower(args: argparse.Namespace, python: Path) -> dict[str, Any]:
    env = {k: v for k, v in child_env().items() if k != "PYTHONPATH"}
    cmd = [
        str(python),
        str(HERE / "flower_simulate.py"),
        *("--clients", str(args.clients), "--per-round", str(args.per_round)),
        *("--rounds", str(args.rounds), "--model-mib", str(args.model_mib)),
        *("--workers", str(args.workers)),
    ]
    text, peak, procs, wall = _run(cmd, env, args.timeout)
    line = [ln for ln in text.splitlines() if ln.startswith('{"round_seconds"')][-1]
    got = json.loads(line)
    return {
        "rounds": got["round_seconds"],
        "losses": got["losses"][1:],
        "peak": peak,
        "procs": procs,
        "wall": wall,
    }


def _steady(rounds: list[float]) -> float:
    """The median of rounds 2..R (robust to a round slowed by other work on the machine)."""
    return statistics.median(rounds[1:] if len(rounds) > 1 else rounds)


def _row(name: str, r: dict[str, Any]) -> str:
    return (
        f"{name:<22} {_steady(r['rounds']):>9.3f} {statistics.mean(r['rounds']):>9.3f} "
        f"{r['wall']:>8.1f} {r['peak'] / MiB:>9.0f} {r['procs']:>6}   "
        + " ".join(f"{x:.2f}" for x in r["rounds"])
        + f"   loss {r['losses'][-1]:.4f}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="100 clients, 10 per round, 3 rounds")
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--per-round", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model-mib", type=float, default=1.0)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--backends", default="process,ray", help="tensorswap backends (ray: if installed)"
    )
    parser.add_argument(
        "--flower-python",
        type=Path,
        default=DEFAULT_FLOWER_PYTHON,
        help="a Python with flwr[simulation]==1.42.0 [default: $TENSORSWAP_FLOWER_PYTHON, "
        "else .venv-flower from `make flower-venv`]",
    )
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args(argv)
    if args.quick:
        args.clients, args.per_round, args.rounds, args.model_mib = 100, 10, 3, 0.25
    backends = [b for b in args.backends.split(",") if b]
    if "ray" in backends:
        from tensorswap.simulate.ray_backend import ray_available

        if not ray_available():
            print("tensorswap ray backend skipped: Ray is not installed")
            backends.remove("ray")
    print(
        f"workload: {args.clients:,} clients, {args.per_round} per round, {args.rounds} rounds, "
        f"{args.model_mib:g} MiB model, {args.workers} workers; cores {os.cpu_count()}, "
        f"load {os.getloadavg()[0]:.1f}"
    )
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-simulate-") as tmp:
        for backend in backends:
            results[f"tensorswap {backend}"] = run_tensorswap(args, backend, Path(tmp))
        if args.flower_python.exists():
            results["flower (ray)"] = run_flower(args, args.flower_python)
        else:
            print(f"Flower skipped: no {args.flower_python} (see --flower-python)")
    print(
        f"{'':<22} {'median s':>9} {'mean s':>9} {'wall s':>8} {'peak MiB':>9} {'procs':>6}"
        "   seconds per round"
    )
    for name, r in results.items():
        print(_row(name, r))
    flower = results.get("flower (ray)")
    ok = True
    if flower is not None:
        for backend in backends:
            ts = results[f"tensorswap {backend}"]
            speed = _steady(flower["rounds"]) / _steady(ts["rounds"])
            memory = ts["peak"] / flower["peak"]
            wall = flower["wall"] / ts["wall"]
            print(
                f"tensorswap {backend} vs Flower: {speed:.1f}x faster per round (steady), "
                f"{memory:.2f}x the peak memory, {wall:.1f}x faster end to end"
            )
            if backend == "process":  # the default backend carries the goals
                print(ratio_line("simulate_process_round_speedup", speed, ">=", 3))
                print(ratio_line("simulate_process_memory_ratio", memory, "<=", 0.5))
                ok = ok and speed >= 3 and memory <= 0.5
            else:  # Ray's own processes (GCS, raylet, agents: ~0.5 GiB) on both sides
                print(ratio_line(f"simulate_{backend}_round_speedup", speed))
                print(ratio_line(f"simulate_{backend}_memory_ratio", memory))
            print(ratio_line(f"simulate_{backend}_wall_speedup", wall))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
