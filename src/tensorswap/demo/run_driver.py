"""The driver's side of a federated demo run (`--mode`, `--server-opt`, `--sample`, `--slow-peer`).

Instead of opening one round after another, the driver creates a run on the coordinator
(`RunClient.create_run`: the initial model, the sampling, the server optimizer, sync or
async) and tells each peer once to work through it (``{"cmd": "run"}``); the peers then
long-poll for their tasks by themselves. The driver follows the run's versions as the
coordinator makes them (a long-polled ``versions`` request), fetches each new global model,
evaluates it on the test split, and records per version its participants, their staleness,
the accuracy and the wall-clock time since the run started.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tensorswap.demo.config import DemoConfig, DemoError
from tensorswap.demo.output import ProgressUi, fmt_bytes
from tensorswap.demo.report import DemoReport

if TYPE_CHECKING:
    from tensorswap.demo.driver import _Run

__all__ = ["VersionReport", "run_federation", "run_spec"]

#: How long one ``versions`` request waits for the next version before asking again.
FOLLOW_WAIT_S = 30.0


@dataclass
class VersionReport:
    """One version of the run's global model, as the driver saw it."""

    version: int
    round: int
    participants: list[str]
    staleness: list[int]
    accuracy: float
    elapsed_s: float
    global_cid: str
    epsilon: float | None = None
    killed: str | None = None
    hidden: int | None = None
    """A DP run: how many peers made the version (their names are hidden, ``runs.views``)."""


@dataclass
class _Follow:
    """What the peers reported while the driver followed the run."""

    contributed: int = 0
    refused: int = 0
    sent_bytes: int = 0
    pulled_bytes: int = 0
    killed: str | None = None  # the peer killed since the last version was recorded
    kill_done: bool = False
    notes: list[str] = field(default_factory=list)


def run_spec(cfg: DemoConfig) -> Any:
    """The run the demo creates from its options."""
    from tensorswap.runs import RunMode, RunSpec

    if cfg.run_mode == "async":
        return RunSpec(
            mode=RunMode.ASYNC,
            strategy=cfg.aggregator,
            optimizer=cfg.server_opt or "fedavg",
            seed=cfg.seed,
            rounds=cfg.rounds,
            buffer=cfg.run_buffer(),
            max_staleness=cfg.max_staleness,
            round_timeout_s=None,
        )
    sampled = cfg.sample or cfg.peers
    if cfg.quorum is not None:
        quorum = min(cfg.quorum, sampled) / sampled
    elif cfg.kill_peer is not None and sampled > 1:
        quorum = (sampled - 1) / sampled
    else:
        quorum = 1.0
    return RunSpec(
        mode=RunMode.SYNC,
        per_round=cfg.sample,
        # wait for every peer to register before round 1 (one fewer with --kill-peer, so
        # the rounds after the kill still start)
        min_clients=max(1, min(sampled, cfg.peers - (1 if cfg.kill_peer else 0))),
        quorum=quorum,
        round_timeout_s=cfg.deadline_s,
        strategy=cfg.aggregator,
        optimizer=cfg.server_opt or "fedavg",
        seed=cfg.seed,
        rounds=cfg.rounds,
        **_dp_options(cfg),
    )


def _dp_options(cfg: DemoConfig) -> dict[str, Any]:
    """The run's privacy options: DP-FedAvg (clipped on the peers when the run is also
    secure: the coordinator never sees one delta) and SecAgg+."""
    options: dict[str, Any] = {}
    if cfg.secagg:
        options.update(secagg=True, secagg_threshold=cfg.secagg_threshold)
    if cfg.dp_clip is not None:
        options.update(
            dp_clip=cfg.dp_clip,
            dp_noise=cfg.dp_noise,
            dp_delta=cfg.dp_delta,
            dp_max_epsilon=cfg.dp_max_epsilon,
            dp_clipping="client" if cfg.secagg else "server",
        )
    return options


class _Evaluator:
    """The driver's copy of the model, to evaluate each global version on the test split."""

    def __init__(self, cfg: DemoConfig) -> None:
        import torch

        from tensorswap.demo.task import load_dataset, make_model

        torch.set_num_threads(1)
        data = load_dataset(cfg.peers, seed=cfg.seed)
        self.test_x, self.test_y = data.test_x, data.test_y
        self.model = make_model(cfg.seed)

    def initial(self) -> dict[str, Any]:
        from tensorswap.torch import tensors_of

        return {k: v.copy() for k, v in tensors_of(self.model).items()}

    def accuracy(self, tensors: dict[str, Any]) -> float:
        from tensorswap.demo.task import evaluate
        from tensorswap.torch import load_tensors

        load_tensors(self.model, tensors)
        return evaluate(self.model, self.test_x, self.test_y)


