"""Flower 1.42 with and without tensorswap's bridge in the network lab: round time and bytes on
the SuperLink host's link, plain and with half the tensors frozen (issue 28).

The SuperLink's host (``flower-superlink``; the ServerApp runs there) sits behind a link
shaped to 200 Mbit/s each way; the block service (``tensorswap serve``: blocks, the swarm's
tracker and the rounds coordinator that aggregates the replies) runs on a host of its own,
unshaped (``--blocks-on-link``: in the SuperLink's host, as before issue 28's streamed
aggregation); ``--nodes`` SuperNodes (default 8), one host each, unshaped links. One
federation runs four ``flwr run``s of the same app (``flower_bridge_app``: FedAvg over every
node, no evaluation, a float32 model of ``--mib`` MiB in 8 tensors, "training" adds a
constant of the node's own): Flower alone, the bridge (``BlockStrategy(swarm=True,
stream=True)`` + ``blocks_mod``: the service aggregates the replies, the ServerApp fetches
the one aggregate), and both again with every other tensor frozen (returned unchanged).
Each run is 1 warm-up round and ``--rounds`` measured ones (default 2); the ServerApp marks
each round's start (before its messages are made) and end (after aggregation) with the time
and the byte counters of its host's ``eth0`` (``/proc/net/dev`` in that namespace: both
directions, headers included).

Goals (the issue's): bridge round time <= 0.4x Flower's; bridge bytes per round <= 2.5
models; frozen half, bridge bytes / Flower's <= 0.55. Needs root (network namespaces) and
Flower's interpreter (``--flower-python``); prints why and exits 0 without either.
``--quick``: 2 nodes, 2 MiB, 1 measured round, goals not judged. ``--floor-kib KIB``: Flower
alone and the bridge with a KIB KiB model too, each beside its full-size run (the round's
floor: Flower's control plane and per-message ``flwr-clientapp`` start-ups). Every process
runs the tensorswap this bench imported (``PYTHONPATH=/other/src``: another checkout), byte-
compiled first (with ``PYTHONDONTWRITEBYTECODE`` and no ``__pycache__``, each process would
compile what it imports again).
"""

from __future__ import annotations

import argparse
import compileall
import contextlib
import dataclasses
import importlib.util
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tensorswap
from tensorswap.netlab import DEVICE, Host, Lab, NamespacesUnavailable

try:
    from benchmarks.__main__ import ratio_line
except ImportError:  # run as a file
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.__main__ import ratio_line
from benchmarks._flower import flower_python

MiB = 1024 * 1024
LINK_MBIT = 200
LINK_PORT, BLOCKS_PORT, RUNTIME_PORT = 9100, 7000, 9094
TENSORS = 8
APP = Path(__file__).resolve().with_name("flower_bridge_app")
REPO = Path(__file__).resolve().parents[1]
SRC = Path(tensorswap.__file__).resolve().parents[1]
"""The tensorswap every process of the bench runs: the one this bench imported."""
GOAL_TIME, GOAL_MODELS, GOAL_FROZEN = 0.4, 2.5, 0.55


@dataclass(frozen=True)
class Variant:
    name: str
    bridge: bool
    frozen: bool
    kib: int = 0
    """A model of this many KiB instead of ``--mib`` MiB (0: ``--mib``)."""


VARIANTS = (
    Variant("flower", False, False),
    Variant("bridge", True, False),
    Variant("flower-frozen", False, True),
    Variant("bridge-frozen", True, True),
)


def variants(floor_kib: int) -> tuple[Variant, ...]:
    """``VARIANTS``; with ``floor_kib``, Flower's and the bridge's tiny-model runs beside them."""
    if floor_kib <= 0:
        return VARIANTS
    tiny = [Variant(f"{v.name}-tiny", v.bridge, False, floor_kib) for v in VARIANTS[:2]]
    return (VARIANTS[0], tiny[0], VARIANTS[1], tiny[1], *VARIANTS[2:])


