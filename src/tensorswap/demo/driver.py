"""The driver of `tensorswap demo`: a coordinator process, N peer processes, R rounds.

It starts a local coordinator (`tensorswap serve` on 127.0.0.1, port 0, data in a temporary
directory) for the star topology, spawns the peers (`python -m tensorswap.demo.peer`), sends
them one command per round on stdin and reads their JSON-line reports from stdout. It shows
progress with rich, and at the end writes `summary.json` and a plot `demo.png` (accuracy and
bytes per round) into the output directory. Every process it started is stopped and reaped
when it returns, fails or is interrupted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import secrets
import signal
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

import tensorswap
from tensorswap.errors import TensorSwapError

__all__ = ["DemoConfig", "DemoError", "DemoReport", "RoundReport", "plot_report", "run_demo"]

READY_TIMEOUT_S = 120.0  # imports of torch and scikit-learn on a loaded machine
STOP_TIMEOUT_S = 10.0
_LISTENING = re.compile(r"listening on (\S+):(\d+)")


class DemoError(TensorSwapError, RuntimeError):
    """The demo could not run (a process failed to start, a peer gave up, ...)."""


@dataclass(frozen=True)
class DemoConfig:
    """Every option of `tensorswap demo`."""

    peers: int = 4
    rounds: int = 10
    aggregator: str = "fedavg"
    compression: str = "none"
    topology: str = "star"
    kill_peer: int | None = None
    local_epochs: int = 2
    seed: int = 0
    out: Path = Path("tensorswap-out")
    data: Path | None = None
    deadline_s: float = 15.0
    quorum: int | None = None
    freeze_first_layer: bool = False
    max_fragment_bytes: int | None = None  # p2p: the DWE size cap (None: 8 MiB)

    def round_quorum(self, alive: int) -> int:
        """Contributions a round needs at its deadline: ``--quorum``, else all but one peer
        when a peer will be killed, else every peer."""
        if self.quorum is not None:
            return max(1, min(self.quorum, alive))
        return max(1, alive - 1) if self.kill_peer is not None else alive


@dataclass
class RoundReport:
    """One round as the driver saw it."""

    round: int
    expected: int
    reported: int = 0
    contributors: int = 0
    accuracy: float = 0.0
    min_accuracy: float = 0.0
    sent_bytes: int = 0
    dense_bytes: int = 0
    pulled_bytes: int = 0
    saved_bytes: int = 0
    seconds: float = 0.0
    ok: bool = True
    outcome: str = ""
    how: str = ""  # the outcome in a few words, for the table
    killed: str | None = None
    aggregate: str | None = None


@dataclass
class DemoReport:
    """What a demo run did; also written to ``summary.json``."""

    config: dict[str, Any]
    initial_accuracy: float
    rounds: list[RoundReport] = field(default_factory=list)
    seconds: float = 0.0
    coordinator: dict[str, Any] | None = None
    plot: str = ""
    summary: str = ""

    @property
    def final_accuracy(self) -> float:
        return self.rounds[-1].accuracy if self.rounds else self.initial_accuracy

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["final_accuracy"] = self.final_accuracy
        return data


# ── processes ────────────────────────────────────────────────────────────────
def _child_env() -> dict[str, str]:
    """The environment of the demo's processes: one thread each, tensorswap importable."""
    env = dict(os.environ)
    src = str(Path(tensorswap.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


@dataclass
class Peer:
    index: int
    proc: asyncio.subprocess.Process
    log: IO[bytes]
    reader: asyncio.Task[None] | None = None
    alive: bool = True
    ready: dict[str, Any] | None = None

    @property
    def name(self) -> str:
        return f"peer-{self.index}"


class Fleet:
    """The processes of one demo run; ``aclose`` stops and reaps every one of them."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.events: asyncio.Queue[tuple[int, dict[str, Any]]] = asyncio.Queue()
        self.peers: list[Peer] = []
        self.coordinator: asyncio.subprocess.Process | None = None
        self._coord_log: IO[bytes] | None = None
        self.env = _child_env()

    # coordinator
    async def start_coordinator(self, data: Path) -> tuple[str, int]:
        log_path = self.out / "coordinator.log"
        self._coord_log = open(log_path, "wb")  # noqa: SIM115 - closed in aclose
        self.coordinator = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tensorswap.cli.serve_cmd",
            "--listen",
            "127.0.0.1:0",
            "--data",
            str(data),
            "--fast-commit",
            "--timeout",
            "120",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=self._coord_log,
            stderr=self._coord_log,
            env=self.env,
        )
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            text = log_path.read_text(errors="replace")
            if match := _LISTENING.search(text):
                return match.group(1), int(match.group(2))
            if self.coordinator.returncode is not None:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.coordinator.wait(), 0.05)
        tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
        raise DemoError("the coordinator did not start: " + (" | ".join(tail) or "no output"))

    # peers
    async def start_peer(self, index: int, args: list[str]) -> Peer:
        log = open(self.out / f"peer-{index}.log", "wb")  # noqa: SIM115 - closed in aclose
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tensorswap.demo.peer",
            "--index",
            str(index),
            *args,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=log,
            env=self.env,
        )
        peer = Peer(index, proc, log)
        peer.reader = asyncio.create_task(self._read(peer))
        self.peers.append(peer)
        return peer

    async def _read(self, peer: Peer) -> None:
        stream = peer.proc.stdout
        assert stream is not None
        while line := await stream.readline():
            try:
                event = json.loads(line)
            except ValueError:
                continue  # not a report (a library printing to stdout): ignore
            if isinstance(event, dict):
                await self.events.put((peer.index, event))
        await self.events.put((peer.index, {"event": "exit"}))

    async def send(self, peer: Peer, command: Mapping[str, Any]) -> None:
        stdin = peer.proc.stdin
        if stdin is None or stdin.is_closing() or not peer.alive:
            return
        stdin.write((json.dumps(command) + "\n").encode())
        with contextlib.suppress(ConnectionError):
            await stdin.drain()

    async def kill(self, peer: Peer) -> None:
        peer.alive = False
        if peer.proc.returncode is None:
            peer.proc.kill()
        await peer.proc.wait()

    # teardown
    async def aclose(self) -> None:
        """Ask every peer to stop (end of input), then terminate, then kill; reap all."""
        for peer in self.peers:
            stdin = peer.proc.stdin
            if stdin is not None and not stdin.is_closing():
                stdin.close()
        await asyncio.gather(*(self._stop(p.proc, gentle=True) for p in self.peers))
        for peer in self.peers:
            if peer.reader is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(peer.reader, STOP_TIMEOUT_S)
            if peer.proc.stdin is not None:
                with contextlib.suppress(ConnectionError):
                    await peer.proc.stdin.wait_closed()
            peer.log.close()
        if self.coordinator is not None:
            await self._stop(self.coordinator, gentle=False)
        if self._coord_log is not None:
            self._coord_log.close()

    @staticmethod
    async def _stop(proc: asyncio.subprocess.Process, *, gentle: bool) -> None:
        if proc.returncode is None and gentle:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(proc.wait()), STOP_TIMEOUT_S / 2)
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(proc.wait()), STOP_TIMEOUT_S)
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        await proc.wait()


# ── the run ──────────────────────────────────────────────────────────────────
def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


class _Ui:
    """Rich progress: one bar over the rounds, with the current round's figures."""

    def __init__(self, console: Console, rounds: int) -> None:
        self.console = console
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total} rounds"),
            TextColumn("peers {task.fields[done]}"),
            TextColumn("acc {task.fields[acc]}"),
            TextColumn("sent {task.fields[sent]}"),
            TextColumn("dedup saved {task.fields[saved]}"),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        )
        self.task = self.progress.add_task(
            "training", total=rounds, done="-", acc="-", sent="-", saved="-"
        )

    def update(self, **fields: Any) -> None:
        self.progress.update(self.task, **fields)

    def round_done(self, r: RoundReport, total_rounds: int) -> None:
        self.progress.advance(self.task)
        mark = "[green]✓[/green]" if r.ok else "[red]✗[/red]"
        self.console.print(
            f"{mark} round {r.round:>2}/{total_rounds}  acc {r.accuracy:.3f}  "
            f"peers {r.contributors}/{r.expected}  sent {_fmt_bytes(r.sent_bytes)}  "
            f"fetched {_fmt_bytes(r.pulled_bytes)}  dedup saved {_fmt_bytes(r.saved_bytes)}  "
            f"{r.seconds:.1f}s  {r.outcome}"
        )

    def note(self, text: str) -> None:
        self.console.print(text)


