"""The driver of a simulation: coordinator, workers, the run, round after round.

It starts the coordinator, then the workers (each registers its virtual clients under their
own names), creates a sync run (``per_round`` of the registered clients sampled each round,
``rounds`` rounds), and for each round reads the sample from the run, hands each worker its
sampled clients, waits for the run's new version, fetches it and evaluates it. A round's
time runs from the previous version's evaluation to this one's (sampling, training,
submitting, aggregating, evaluating). Every process is stopped and reaped at the end, also
when anything fails.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from tensorswap.simulate.backends import gather_or_cancel, make_backend
from tensorswap.simulate.config import SimConfig
from tensorswap.simulate.coordinator import Coordinator
from tensorswap.simulate.errors import SimulationError
from tensorswap.simulate.memory import PeakMemory
from tensorswap.simulate.task import make_task
from tensorswap.simulate.worker import client_name

__all__ = ["RUN_NAME", "RoundRow", "SimResult", "partition", "run_simulation"]

RUN_NAME = "simulation"
POLL_S = 0.005


@dataclass
class RoundRow:
    """One round as the driver saw it."""

    round: int
    participants: list[str]
    metric: float
    train_loss: float | None
    seconds: float
    work_s: float
    sent_bytes: int
    received_bytes: int

    @property
    def bytes(self) -> int:
        return self.sent_bytes + self.received_bytes


@dataclass
class SimResult:
    config: dict[str, Any]
    metric: str
    rounds: list[RoundRow] = field(default_factory=list)
    setup_s: float = 0.0
    total_s: float = 0.0
    peak_memory_bytes: int = 0
    peak_processes: int = 0
    coordinator: str = ""

    @property
    def mean_round_s(self) -> float:
        return sum(r.seconds for r in self.rounds) / len(self.rounds) if self.rounds else 0.0

    def to_json(self) -> dict[str, Any]:
        rows = []
        for r in self.rounds:
            row = asdict(r)
            row[self.metric] = row.pop("metric")
            row["participants_count"] = len(r.participants)
            row["bytes"] = r.bytes
            rows.append(row)
        return {
            "config": self.config,
            "metric": self.metric,
            "rounds": rows,
            "setup_s": self.setup_s,
            "total_s": self.total_s,
            "mean_round_s": self.mean_round_s,
            "peak_memory_bytes": self.peak_memory_bytes,
            "peak_memory_mib": self.peak_memory_bytes / 2**20,
            "peak_processes": self.peak_processes,
            "memory_scope": "summed RSS of the driver, the coordinator, the workers and any "
            "local Ray processes (every descendant of the driver)",
            "coordinator": self.coordinator,
        }


def partition(clients: int, workers: int) -> list[list[int]]:
    """Client indices per worker: contiguous, sizes differing by at most one."""
    base, extra = divmod(clients, workers)
    out, at = [], 0
    for w in range(workers):
        size = base + (1 if w < extra else 0)
        out.append(list(range(at, at + size)))
        at += size
    return out


Listener = Callable[[str, Any], None]


def _round_row(
    r: int,
    participants: list[str],
    metric: float,
    reports: list[dict[str, Any]],
    by_worker: dict[int, list[int]],
    seconds: float,
) -> RoundRow:
    """Round ``r`` as the summary lists it, from the workers' reports (its training loss
    weighted by the clients each worker ran), ``seconds`` after the round before."""
    losses = [rep["train_loss"] for rep in reports if rep.get("train_loss") is not None]
    counts = [len(idx) for idx in by_worker.values()]
    return RoundRow(
        round=r,
        participants=participants,
        metric=metric,
        train_loss=(
            sum(loss * n for loss, n in zip(losses, counts, strict=False)) / sum(counts)
            if losses
            else None
        ),
        seconds=seconds,
        work_s=max(float(rep.get("seconds", 0.0)) for rep in reports),
        sent_bytes=sum(int(rep.get("sent_bytes", 0)) for rep in reports),
        received_bytes=sum(int(rep.get("received_bytes", 0)) for rep in reports),
    )


async def run_simulation(cfg: SimConfig, on_event: Listener | None = None) -> SimResult:
    """Run ``cfg`` to its last round; ``on_event(kind, data)`` hears ``ready`` (the worker
    reports), ``round`` (a RoundRow) as they happen."""
    from tensorswap.cid import Cid
    from tensorswap.runs.client import RunClient
    from tensorswap.store import ModelUpdate

    notify = on_event or (lambda kind, data: None)
    cfg.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    task = await asyncio.to_thread(make_task, cfg.task_spec())
    result = SimResult(cfg.to_json(), task.metric)
    memory = PeakMemory().start()
    coordinator = Coordinator(cfg.out, cfg.listen, cfg.data, cfg.keep_rounds)
    backend = make_backend(cfg.backend, cfg.out, cfg.round_timeout_s, cfg.ray_address)
    client: RunClient | None = None
    try:
        host, port = await coordinator.start()
        result.coordinator = f"{host}:{port}"
        client = await RunClient.connect(host, port, peer="simulate-driver")
        shares = partition(cfg.clients, cfg.resolved_workers)
        owner = {i: w for w, share in enumerate(shares) for i in share}
        specs = [
            {
                "host": cfg.advertise or host,
                "port": port,
                "clients": share,
                "task": cfg.task_spec(),
                "connections": cfg.connections,
                "chunk": cfg.chunk,
            }
            for share in shares
        ]
        notify("ready", await backend.start(specs))
        memory.extra = tuple(backend.pids())
        spec = cfg.run_spec()
        await client.create_run(RUN_NAME, spec, ModelUpdate(task.initial()))
        result.setup_s = time.perf_counter() - started
        previous = time.perf_counter()
        for r in range(1, cfg.rounds + 1):
            info = await _round_started(client, r, cfg.round_timeout_s, coordinator)
            by_worker: dict[int, list[int]] = {}
            for peer in info.selected:
                index = _index_of(peer)
                by_worker.setdefault(owner[index], []).append(index)
            cmd = {"run": RUN_NAME, "round": r, "global_cid": info.global_cid}
            reports = await gather_or_cancel(
                backend.round(w, {**cmd, "clients": idx}) for w, idx in by_worker.items()
            )
            refused = [e for rep in reports for e in rep.get("errors", [])]
            if refused:
                raise SimulationError(f"round {r}: the coordinator refused {refused[:3]}")
            row = await _version(client, r, cfg.round_timeout_s, coordinator)
            model = await client.rounds.fetch(Cid.parse(row.global_cid))
            metric = await asyncio.to_thread(task.evaluate, dict(model.tensors))
            for block in list(client.rounds.store):
                client.rounds.store.delete(block)
            now = time.perf_counter()
            participants = list(row.participants)
            done = _round_row(r, participants, metric, reports, by_worker, now - previous)
            previous = now
            result.rounds.append(done)
            notify("round", done)
    finally:
        try:
            if client is not None:
                await client.aclose()
            await backend.aclose()
        finally:
            await coordinator.aclose()
            memory.stop()
    result.total_s = time.perf_counter() - started
    result.peak_memory_bytes, result.peak_processes = memory.peak_bytes, memory.peak_processes
    return result


def _index_of(peer: str) -> int:
    prefix = client_name(0)[:-6]
    if not peer.startswith(prefix) or not peer[len(prefix) :].isdigit():
        raise SimulationError(f"the run sampled {peer!r}, not one of the simulated clients")
    return int(peer[len(prefix) :])


async def _round_started(client: Any, r: int, timeout: float, coordinator: Coordinator) -> Any:
    """The run once round ``r`` has started (its sample drawn)."""
    deadline = time.monotonic() + timeout
    while True:
        info = await client.run(RUN_NAME)
        if info.round >= r and info.selected:
            if info.round > r:
                raise SimulationError(f"the run is at round {info.round}, expected {r}")
            return info
        if info.finished:
            raise SimulationError(f"the run finished before round {r}: {info.stop_reason}")
        _check(coordinator, deadline, f"round {r} to start")
        await asyncio.sleep(POLL_S)


async def _version(client: Any, r: int, timeout: float, coordinator: Coordinator) -> Any:
    """The run's version made by round ``r``."""
    deadline = time.monotonic() + timeout
    while True:
        wait = max(0.0, min(30.0, deadline - time.monotonic()))
        for row in await client.versions(RUN_NAME, r, wait=wait):
            if row.round == r:
                return row
        _check(coordinator, deadline, f"round {r}'s new version")


def _check(coordinator: Coordinator, deadline: float, what: str) -> None:
    if not coordinator.alive():
        raise SimulationError(f"the coordinator exited while waiting for {what}")
    if time.monotonic() > deadline:
        raise SimulationError(f"timed out waiting for {what}")
