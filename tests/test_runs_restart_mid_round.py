"""kill -9 of `tensorswap serve` while a round collects never changes a bit (issue 25, fault 1).

A FedAdam run, 4 peers submitting one after another in every round; the server is SIGKILLed
after k of round 3's 4 submits (k = 0..4: before any, between any two, after the last, so
while it aggregates or steps) and restarted on the same data directory; the peers reconnect,
the ones that had not submitted fetch their task again and submit. Every version's global
and optimizer-state CIDs equal an uninterrupted run's: the restarted coordinator refolds
the journaled contributions in their journal order before it folds a new one.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from helpers.serve import SECRET, Server
from tensorswap.runs import RunSpec
from tensorswap.runs.client import RunClient

PEERS = ("p0", "p1", "p2", "p3")
SPEC = RunSpec(per_round=4, rounds=5, seed=3, optimizer="fedadam", optimizer_params={"eta": 0.05})
KILLED_IN = 3

pytestmark = pytest.mark.slow


def _initial() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"w": rng.standard_normal((64, 64)).astype(np.float32), "b": np.zeros(64, np.float32)}


def _trained(model: dict[str, np.ndarray], peer: str, number: int) -> dict[str, np.ndarray]:
    """A peer's update: values of very different magnitudes, so that float32 sums taken in
    another order differ in their last bits."""
    rng = np.random.default_rng([PEERS.index(peer), number])
    scale = np.float32(10.0 ** (PEERS.index(peer) - 2))
    return {
        k: v + scale * rng.standard_normal(v.shape).astype(np.float32) for k, v in model.items()
    }


async def _connect(port: int) -> list[RunClient]:
    clients = []
    for name in PEERS:
        client = await RunClient.connect("127.0.0.1", port, peer=name, key=SECRET.encode())
        await client.register({"num_samples": 10})
        clients.append(client)
    return clients


async def _submit(clients: list[RunClient], number: int) -> None:
    """Each of ``clients`` fetches its task for round ``number`` and submits, one after another
    in name order."""
    for client in clients:
        task = await client.next_task("fl", timeout=60)
        assert task is not None and task.round_id.round == number
        model = await client.fetch_model(task)
        samples = 10 + PEERS.index(client.peer)
        await client.submit(task, _trained(model, client.peer, number), num_samples=samples)


async def _play(port: int, *, start: int = 1, stop_after: int | None = None, done: int = 0) -> None:
    """Rounds ``start``.. of the run (created when ``start`` is 1), the first ``done`` peers
    having submitted in round ``start`` already; with ``stop_after``, return once that many
    peers have submitted in round KILLED_IN (the caller kills the server then)."""
    clients = await _connect(port)
    try:
        if start == 1:
            await clients[0].create_run("fl", SPEC, _initial())
        for number in range(start, SPEC.rounds + 1):
            if number == KILLED_IN and stop_after is not None:
                await _submit(clients[:stop_after], number)
                return
            await _submit(clients[done if number == start else 0 :], number)
        assert await clients[0].next_task("fl", timeout=60) is None  # finished
    finally:
        for client in clients:
            await client.aclose()


async def _versions(port: int) -> list[tuple[int, str, str | None]]:
    client = await RunClient.connect("127.0.0.1", port, peer="reader", key=SECRET.encode())
    try:
        rows = await client.versions("fl")
    finally:
        await client.aclose()
    return [(row.version, row.global_cid, row.state_cid) for row in rows]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[int, str, str | None]]:
    server = Server(tmp_path_factory.mktemp("straight"))
    try:
        asyncio.run(_play(server.port))
        versions = asyncio.run(_versions(server.port))
    finally:
        server.kill()
    assert [v for v, _, _ in versions] == list(range(SPEC.rounds + 1))
    return versions


@pytest.mark.parametrize("submitted", [0, 1, 2, 3, 4])
def test_kill_9_after_any_submit_gives_the_same_versions(
    submitted: int,
    tmp_path: Path,
    servers: list[Server],
    uninterrupted: list[tuple[int, str, str | None]],
) -> None:
    first = Server(tmp_path)
    servers.append(first)
    asyncio.run(_play(first.port, stop_after=submitted))
    first.kill()  # SIGKILL after `submitted` of round 3's submits returned
    again = Server(tmp_path)
    servers.append(again)
    asyncio.run(_play(again.port, start=KILLED_IN, done=submitted))
    assert asyncio.run(_versions(again.port)) == uninterrupted