def _peer_args(cfg: DemoConfig, coordinator: str) -> list[str]:
    args = [
        "--peers",
        str(cfg.peers),
        "--seed",
        str(cfg.seed),
        "--local-epochs",
        str(cfg.local_epochs),
        "--topology",
        cfg.topology,
        "--compression",
        cfg.compression,
        "--aggregator",
        cfg.aggregator,
    ]
    if coordinator:
        args += ["--coordinator", coordinator]
    if cfg.freeze_first_layer:
        args.append("--freeze-first-layer")
    if cfg.max_fragment_bytes is not None:
        args += ["--max-fragment-bytes", str(cfg.max_fragment_bytes)]
    return args


async def _wait_ready(fleet: Fleet) -> None:
    waiting = {p.index for p in fleet.peers}
    deadline = time.monotonic() + READY_TIMEOUT_S
    while waiting:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            names = ", ".join(f"peer-{i}" for i in sorted(waiting))
            raise DemoError(f"peers not ready after {READY_TIMEOUT_S:.0f}s: {names}")
        try:
            index, event = await asyncio.wait_for(fleet.events.get(), remaining)
        except TimeoutError:
            continue
        kind = event.get("event")
        if kind == "ready":
            fleet.peers[index].ready = event
            waiting.discard(index)
        elif kind == "error":
            raise DemoError(str(event.get("message")))
        elif kind == "exit":
            log = fleet.out / f"peer-{index}.log"
            tail = log.read_text(errors="replace").strip().splitlines()[-3:]
            raise DemoError(f"peer-{index} exited before it was ready: " + " | ".join(tail))


