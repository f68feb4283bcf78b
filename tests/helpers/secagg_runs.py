"""Secure runs served in-process for tests: a coordinator, a runs manager and service on
a fake clock; peers that train a known delta; the journaled secure-round rows."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np

from tensorswap.cid import Cid
from tensorswap.rounds import Coordinator, FakeClock
from tensorswap.rounds.server import RoundServer
from tensorswap.runs import RunManager
from tensorswap.runs.client import RunClient
from tensorswap.runs.manager import Task
from tensorswap.runs.service import RunService
from tensorswap.store import get_update

KEY = b"secagg-service-key"
TIMEOUT = 30.0


def base_model() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"w": rng.standard_normal((8, 4)).astype(np.float32), "b": np.zeros(4, np.float32)}


def peer_delta(i: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(100 + i)
    return {
        "w": (rng.uniform(-0.5, 0.5, (8, 4))).astype(np.float32),
        "b": rng.uniform(-0.5, 0.5, 4).astype(np.float32),
    }


class Served:
    def __init__(self, server: RoundServer, manager: RunManager, clock: FakeClock) -> None:
        self.server, self.manager, self.clock = server, manager, clock

    async def client(self, name: str) -> RunClient:
        client = await RunClient.connect("127.0.0.1", self.server.port, peer=name, key=KEY)
        await client.register({"num_samples": 10})
        return client

    async def advance_until(
        self,
        ready: asyncio.Future[object],
        absent: set[str],
        seconds: float,
        phase: str | None = None,
    ) -> None:
        """Until ``ready``: whenever the open secure phase (``phase`` only, if given: the one
        the absent peers skip; before it they may merely be the last to answer) waits only for
        peers in ``absent`` (they will never answer), move the fake clock past its deadline."""
        while not ready.done():
            await asyncio.sleep(0.02)
            for session in self.manager.secure.sessions():
                if phase is not None and session.phase != phase:
                    continue
                waiting = session.waiting
                if waiting and waiting <= absent and session.deadline is not None:
                    self.clock.advance(seconds)


async def secure_task(client: RunClient, run: str = "fl") -> Task:
    task = await client.next_task(run, timeout=TIMEOUT)
    assert task is not None and task.secagg
    return task


async def train(client: RunClient, i: int, run: str = "fl") -> object:
    task = await secure_task(client, run)
    model = await client.fetch_model(task)
    step = peer_delta(i)
    return await client.submit(task, {k: model[k] + step[k] for k in model}, num_samples=10 + i)


def secagg_row(manager: RunManager, run: str, round: int) -> tuple[str, ...]:
    row = manager.secure.row(run, round)
    assert row is not None
    return row  # type: ignore[return-value]


async def aggregate(manager: RunManager, run: str, round: int) -> dict[str, np.ndarray]:
    info = await asyncio.to_thread(manager.wait_version, run, 1, TIMEOUT)
    assert info.version == 1
    phase, _, _, cid, _ = secagg_row(manager, run, round)
    assert phase == "done" and cid
    return dict(get_update(manager.store, Cid.parse(cid)).tensors)


@contextlib.asynccontextmanager
async def serve_secure_runs(tmp_path: Path) -> AsyncIterator[Served]:
    """A coordinator with a runs service on a fake clock, on 127.0.0.1, closed afterwards."""
    clock = FakeClock()
    coord = Coordinator.open(tmp_path, clock=clock, durable=False)
    runs = RunManager.open(coord, durable=False)
    server = RoundServer(coord, key=KEY, max_wait=30)
    RunService(runs, server)
    try:
        await server.start("127.0.0.1", 0)
        yield Served(server, runs, clock)
    finally:
        await server.aclose()
        runs.close()
        coord.close()
