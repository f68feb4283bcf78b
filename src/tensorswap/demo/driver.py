"""The driver of `tensorswap demo`: a coordinator process, N peer processes, R rounds.

It starts a local coordinator (`tensorswap serve` on 127.0.0.1, port 0, data in a temporary
directory) for the star topology (for diloco: the collective's rendezvous), spawns the peers
(`python -m tensorswap.demo.peer`), sends them one command per round on stdin and reads their
JSON-line reports from stdout. It shows progress with rich, and at the end writes
`summary.json` and a plot `demo.png` (accuracy and bytes per round) into the output directory.
Every process it started is stopped and reaped when it returns, fails or is interrupted.

`run_demo` runs one phase after another (coordinator, peers, ready, link, rounds, record,
finish), each its own function over the run's `_Run`. The rest lives next door: the options in
`demo.config`, the processes in `demo.fleet`, the records in `demo.report`, the progress,
table and plot in `demo.output`, DiLoCo's outer steps (``--topology diloco``) in `demo.diloco`.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from tensorswap.demo.config import DemoConfig, DemoError, check_config, config_json
from tensorswap.demo.fleet import READY_TIMEOUT_S as READY_TIMEOUT_S
from tensorswap.demo.fleet import STOP_TIMEOUT_S as STOP_TIMEOUT_S
from tensorswap.demo.fleet import Fleet, wait_ready
from tensorswap.demo.fleet import Peer as Peer
from tensorswap.demo.output import ProgressUi, finish, fmt_bytes, plot_report
from tensorswap.demo.report import DemoReport, RoundReport, row_json, summarise

__all__ = [
    "DemoConfig",
    "DemoError",
    "DemoReport",
    "RoundReport",
    "check_config",
    "plot_report",
    "run_demo",
]

SWARM_RESULT_CHUNK = "4KiB"
"""``--swarm``: the coordinator's ``--result-chunk`` (the demo's 38 KiB model in ~10 chunks)."""
_LOCAL = "127.0.0.1"


@dataclass
class _Run:
    """One demo run's moving parts; `run_demo` owns it and `_close` releases all of it."""

    cfg: DemoConfig
    console: Console
    fleet: Fleet
    tmp: tempfile.TemporaryDirectory[str] | None = None
    coordinator: str = ""  # HOST:PORT for the peers (star), "" for p2p
    coordinator_at: tuple[str, int] | None = None
    client: Any = None  # the driver's RoundClient (star)
    initiator: str = ""  # names this run's rounds on the coordinator
    placement: Any = None  # --netlab: the hosts of the processes (`demo.netlab.Placement`)


async def run_demo(
    cfg: DemoConfig, console: Console | None = None, placement: Any = None
) -> DemoReport:
    """Run the whole demo; the report (also in ``cfg.out/summary.json``). ``placement``
    (`demo.netlab.Placement`) puts the processes on the hosts of a network lab
    (`demo.netlab.run_in_lab` builds it for ``--netlab``)."""
    console = console or Console()
    check_config(cfg)
    cfg.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    run = _Run(cfg, console, Fleet(cfg.out), placement=placement)
    try:
        if cfg.topology in ("star", "diloco"):
            await _start_coordinator(run)
        await _start_peers(run)
        report = await _await_ready(run)
        await _link(run)
        show = finish
        if cfg.federated:
            from tensorswap.demo.run_driver import run_federation

            run.initiator = f"demo-{secrets.token_hex(3)}"
            await run_federation(run, report)
        elif cfg.topology == "diloco":
            from tensorswap.demo.diloco import finish_diloco, run_diloco

            await run_diloco(cfg, run.fleet, console, report)
            show = finish_diloco
        else:
            await _run_rounds(run, report)
        report.seconds = time.perf_counter() - start
        await _record_coordinator(run, report)
        return show(cfg, report, console)
    finally:
        await _close(run)