@dataclass(frozen=True)
class Rounds:
    """One run's measured rounds: seconds, bytes into and out of the SuperLink host."""

    seconds: list[float]
    received: list[int]
    sent: list[int]
    phases: dict[str, float]
    """Median seconds from a round's start to each phase (the ClientApps' over every node)."""
    load: float = 0.0
    """The machine's 1-minute load average when the run ended (other work included)."""
    streamed: int = 0
    """Rounds (warm-up included) whose replies the block service aggregated."""
    arrival: int = 0
    """Of those, the rounds folded as the replies arrived (each node's mod submitted)."""
    prefetched: int = 0
    """Of those, the rounds whose aggregate was prefetched (0: a tensorswap without it)."""

    def total(self) -> list[int]:
        return [r + s for r, s in zip(self.received, self.sent, strict=True)]


class ProcessFailed(RuntimeError):
    """A process exited or did not get ready in time; its log's tail is in the message."""


class Processes:
    """Processes started inside the lab's hosts, each in a session of its own logging to
    ``logs/NAME.log``; ``close`` ends every group (SIGTERM, SIGKILL after 10 s)."""

    def __init__(self, logs: Path, env: dict[str, str], flower: str) -> None:
        self.logs, self.env = logs, env
        self.bin = Path(flower).parent
        """Flower's scripts: flower-superlink, flower-supernode, flwr."""
        self.started: dict[str, subprocess.Popen[bytes]] = {}
        logs.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, host: Host, argv: list[str]) -> subprocess.Popen[bytes]:
        with (self.logs / f"{name}.log").open("wb") as out:
            proc = host.popen(
                argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.env, start_new_session=True,
            )  # fmt: skip
        self.started[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def tail(self, name: str, lines: int = 25) -> str:
        return "\n".join(self.log(name).splitlines()[-lines:])

    def wait_for(self, name: str, pattern: str, timeout: float = 90.0) -> None:
        """Poll ``name``'s log until ``pattern`` appears (ProcessFailed after ``timeout``)."""
        deadline, proc = time.monotonic() + timeout, self.started[name]
        while time.monotonic() < deadline:
            if re.search(pattern, self.log(name)):
                return
            if proc.poll() is not None:
                raise ProcessFailed(f"{name} exited ({proc.returncode}):\n{self.tail(name)}")
            time.sleep(0.1)  # a readiness poll, bounded by the deadline
        raise ProcessFailed(f"{name}: no {pattern!r} in {timeout} s:\n{self.tail(name)}")

    def stop(self, name: str) -> None:
        """End ``name``'s process group (SIGTERM, then SIGKILL after 10 s)."""
        proc = self.started.pop(name)
        _signal_group(proc, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        _signal_group(proc, signal.SIGKILL)
        proc.wait(timeout=10)

    def close(self) -> None:
        for name in list(self.started):
            self.stop(name)


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def flower_env(flower: str, home: Path) -> dict[str, str]:
    """The worktree's tensorswap importable, Flower's scripts first on PATH (the SuperLink and
    SuperNodes start flower-superexec, flwr-serverapp, flwr-clientapp by name), its state in
    ``home``; nothing else on PYTHONPATH (Flower's venv has its own numpy)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(SRC)
    env["PATH"] = os.pathsep.join([str(Path(flower).parent), env.get("PATH", "")])
    env["FLWR_HOME"] = str(home)
    return env


def start_federation(lab: Lab, procs: Processes, nodes: int) -> Host:
    """The SuperLink in host ``link`` (shaped), ``nodes`` SuperNodes in hosts ``node0``...,
    all registered; ``flwr run``'s connection ``lab`` written to ``$FLWR_HOME/config.toml``."""
    bin_ = procs.bin
    link = lab.add_host("link", mbit=LINK_MBIT)
    hosts = [lab.add_host(f"node{i}") for i in range(nodes)]
    home = Path(procs.env["FLWR_HOME"])
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "lab"\n\n[superlink.lab]\n'
        f'address = "{link.address}:{LINK_PORT}"\ninsecure = true\n'
    )
    procs.start("superlink", link, [
        str(bin_ / "flower-superlink"), "--insecure", "--host", link.address,
        "--port", str(LINK_PORT), "--disable-runtime-dependency-installation",
    ])  # fmt: skip
    procs.wait_for("superlink", rf"running on http://{re.escape(link.address)}:{LINK_PORT}")
    for i, host in enumerate(hosts):
        procs.start(f"supernode{i}", host, [
            str(bin_ / "flower-supernode"), "--insecure", "--superlink",
            f"{link.address}:{LINK_PORT}", "--host", "127.0.0.1", "--port", str(RUNTIME_PORT),
            "--node-config", f"partition-id={i}",
        ])  # fmt: skip
    for i in range(nodes):
        procs.wait_for(f"supernode{i}", r"SuperNode ID: \d+")
    return link


def start_blocks(procs: Processes, host: Host, data: Path, port: int) -> str:
    """``tensorswap serve`` (this interpreter, the worktree's tensorswap) in ``host``; its
    HOST:PORT."""
    env = {**procs.env, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    with (procs.logs / "blocks.log").open("wb") as out:
        proc = host.popen(
            [sys.executable, "-m", "tensorswap.cli.serve_cmd", "--listen",
             f"{host.address}:{port}", "--data", str(data), "--log-level", "warning"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            start_new_session=True, cwd=str(REPO),
        )  # fmt: skip
    procs.started["blocks"] = proc
    procs.wait_for("blocks", rf"listening on {re.escape(host.address)}:{port}")
    return f"{host.address}:{port}"


def run_app(procs: Processes, link: Host, config: dict[str, Any], timeout: float) -> None:
    """``flwr run`` of the app with ``config`` (in the SuperLink's host: its Control traffic
    stays off the measured link), to its end (ProcessFailed if it fails or overruns)."""
    name = f"flwr-run-{config['seed']}"
    run_config = " ".join(f"{k}={_toml(v)}" for k, v in config.items())
    proc = procs.start(name, link, [
        str(procs.bin / "flwr"), "run", str(APP), "lab",
        "--stream", "--run-config", run_config,
    ])  # fmt: skip
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise ProcessFailed(f"{name} ran past {timeout:.0f} s:\n{procs.tail(name)}") from None
    finally:
        procs.stop(name)
    if proc.returncode != 0:
        raise ProcessFailed(f"{name} failed ({proc.returncode}):\n{procs.tail(name, 60)}")


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, str) else str(value)


PHASES = {
    "process": "clientapp started",
    "imported": "imported",
    "train": "arrays in",
    "trained": "trained",
    "replied": "reply out",
}
"""The ClientApp's phases in ``trace.jsonl`` (epoch seconds), as printed."""


def measured(out: Path, warmup: int) -> Rounds:
    """The rounds after the first ``warmup`` ones, from the ServerApp's marks, and the
    ClientApps' phases in them (median seconds after each round's start)."""
    marks: dict[tuple[str, int], dict[str, Any]] = {}
    for line in (out / "marks.jsonl").read_text().splitlines():
        mark = json.loads(line)
        marks[(mark["event"], int(mark["round"]))] = mark
    rounds = sorted({r for event, r in marks if event == "end" and r > warmup})
    if not rounds:
        raise ProcessFailed(f"no measured round in {out}: {sorted(marks)}")
    starts = [marks[("start", r)] for r in rounds]
    ends = [marks[("end", r)] for r in rounds]
    traces = [json.loads(line) for line in (out / "trace.jsonl").read_text().splitlines()]
    offsets: dict[str, list[float]] = {name: [] for name in PHASES}
    last, aggregating = [], []  # (replies handed to the bridge, Flower's aggregation began)
    for r, start in zip(rounds, starts, strict=True):
        mine = [t for t in traces if t["round"] == r]
        for name in PHASES:
            offsets[name] += [t[name] - start["t"] for t in mine]
        last.append(max(t["replied"] for t in mine) - start["t"])
        handed = marks.get(("handed", r), marks[("aggregating", r)])
        aggregating.append((handed["t"] - start["t"], marks[("aggregating", r)]["t"] - start["t"]))
    phases = {PHASES[name]: statistics.median(values) for name, values in offsets.items()}
    phases["last reply out"] = statistics.median(last)
    phases["replies handed"] = statistics.median(h for h, _ in aggregating)
    phases["aggregation began"] = statistics.median(a for _, a in aggregating)
    return Rounds(
        [e["t"] - s["t"] for s, e in zip(starts, ends, strict=True)],
        [e["rx"] - s["rx"] for s, e in zip(starts, ends, strict=True)],
        [e["tx"] - s["tx"] for s, e in zip(starts, ends, strict=True)],
        phases,
    )


@dataclass(frozen=True)
class Settings:
    nodes: int
    mib: int
    rounds: int
    warmup: int
    floor_kib: int = 0

    def timeout(self) -> float:
        """A generous bound on one run: 4x Flower's bytes at the link's rate, per round."""
        per_round = 2 * self.nodes * self.mib * MiB * 8 / (LINK_MBIT * 1e6)
        return 120 + (self.rounds + self.warmup) * (4 * per_round + 30)


def run_variant(
    procs: Processes,
    hosts: tuple[Host, Host],
    variant: Variant,
    settings: Settings,
    tmp: Path,
    seed: int,
) -> Rounds:
    """One ``flwr run`` of ``variant`` (the bridge's block service fresh for it, in the second
    of ``hosts`` = (SuperLink's, service's), ended after); its measured rounds. ``seed``: the
    initial model's (no run shares a block with another)."""
    link, service = hosts
    out = tmp / variant.name
    out.mkdir()
    blocks = ""
    if variant.bridge:
        blocks = start_blocks(procs, service, tmp / f"blocks-{seed}", BLOCKS_PORT + seed)
    config = {
        "blocks": blocks, "swarm": True, "out": str(out), "device": DEVICE,
        "rounds": settings.warmup + settings.rounds, "nodes": settings.nodes,
        "mib": settings.mib, "kib": variant.kib, "tensors": TENSORS, "frozen": variant.frozen,
        "seed": seed,
    }  # fmt: skip
    try:
        run_app(procs, link, config, settings.timeout())
    finally:
        if variant.bridge:
            procs.stop("blocks")
            shutil.rmtree(tmp / f"blocks-{seed}", ignore_errors=True)
    counted = out / "bytes.json"
    bridged = json.loads(counted.read_text()) if counted.exists() else {}
    rounds = measured(out, settings.warmup)
    return dataclasses.replace(
        rounds,
        load=os.getloadavg()[0],
        streamed=bridged.get("streamed_rounds", 0),
        arrival=bridged.get("arrival_rounds", 0),
        prefetched=bridged.get("prefetched_rounds", 0),
    )


def report(
    results: dict[str, Rounds], settings: Settings, judge: bool, *, blocks_on_link: bool = False
) -> list[str]:
    """Print each variant's rounds and the ratios; the names of the goals missed."""
    model = settings.mib * MiB
    print(
        f"flower_bridge: {settings.nodes} SuperNodes, {settings.mib} MiB model ({TENSORS} "
        f"tensors), the SuperLink host's link {LINK_MBIT} Mbit/s, {settings.warmup} warm-up "
        f"+ {settings.rounds} measured round(s) per run; block service "
        f"{'in the SuperLink host' if blocks_on_link else 'on a host of its own'}"
    )
    print(f"  tensorswap from {SRC}")
    for name, rounds in results.items():
        down = statistics.median(rounds.sent) / model
        up = statistics.median(rounds.received) / model
        print(
            f"  {name:<14} round {_spread(rounds.seconds)} s; link "
            f"{statistics.median(rounds.total()) / model:.2f} models/round "
            f"(down {down:.2f}, up {up:.2f}); load {rounds.load:.1f}; "
            f"streamed rounds {rounds.streamed} ({rounds.arrival} folded as replies arrived, "
            f"{rounds.prefetched} prefetched)"
        )
        print("    " + ", ".join(f"{k} {v:.1f}" for k, v in rounds.phases.items()))
    seconds = {n: statistics.median(r.seconds) for n, r in results.items()}
    models = {n: statistics.median(r.total()) / model for n, r in results.items()}
    checks = [
        ("flower_bridge_round_time", seconds["bridge"] / seconds["flower"], GOAL_TIME),
        ("flower_bridge_models_per_round", models["bridge"], GOAL_MODELS),
        ("flower_bridge_frozen_bytes", models["bridge-frozen"] / models["flower-frozen"],
         GOAL_FROZEN),
    ]  # fmt: skip
    print(f"  (phases: median s after a round's start, the ClientApps' over every node; "
          f"load: the 1-minute load average at the run's end, {os.cpu_count()} CPUs)")  # fmt: skip
    print(ratio_line("flower_bridge_flower_models_per_round", models["flower"]))
    print(ratio_line("flower_bridge_frozen_round_time",
                     seconds["bridge-frozen"] / seconds["flower-frozen"]))  # fmt: skip
    if "flower-tiny" in seconds:
        floor(seconds)
    missed = []
    for name, value, goal in checks:
        print(ratio_line(name, value, "<=", goal) if judge else ratio_line(name, value))
        if judge and value > goal:
            missed.append(name)
    return missed


def floor(seconds: dict[str, float]) -> None:
    """The tiny-model rounds against the time goal's budget (0.4x Flower's full-size round)."""
    tiny, bridge, budget = seconds["flower-tiny"], seconds["bridge-tiny"], 0.4 * seconds["flower"]
    print(f"  floor: tiny-model rounds, Flower {tiny:.2f} s, the bridge {bridge:.2f} s; 0.4x "
          f"Flower's round {budget:.2f} s")  # fmt: skip
    print(ratio_line("flower_bridge_floor_flower_tiny", tiny / seconds["flower"]))
    print(ratio_line("flower_bridge_floor_bridge_tiny", bridge / seconds["flower"]))


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def default_flower() -> str | None:
    """``benchmarks._flower``'s interpreter, else this one when it has flwr."""
    named = flower_python()
    if named is not None:
        return named
    return sys.executable if importlib.util.find_spec("flwr") is not None else None


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def run_all(
    lab: Lab, flower: str, settings: Settings, keep_logs: str | None, *, blocks_on_link: bool
) -> dict[str, Rounds]:
    """Every variant's rounds, on one federation in ``lab`` (closed afterwards, as is every
    process, also when a run fails); the block service on a host of its own unless
    ``blocks_on_link``."""
    with lab, tempfile.TemporaryDirectory(prefix="tensorswap-fbench-") as tmp:
        procs = Processes(Path(tmp) / "logs", flower_env(flower, Path(tmp) / "home"), flower)
        try:
            link = start_federation(lab, procs, settings.nodes)
            hosts = (link, link if blocks_on_link else lab.add_host("blocks"))
            return {
                v.name: run_variant(procs, hosts, v, settings, Path(tmp), seed)
                for seed, v in enumerate(variants(settings.floor_kib), start=1)
            }
        finally:
            procs.close()
            if keep_logs:
                shutil.copytree(procs.logs, keep_logs, dirs_exist_ok=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="2 nodes, 2 MiB, 1 measured round (goals not judged)")  # fmt: skip
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--mib", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="measured rounds per run")
    parser.add_argument("--flower-python", default=default_flower(), metavar="PYTHON",
                        help="an interpreter with flwr==1.42.0 (default $TENSORSWAP_FLOWER_"
                        "PYTHON, else .venv-flower, else this one if it has flwr)")  # fmt: skip
    parser.add_argument("--keep-logs", metavar="DIR", help="copy the processes' logs here")
    parser.add_argument("--blocks-on-link", action="store_true",
                        help="the service behind the SuperLink host's link")  # fmt: skip
    parser.add_argument("--floor-kib", type=int, default=0, metavar="KIB",
                        help="also run Flower alone and the bridge with a KIB KiB model (the "
                        "round's floor), in the same federation")  # fmt: skip
    args = parser.parse_args(argv)
    settings = Settings(args.nodes, args.mib, args.rounds, warmup=1, floor_kib=args.floor_kib)
    if args.quick:
        settings = Settings(2, 2, 1, warmup=1, floor_kib=args.floor_kib)
    if args.flower_python is None:
        print("skipped: no Flower interpreter (make flower-venv, or --flower-python)")
        return 0
    try:
        lab = Lab()
    except NamespacesUnavailable as exc:
        print(f"skipped: {exc.reason}")
        return 0
    began = time.perf_counter()
    compileall.compile_dir(SRC, quiet=1)  # each process would compile it again otherwise
    # SIGTERM (timeout, a CI's cancel) ends the run through the finally blocks below, which
    # end every process group and delete the namespaces; Python's default would skip them
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminated) if main_thread else None
    try:
        results = run_all(
            lab, args.flower_python, settings, args.keep_logs, blocks_on_link=args.blocks_on_link
        )
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    missed = report(results, settings, judge=not args.quick, blocks_on_link=args.blocks_on_link)
    print(f"  ({time.perf_counter() - began:.0f} s in all)")
    if missed:
        print(f"missed the goal: {missed}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
