"""Chaos: a ``--deterministic`` run whose coordinator is SIGKILLed at random points of its 5
rounds gives an uninterrupted run's bits (issue 25).

Four peers work concurrently (so their updates arrive in whatever order the machine makes),
each surviving the server's deaths: it reconnects to the next server and asks for its task
again (an update whose submit did not land is sent again; one that did is not asked for). A
seeded plan picks three rounds and, in each, where the server dies: as a round starts, as
some peer's contribution is recorded, or as it writes the n-th file after that (aggregate
chunks, optimizer state, the new global model). Every version's global and state CIDs
equal those of a run no server death interrupted, whose peers also raced.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from helpers.serve import SECRET, Server
from tensorswap.errors import WireError
from tensorswap.runs import RunSpec
from tensorswap.runs.client import RunClient

PEERS = ("p0", "p1", "p2", "p3")
SPEC = RunSpec(
    per_round=4,
    min_clients=4,  # every round waits for all four: who takes part never depends on timing
    rounds=5,
    seed=3,
    optimizer="fedadam",
    optimizer_params={"eta": 0.05},
    params={"deterministic": 1},
)
GONE = (OSError, EOFError, WireError)
"""What a call raises when the server dies under it."""

Versions = list[tuple[int, str, str | None]]

pytestmark = pytest.mark.slow


def _initial() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"w": rng.standard_normal((64, 64)).astype(np.float32), "b": np.zeros(64, np.float32)}


def _trained(model: dict[str, np.ndarray], peer: str, number: int) -> dict[str, np.ndarray]:
    """A peer's update, of a magnitude its own, so that sums in another order differ."""
    rng = np.random.default_rng([PEERS.index(peer), number])
    scale = np.float32(10.0 ** (PEERS.index(peer) - 2))
    return {
        k: v + scale * rng.standard_normal(v.shape).astype(np.float32) for k, v in model.items()
    }


@dataclass
class Board:
    """The port of the server now up, and its generation (one per start)."""

    port: int = 0
    generation: int = 0
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def publish(self, port: int) -> None:
        async with self.changed:
            self.port, self.generation = port, self.generation + 1
            self.changed.notify_all()

    async def after(self, generation: int) -> tuple[int, int]:
        """The first server started after ``generation``: (its generation, its port)."""
        async with self.changed:
            await self.changed.wait_for(lambda: self.generation > generation)
            return self.generation, self.port


async def _peer(name: str, board: Board) -> None:
    """One peer's whole run, across every server it meets."""
    generation = 0
    while True:
        generation, port = await board.after(generation)
        client = None
        try:
            client = await RunClient.connect("127.0.0.1", port, peer=name, key=SECRET.encode())
            await client.register({"num_samples": 10})
            while (task := await client.next_task("fl", timeout=120)) is not None:
                model = await client.fetch_model(task)
                update = _trained(model, name, task.round_id.round)
                await client.submit(task, update, num_samples=10 + PEERS.index(name))
            return
        except GONE:
            continue  # the server died: wait for the next one
        finally:
            if client is not None:
                with contextlib.suppress(*GONE):
                    await client.aclose()


def _plan(seed: int) -> list[tuple[str, int]]:
    """Three kill points, in three rounds in order: (what the server logs, files after)."""
    rng = np.random.default_rng(seed)
    points = []
    for number in sorted(rng.choice(np.arange(2, SPEC.rounds + 1), size=3, replace=False)):
        if rng.random() < 0.25:
            points.append((f"run fl: round {number} started", 0))
        else:
            peer = PEERS[rng.integers(len(PEERS))]
            points.append((f"round {number}-fl: {peer} contributed", int(rng.integers(0, 16))))
    return points


async def _run(data: Path, kills: list[tuple[str, int]], servers: list[Server]) -> Versions:
    """The whole run on ``data``, a server dying at each of ``kills`` in turn (none: one
    server throughout); its versions."""
    board = Board()
    server = await asyncio.to_thread(Server, data, **_kill_env(kills, 0))
    servers.append(server)
    creator = await RunClient.connect("127.0.0.1", server.port, peer="creator", key=SECRET.encode())
    await creator.create_run("fl", SPEC, _initial())
    await creator.aclose()
    peers = asyncio.gather(*(_peer(name, board) for name in PEERS))
    await board.publish(server.port)
    for index in range(1, len(kills) + 1):
        code = await asyncio.to_thread(server.died, 120)
        assert code == -signal.SIGKILL, f"the server ended ({code}) before its kill point"
        server = await asyncio.to_thread(Server, data, **_kill_env(kills, index))
        servers.append(server)
        await board.publish(server.port)
    await asyncio.wait_for(peers, 300)
    reader = await RunClient.connect("127.0.0.1", server.port, peer="reader", key=SECRET.encode())
    try:
        rows = await reader.versions("fl")
    finally:
        await reader.aclose()
    return [(row.version, row.global_cid, row.state_cid) for row in rows]


def _kill_env(kills: list[tuple[str, int]], index: int) -> dict[str, dict[str, str]]:
    """``Server`` arguments for the ``index``-th server: dying at kill point ``index``."""
    if index >= len(kills):
        return {}
    message, writes = kills[index]
    return {"env": {"TS_KILL_ON": message, "TS_KILL_WRITES": str(writes)}}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Versions:
    started: list[Server] = []
    try:
        versions = asyncio.run(_run(tmp_path_factory.mktemp("straight"), [], started))
    finally:
        for server in started:
            server.kill()
    assert [v for v, _, _ in versions] == list(range(SPEC.rounds + 1))
    return versions


@pytest.mark.parametrize("seed", [11, 12, 13])
def test_a_deterministic_run_killed_at_random_points_has_the_uninterrupted_bits(
    seed: int, tmp_path: Path, servers: list[Server], uninterrupted: Versions
) -> None:
    kills = _plan(seed)
    versions = asyncio.run(_run(tmp_path, kills, servers))
    assert versions == uninterrupted, f"kill plan {kills}"