async def run_federation(run: _Run, report: DemoReport) -> None:
    """Create the run, start the peers on it, follow it to its last version."""
    from tensorswap.runs.client import RunClient
    from tensorswap.store import ModelUpdate

    cfg = run.cfg
    evaluator = await asyncio.to_thread(_Evaluator, cfg)
    client = RunClient(run.client)
    name = run.initiator
    spec = run_spec(cfg)
    await client.create_run(name, spec, ModelUpdate(evaluator.initial()))
    run.console.print(
        f"run {name}: {spec.mode}, server optimizer {spec.optimizer}, "
        + (
            f"buffer {spec.buffer}, max staleness {spec.max_staleness}"
            if cfg.run_mode == "async"
            else f"{cfg.sample or cfg.peers} of {cfg.peers} peers per round"
        )
        + (
            f"; peer-{cfg.slow_peer} trains {cfg.slow_factor:g}x slower"
            if cfg.slow_peer is not None
            else ""
        )
        + (
            f"; DP: clip {cfg.dp_clip:g}, noise multiplier {cfg.dp_noise:g}, "
            f"delta {cfg.dp_delta:g}"
            + (f", max epsilon {cfg.dp_max_epsilon:g}" if cfg.dp_max_epsilon else "")
            if cfg.dp_clip is not None
            else ""
        )
        + ("; secure aggregation (SecAgg+)" if cfg.secagg else "")
    )
    for peer in run.fleet.peers:
        await run.fleet.send(peer, {"cmd": "run", "run": name})
    start = time.perf_counter()
    follow = _Follow()
    ui = ProgressUi(run.console, cfg.rounds, unit="versions")
    with ui.progress:
        watcher = asyncio.create_task(_watch_peers(run, ui, follow))
        try:
            await _follow_versions(run, client, evaluator, report, ui, follow, start)
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
    report.run = {
        "name": name,
        "spec": spec.to_json(),
        "contributed": follow.contributed,
        "refused": follow.refused,
        "sent_bytes": follow.sent_bytes,
        "pulled_bytes": follow.pulled_bytes,
    }
    for note in follow.notes:
        run.console.print(note)


async def _follow_versions(
    run: _Run,
    client: Any,
    evaluator: _Evaluator,
    report: DemoReport,
    ui: ProgressUi,
    follow: _Follow,
    start: float,
) -> None:
    from tensorswap.cid import Cid

    cfg, name = run.cfg, run.initiator
    since = 1
    while since <= cfg.rounds:
        rows = await client.versions(name, since, wait=FOLLOW_WAIT_S)
        if not rows:
            info = await client.run(name)
            if info.finished:
                if info.stop_reason:
                    follow.notes.append(f"run {name} stopped: {info.stop_reason}")
                break
            if not any(p.alive for p in run.fleet.peers):
                raise DemoError(f"run {name}: every peer has left at version {since - 1}")
            continue
        for row in rows:
            model = await client.rounds.fetch(Cid.parse(row.global_cid))
            accuracy = await asyncio.to_thread(evaluator.accuracy, dict(model.tensors))
            entry = VersionReport(
                version=row.version,
                round=row.round,
                participants=list(row.participants),
                staleness=list(row.staleness),
                accuracy=accuracy,
                elapsed_s=time.perf_counter() - start,
                global_cid=row.global_cid,
                epsilon=row.epsilon,
                hidden=row.participant_count if row.hidden else None,
            )
            if follow.killed is not None:
                entry.killed, follow.killed = follow.killed, None
            report.versions.append(entry)
            ui.version_done(entry, cfg.rounds, mode=cfg.run_mode)
            since = row.version + 1


async def _watch_peers(run: _Run, ui: ProgressUi, follow: _Follow) -> None:
    """The peers' reports while the run goes: progress figures, refusals, the kill."""
    cfg, fleet = run.cfg, run.fleet
    while True:
        index, event = await fleet.events.get()
        peer = fleet.peers[index]
        kind = event.get("event")
        if kind == "task" and cfg.kill_peer is not None and cfg.kill_peer == event.get("round"):
            if peer.alive and sum(p.alive for p in fleet.peers) > 1 and not follow.kill_done:
                # Killed as it starts its task of that round (before it could submit): the
                # round then ends at its deadline, by quorum.
                await fleet.kill(peer)
                follow.killed, follow.kill_done = peer.name, True
                follow.notes.append(
                    f"killed {peer.name} during round {cfg.kill_peer}; that round completed "
                    f"at its deadline ({cfg.deadline_s:g}s) by quorum"
                )
                ui.note(
                    f"[yellow]killed {peer.name} (pid {peer.proc.pid}) during round "
                    f"{cfg.kill_peer}[/yellow]"
                )
        elif kind == "contributed":
            follow.contributed += 1
            follow.sent_bytes += int(event.get("sent_bytes", 0))
            follow.pulled_bytes += int(event.get("pulled_bytes", 0))
            ui.update(done=str(follow.contributed), sent=fmt_bytes(follow.sent_bytes))
        elif kind == "refused":
            follow.refused += 1
            ui.note(f"[yellow]{peer.name}: {event.get('reason')}[/yellow]")
        elif kind in ("exit", "error") and peer.alive:
            peer.alive = False
            ui.note(f"[yellow]{peer.name} left: {event.get('message') or 'exited'}[/yellow]")