# ── the phases, in order ─────────────────────────────────────────────────────
async def _start_coordinator(run: _Run) -> None:
    """Star (and diloco, its rendezvous): `tensorswap serve` on 127.0.0.1 over ``--data``
    (else a temporary directory)."""
    if run.cfg.data is None:
        run.tmp = tempfile.TemporaryDirectory(prefix="tensorswap-demo-")
        data = Path(run.tmp.name)
    else:
        data = run.cfg.data
        data.mkdir(parents=True, exist_ok=True)
    where = run.placement
    # --swarm: the demo's model is 38 KiB, one chunk a tensor by default: cut the aggregates
    # finer, so there are chunks for the peers to trade
    extra = ("--result-chunk", SWARM_RESULT_CHUNK) if run.cfg.swarm else ()
    if where is None:
        run.coordinator_at = host, port = await run.fleet.start_coordinator(data, extra=extra)
    else:
        run.coordinator_at = host, port = await run.fleet.start_coordinator(
            data, listen=where.coordinator_listen, wrap=where.coordinator_wrap, extra=extra
        )
    run.coordinator = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    what = "rendezvous" if run.cfg.topology == "diloco" else "coordinator"
    run.console.print(f"{what} listening on {run.coordinator} (data in {data})")


async def _start_peers(run: _Run) -> None:
    cfg, where = run.cfg, run.placement
    args = _peer_args(cfg, run.coordinator if where is None else where.peer_target)
    for i in range(cfg.peers):
        slow = ["--slow-factor", str(cfg.slow_factor)] if cfg.slow_peer == i else []
        if cfg.swarm:  # the address the others dial: its own host's in the lab
            slow += ["--swarm", "--swarm-listen", where.hosts[f"peer{i}"] if where else _LOCAL]
        wrap = () if where is None else where.peer_wraps[i]
        await run.fleet.start_peer(i, [*args, *slow], wrap)
    what = f"a {cfg.run_mode} federated run" if cfg.federated else f"compression {cfg.compression}"
    if cfg.topology == "diloco":
        run.console.print(
            f"started {cfg.peers} peers (diloco, {cfg.diloco_inner_steps} inner steps per outer "
            f"step, {what}); loading data and models..."
        )
        return
    run.console.print(
        f"started {cfg.peers} peers ({cfg.topology}, {cfg.aggregator}, {what}, "
        f"{cfg.local_epochs} local epochs); loading data and models..."
    )


async def _await_ready(run: _Run) -> DemoReport:
    """Until every peer is ready; the report, with the initial accuracy (mean over peers)."""
    fleet = run.fleet
    await wait_ready(fleet)
    initial = sum(float(p.ready["accuracy"]) for p in fleet.peers if p.ready) / run.cfg.peers
    sizes = ", ".join(f"{p.name}: {p.ready['samples']}" for p in fleet.peers if p.ready)
    run.console.print(f"shards (non-IID digits): {sizes}; initial test accuracy {initial:.3f}")
    return DemoReport(config_json(run.cfg), initial)


async def _link(run: _Run) -> None:
    """P2P: tell every peer the others' endpoints. Star: connect the driver's RoundClient.
    DiLoCo: nothing (the peers meet at the rendezvous)."""
    fleet = run.fleet
    if run.cfg.topology == "diloco":
        return
    if run.cfg.topology == "p2p":
        endpoints = {p.name: str(p.ready["listen"]) for p in fleet.peers if p.ready}
        for peer in fleet.peers:
            await fleet.send(peer, {"cmd": "peers", "endpoints": endpoints})
    else:
        from tensorswap.rounds.client import RoundClient

        assert run.coordinator_at is not None  # set by _start_coordinator (star)
        run.client = await RoundClient.connect(*run.coordinator_at, peer="demo-driver")


