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
import contextlib
import signal
from pathlib import Path

import numpy as np
import pytest

from helpers.serve import SECRET, Server
from tensorswap.errors import WireError
from tensorswap.runs import RunSpec, Task
from tensorswap.runs.client import RunClient

PEERS = ("p0", "p1", "p2", "p3")
SPEC = RunSpec(per_round=4, rounds=5, seed=3, optimizer="fedadam", optimizer_params={"eta": 0.05})
KILLED_IN = 3
GONE = (OSError, EOFError, WireError)
"""What a call raises when the server dies under it."""

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


async def _submit(clients: list[RunClient], number: int, ahead: dict[str, Task]) -> int:
    """Each of ``clients`` fetches its task for round ``number`` and submits, one after another
    in name order; how many submits returned. A server that dies under a call ends the round
    there (the caller restarts it); ``ahead`` holds a task of a later round that a peer was
    given instead (its last submit had landed after all)."""
    for done, client in enumerate(clients):
        try:
            task = ahead.pop(client.peer, None) or await client.next_task("fl", timeout=60)
            assert task is not None
            if task.round_id.round > number:  # its submit before the kill was recorded
                ahead[client.peer] = task
                continue
            assert task.round_id.round == number
            model = await client.fetch_model(task)
            samples = 10 + PEERS.index(client.peer)
            await client.submit(task, _trained(model, client.peer, number), num_samples=samples)
        except GONE:
            return done
    return len(clients)


async def _play(
    port: int, *, start: int = 1, stop_after: int | None = None, done: int = 0
) -> tuple[int, int]:
    """Rounds ``start``.. of the run (created when ``start`` is 1), the first ``done`` peers
    having submitted in round ``start`` already; with ``stop_after``, return once that many
    peers have submitted in round KILLED_IN (the caller kills the server then). Where it
    stopped: the round and how many of its submits had returned (a server that died under
    a call stops it too); ``(rounds + 1, 0)`` once the run is finished."""
    clients = await _connect(port)
    ahead: dict[str, Task] = {}
    try:
        if start == 1:
            await clients[0].create_run("fl", SPEC, _initial())
        for number in range(start, SPEC.rounds + 1):
            if number == KILLED_IN and stop_after is not None:
                return number, await _submit(clients[:stop_after], number, ahead)
            first = done if number == start else 0
            submitted = first + await _submit(clients[first:], number, ahead)
            if submitted < len(clients):
                return number, submitted
        with contextlib.suppress(*GONE):
            assert await clients[0].next_task("fl", timeout=60) is None  # finished
    finally:
        for client in clients:
            with contextlib.suppress(*GONE):
                await client.aclose()
    return SPEC.rounds + 1, 0


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


LAST_IN = f"round {KILLED_IN}-fl: {PEERS[-1]} contributed"
"""Logged once round KILLED_IN's last contribution is recorded: the round closes then."""


@pytest.mark.parametrize(
    "writes",
    [
        pytest.param(1, id="aggregating-first-chunk"),
        pytest.param(4, id="aggregating-last-chunk"),
        pytest.param(5, id="aggregate-manifest"),
        pytest.param(6, id="stepping-first-write"),
        pytest.param(12, id="stepping"),
    ],
)
def test_kill_9_while_it_aggregates_or_steps_gives_the_same_versions(
    writes: int,
    tmp_path: Path,
    servers: list[Server],
    uninterrupted: list[tuple[int, str, str | None]],
) -> None:
    """The server SIGKILLs itself as it writes the ``writes``-th file after round 3's last
    contribution: the round's aggregate comes first (4 chunks, then its manifest), then
    FedAdam's step (its state and the new global model)."""
    first = Server(tmp_path, env={"TS_KILL_ON": LAST_IN, "TS_KILL_WRITES": str(writes)})
    servers.append(first)
    number, submitted = asyncio.run(_play(first.port))
    assert first.died() == -signal.SIGKILL  # it died where it was told to
    assert (number, submitted) in {(KILLED_IN, len(PEERS) - 1), (KILLED_IN + 1, 0)}
    again = Server(tmp_path)
    servers.append(again)
    asyncio.run(_play(again.port, start=number, done=submitted))
    assert asyncio.run(_versions(again.port)) == uninterrupted