async def _collect_round(
    fleet: Fleet, ui: _Ui, report: RoundReport, waiting: set[int], timeout: float
) -> list[dict[str, Any]]:
    """The ``round`` events of the peers in ``waiting`` (a peer that exits is dropped)."""
    results: list[dict[str, Any]] = []
    done = 0
    deadline = time.monotonic() + timeout
    ui.update(done=f"0/{len(waiting)}")
    while waiting:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DemoError(f"round {report.round}: no report from {sorted(waiting)} in time")
        try:
            index, event = await asyncio.wait_for(fleet.events.get(), remaining)
        except TimeoutError:
            continue
        kind = event.get("event")
        if index not in waiting:
            continue
        if kind == "submitted":
            done += 1
            ui.update(done=f"{done}/{len(waiting) + len(results)}")
        elif kind == "round":
            results.append(event)
            waiting.discard(index)
            accs = [float(e["accuracy"]) for e in results]
            ui.update(
                acc=f"{sum(accs) / len(accs):.3f}",
                sent=_fmt_bytes(sum(int(e.get("sent_bytes", 0)) for e in results)),
                saved=_fmt_bytes(
                    sum(
                        int(e.get("saved_bytes", 0)) + int(e.get("pull_saved_bytes", 0))
                        for e in results
                    )
                ),
            )
        elif kind in ("exit", "error"):
            peer = fleet.peers[index]
            peer.alive = False
            waiting.discard(index)
            why = event.get("message") or "exited"
            ui.note(f"[yellow]peer-{index} left during round {report.round}: {why}[/yellow]")
    return results