async def _run_rounds(run: _Run, report: DemoReport) -> None:
    run.initiator = f"demo-{secrets.token_hex(3)}"
    ui = ProgressUi(run.console, run.cfg.rounds)
    with ui.progress:
        for number in range(1, run.cfg.rounds + 1):
            report.rounds.append(await _one_round(run, ui, number))


async def _record_coordinator(run: _Run, report: DemoReport) -> None:
    """Star: the coordinator's view of this run's rounds and its counters, into the report."""
    if run.client is not None:
        status = await run.client.server_status()
        report.coordinator = {
            "rounds": [row_json(row) for row in status.rounds if row.initiator == run.initiator],
            "stats": dict(status.stats),
        }


async def _close(run: _Run) -> None:
    """Close the client, stop and reap every process, remove the temporary data directory."""
    if run.client is not None:
        with contextlib.suppress(Exception):
            await run.client.aclose()
    await run.fleet.aclose()
    if run.tmp is not None:
        run.tmp.cleanup()


# ── one round ────────────────────────────────────────────────────────────────
async def _one_round(run: _Run, ui: ProgressUi, number: int) -> RoundReport:
    cfg, fleet = run.cfg, run.fleet
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
        "initiator": run.initiator,
        "deadline_s": cfg.deadline_s,
        "expect": [p.name for p in alive],
    }
    if run.client is not None:
        await _open_round(run, number, len(alive))
    for peer in alive:
        if peer is not victim:
            await fleet.send(peer, command)
    if victim is not None:
        await _kill_during_round(run, ui, victim, report)
    waiting = {p.index for p in alive if p is not victim}
    results = await _collect_round(fleet, ui, report, waiting, cfg.deadline_s + 180.0)
    summarise(report, results)
    if run.client is not None:
        await _star_outcome(run.client, run.initiator, report)
    elif results:
        _p2p_outcome(cfg, report, results, len(alive))
    report.seconds = time.perf_counter() - t0
    ui.round_done(report, cfg.rounds)
    return report


async def _open_round(run: _Run, number: int, alive: int) -> None:
    """Star: start round ``number`` on the coordinator, expecting ``alive`` peers."""
    from tensorswap.rounds import RoundId, RoundSpec

    cfg = run.cfg
    spec = RoundSpec(
        expected_peers=alive,
        quorum=cfg.round_quorum(alive),
        timeout_s=cfg.deadline_s,
        strategy=cfg.aggregator,
    )
    await run.client.start_round(RoundId(number, run.initiator), spec)


async def _kill_during_round(run: _Run, ui: ProgressUi, victim: Peer, report: RoundReport) -> None:
    # Killed while the round is open, before it could submit: the others wait for it
    # until the deadline.
    await run.fleet.kill(victim)
    report.killed = victim.name
    ui.note(
        f"[yellow]killed {victim.name} (pid {victim.proc.pid}) during round {report.round}; "
        f"the round now needs its deadline ({run.cfg.deadline_s:g}s)[/yellow]"
    )


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
    if cfg.topology == "diloco":
        args += ["--inner-steps", str(cfg.diloco_inner_steps)]
    return args


async def _collect_round(
    fleet: Fleet, ui: ProgressUi, report: RoundReport, waiting: set[int], timeout: float
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
                sent=fmt_bytes(sum(int(e.get("sent_bytes", 0)) for e in results)),
                saved=fmt_bytes(
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
            report.participants = list(row.peers)
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


def _p2p_outcome(
    cfg: DemoConfig, report: RoundReport, results: list[dict[str, Any]], alive: int
) -> None:
    got = [int(e.get("contributors", 0)) for e in results]
    late = any(bool(e.get("timed_out")) for e in results)
    if late:
        report.outcome = (
            f"deadline: averaged {min(got)} of {alive} peers' deltas (after {cfg.deadline_s:g}s)"
        )
        report.how = f"deadline, {min(got)}/{alive} deltas"
    else:
        report.outcome = f"complete: all {alive} peers' deltas"
        report.how = "all peers"