async def _star_outcome(client: Any, initiator: str, report: RoundReport) -> None:
    status = await client.server_status()
    for row in status.rounds:
        if row.round == report.round and row.initiator == initiator:
            status = row.status.to_status()  # a RoundStatus
            if status.name == "Complete":
                report.ok = True
                report.aggregate = str(status.cid)
                if row.received >= row.expected:
                    report.outcome = f"complete: all {row.expected} peers"
                    report.how = "all peers"
                else:
                    report.outcome = (
                        f"complete at the deadline by quorum: {row.received} of "
                        f"{row.expected} peers (quorum {row.quorum})"
                    )
                    report.how = f"deadline, quorum {row.received}/{row.expected}"
            else:
                report.ok = False
                report.outcome = f"failed: {getattr(status, 'reason', status.name)}"
                report.how = "failed"
            return
    report.outcome = report.how = "unknown to the coordinator"


def _summarise(report: RoundReport, results: list[dict[str, Any]]) -> None:
    if not results:
        report.ok = False
        report.outcome = report.how = "no peer reported"
        return
    accs = [float(e["accuracy"]) for e in results]
    report.reported = len(results)
    report.accuracy = sum(accs) / len(accs)
    report.min_accuracy = min(accs)
    report.sent_bytes = sum(int(e.get("sent_bytes", 0)) for e in results)
    report.dense_bytes = sum(int(e.get("dense_bytes", 0)) for e in results)
    report.pulled_bytes = sum(int(e.get("pulled_bytes", 0)) for e in results)
    report.saved_bytes = sum(
        int(e.get("saved_bytes", 0)) + int(e.get("pull_saved_bytes", 0)) for e in results
    )
    report.contributors = max(int(e.get("contributors", 0)) for e in results)


async def run_demo(cfg: DemoConfig, console: Console | None = None) -> DemoReport:
    """Run the whole demo; the report (also in ``cfg.out/summary.json``)."""
    console = console or Console()
    if cfg.topology == "p2p" and cfg.compression != "none":
        raise DemoError("--compression applies to the star topology (DWE fragments are float32)")
    if cfg.topology != "p2p" and cfg.max_fragment_bytes is not None:
        raise DemoError("--max-fragment-bytes applies to the p2p topology (DWE fragments)")
    if cfg.aggregator in ("krum", "multi_krum") and cfg.peers < 3:
        raise DemoError(f"{cfg.aggregator} needs at least 3 peers")
    cfg.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    tmp: tempfile.TemporaryDirectory[str] | None = None
    fleet = Fleet(cfg.out)
    client: Any = None
    try:
        coordinator = ""
        coordinator_at: tuple[str, int] | None = None
        if cfg.topology == "star":
            if cfg.data is None:
                tmp = tempfile.TemporaryDirectory(prefix="tensorswap-demo-")
                data = Path(tmp.name)
            else:
                data = cfg.data
                data.mkdir(parents=True, exist_ok=True)
            coordinator_at = host, port = await fleet.start_coordinator(data)
            coordinator = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            console.print(f"coordinator listening on {coordinator} (data in {data})")
        args = _peer_args(cfg, coordinator)
        for i in range(cfg.peers):
            await fleet.start_peer(i, args)
        console.print(
            f"started {cfg.peers} peers ({cfg.topology}, {cfg.aggregator}, compression "
            f"{cfg.compression}, {cfg.local_epochs} local epochs); loading data and models..."
        )
        await _wait_ready(fleet)
        initial = sum(float(p.ready["accuracy"]) for p in fleet.peers if p.ready) / cfg.peers
        sizes = ", ".join(f"{p.name}: {p.ready['samples']}" for p in fleet.peers if p.ready)
        console.print(f"shards (non-IID digits): {sizes}; initial test accuracy {initial:.3f}")
        report = DemoReport(_config_json(cfg), initial)

        if cfg.topology == "p2p":
            endpoints = {p.name: str(p.ready["listen"]) for p in fleet.peers if p.ready}
            for peer in fleet.peers:
                await fleet.send(peer, {"cmd": "peers", "endpoints": endpoints})
        else:
            from tensorswap.rounds.client import RoundClient

            assert coordinator_at is not None  # set above for the star topology
            client = await RoundClient.connect(*coordinator_at, peer="demo-driver")

        initiator = f"demo-{secrets.token_hex(3)}"
        ui = _Ui(console, cfg.rounds)
        with ui.progress:
            for number in range(1, cfg.rounds + 1):
                report.rounds.append(await _one_round(cfg, fleet, ui, client, initiator, number))
        report.seconds = time.perf_counter() - start
        if client is not None:
            status = await client.server_status()
            report.coordinator = {
                "rounds": [_row_json(row) for row in status.rounds if row.initiator == initiator],
                "stats": dict(status.stats),
            }
        return _finish(cfg, report, console)
    finally:
        if client is not None:
            with contextlib.suppress(Exception):
                await client.aclose()
        await fleet.aclose()
        if tmp is not None:
            tmp.cleanup()


async def _one_round(
    cfg: DemoConfig, fleet: Fleet, ui: _Ui, client: Any, initiator: str, number: int
) -> RoundReport:
    alive = [p for p in fleet.peers if p.alive]
    if not alive:
        raise DemoError(f"round {number}: no peer left")
    report = RoundReport(round=number, expected=len(alive))
    ui.progress.update(ui.task, description=f"round {number}")
    t0 = time.perf_counter()
    victim = alive[-1] if cfg.kill_peer == number and len(alive) > 1 else None
    command: dict[str, Any] = {
        "cmd": "round",
        "round": number,
        "initiator": initiator,
        "deadline_s": cfg.deadline_s,
        "expect": [p.name for p in alive],
    }
    if client is not None:
        from tensorswap.rounds import RoundId, RoundSpec

        spec = RoundSpec(
            expected_peers=len(alive),
            quorum=cfg.round_quorum(len(alive)),
            timeout_s=cfg.deadline_s,
            strategy=cfg.aggregator,
        )
        await client.start_round(RoundId(number, initiator), spec)
    for peer in alive:
        if peer is not victim:
            await fleet.send(peer, command)
    if victim is not None:
        # Killed while the round is open, before it could submit: the others wait for it
        # until the deadline.
        await fleet.kill(victim)
        report.killed = victim.name
        ui.note(
            f"[yellow]killed {victim.name} (pid {victim.proc.pid}) during round {number}; "
            f"the round now needs its deadline ({cfg.deadline_s:g}s)[/yellow]"
        )
    waiting = {p.index for p in alive if p is not victim}
    results = await _collect_round(fleet, ui, report, waiting, cfg.deadline_s + 180.0)
    _summarise(report, results)
    if client is not None:
        await _star_outcome(client, initiator, report)
    elif results:
        got = [int(e.get("contributors", 0)) for e in results]
        late = any(bool(e.get("timed_out")) for e in results)
        if late:
            report.outcome = (
                f"deadline: averaged {min(got)} of {len(alive)} peers' deltas "
                f"(after {cfg.deadline_s:g}s)"
            )
            report.how = f"deadline, {min(got)}/{len(alive)} deltas"
        else:
            report.outcome = f"complete: all {len(alive)} peers' deltas"
            report.how = "all peers"
    report.seconds = time.perf_counter() - t0
    ui.round_done(report, cfg.rounds)
    return report


def _config_json(cfg: DemoConfig) -> dict[str, Any]:
    data = asdict(cfg)
    data["out"] = str(cfg.out)
    data["data"] = None if cfg.data is None else str(cfg.data)
    return data


def _row_json(row: Any) -> dict[str, Any]:
    return {
        "round": row.round,
        "initiator": row.initiator,
        "status": row.status.to_dict(),
        "received": row.received,
        "expected": row.expected,
        "quorum": row.quorum,
        "strategy": row.strategy,
        "nbytes": row.nbytes,
        "peers": list(row.peers),
    }


# ── the end: table, plot, summary ────────────────────────────────────────────
def _finish(cfg: DemoConfig, report: DemoReport, console: Console) -> DemoReport:
    out = cfg.out
    plot = out / "demo.png"
    plot_report(report, plot)
    report.plot = str(plot)
    summary = out / "summary.json"
    report.summary = str(summary)
    summary.write_text(json.dumps(report.to_json(), indent=2) + "\n")

    table = Table(title=f"tensorswap demo: {cfg.peers} peers, {cfg.topology}, {cfg.aggregator}")
    table.add_column("round", justify="right")
    table.add_column("peers", justify="right")
    table.add_column("accuracy", justify="right")
    table.add_column("sent", justify="right")
    if cfg.compression != "none":
        table.add_column("dense", justify="right")
    table.add_column("fetched", justify="right")
    table.add_column("dedup saved", justify="right")
    table.add_column("s", justify="right")
    table.add_column("outcome")
    for r in report.rounds:
        row = [
            str(r.round),
            f"{r.contributors}/{r.expected}",
            f"{r.accuracy:.3f}",
            _fmt_bytes(r.sent_bytes),
        ]
        if cfg.compression != "none":
            row.append(_fmt_bytes(r.dense_bytes))
        row += [
            _fmt_bytes(r.pulled_bytes),
            _fmt_bytes(r.saved_bytes),
            f"{r.seconds:.1f}",
            (f"{r.killed} killed; " if r.killed else "") + r.how,
        ]
        table.add_row(*row)
    console.print(table)
    sent = sum(r.sent_bytes for r in report.rounds)
    saved = sum(r.saved_bytes for r in report.rounds)
    console.print(
        f"test accuracy {report.initial_accuracy:.3f} -> [bold]{report.final_accuracy:.3f}"
        f"[/bold] in {len(report.rounds)} rounds, {report.seconds:.1f}s; "
        f"sent {_fmt_bytes(sent)}, dedup saved {_fmt_bytes(saved)}"
    )
    console.print(f"plot: {plot}")
    console.print(f"summary: {summary}")
    return report


def plot_report(report: DemoReport, path: Path) -> None:
    """Accuracy and bytes per round as a PNG (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rounds = [r.round for r in report.rounds]
    fig, (ax_acc, ax_bytes) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    try:
        ax_acc.plot(
            [0, *rounds],
            [report.initial_accuracy, *(r.accuracy for r in report.rounds)],
            marker="o",
            label="global model (mean over peers)",
        )
        ax_acc.set_ylabel("test accuracy")
        ax_acc.set_ylim(0, 1)
        ax_acc.grid(alpha=0.3)
        width = 0.4
        kib = 1024.0
        ax_bytes.bar(
            [x - width / 2 for x in rounds],
            [r.sent_bytes / kib for r in report.rounds],
            width,
            label="sent by peers",
        )
        ax_bytes.bar(
            [x + width / 2 for x in rounds],
            [r.saved_bytes / kib for r in report.rounds],
            width,
            label="saved by dedup",
        )
        if any(r.pulled_bytes for r in report.rounds):
            ax_bytes.plot(
                rounds,
                [r.pulled_bytes / kib for r in report.rounds],
                marker="s",
                color="gray",
                label="fetched by peers",
            )
        ax_bytes.set_ylabel("KiB per round")
        ax_bytes.set_xlabel("round")
        ax_bytes.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax_bytes.grid(alpha=0.3)
        for r in report.rounds:
            if r.killed:
                for ax in (ax_acc, ax_bytes):
                    ax.axvline(r.round, color="red", linestyle="--", alpha=0.6)
                ax_acc.annotate(
                    f" {r.killed} killed", (r.round, 0.97), color="red", ha="left", va="top"
                )
        ax_acc.legend(loc="lower right")
        # headroom above the bars, so the legend never covers the last rounds
        low, high = ax_bytes.get_ylim()
        ax_bytes.set_ylim(low, high * 1.3)
        ax_bytes.legend(loc="upper center", ncol=3, frameon=False)
        cfg = report.config
        fig.suptitle(
            f"tensorswap demo: {cfg['peers']} peers, {cfg['topology']}, {cfg['aggregator']}, "
            f"compression {cfg['compression']}"
        )
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
