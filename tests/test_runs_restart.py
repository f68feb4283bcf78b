"""A run survives kill -9 of `tensorswap serve`: killed right after round 3's last submit
(so while it aggregates, steps or starts round 4), restarted, the final global model after
5 rounds is bit-identical to an uninterrupted run's; `status` and `run show` list the run."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from helpers.serve import SECRET, Server
from tensorswap.cli.run_cmd import run as run_command
from tensorswap.cli.status_cmd import status as status_command
from tensorswap.runs import RunSpec, sample_peers
from tensorswap.runs.client import RunClient

PEERS = ("p0", "p1", "p2", "p3")
SPEC = RunSpec(per_round=3, rounds=5, seed=9, optimizer="fedadam", optimizer_params={"eta": 0.05})

pytestmark = pytest.mark.slow


def _initial() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"w": rng.standard_normal((32, 16)).astype(np.float32), "b": np.zeros(16, np.float32)}


async def _peers(port: int) -> list[RunClient]:
    clients = []
    for name in PEERS:
        client = await RunClient.connect("127.0.0.1", port, peer=name, key=SECRET.encode())
        await client.register({"num_samples": 10})
        clients.append(client)
    return clients


async def _round(clients: list[RunClient], number: int) -> None:
    """Round ``number``: the peers sampled for it (known from the seed) train and submit, one
    after another in name order, so every run folds the same contributions in the same order."""
    chosen = [c for c in clients if c.peer in sample_peers(PEERS, 3, SPEC.seed, number)]
    tasks = await asyncio.gather(*(c.next_task("fl", timeout=60) for c in chosen))
    for client, task in zip(chosen, tasks, strict=True):
        assert task is not None and task.round_id.round == number
        model = await client.fetch_model(task)
        step = np.float32(0.1 * (1 + PEERS.index(client.peer)))
        await client.submit(task, {k: v + step for k, v in model.items()}, num_samples=10)


async def _play(port: int, rounds: range, *, create: bool) -> str | None:
    clients = await _peers(port)
    try:
        if create:
            await clients[0].create_run("fl", SPEC, _initial())
        for number in rounds:
            await _round(clients, number)
        if rounds.stop <= SPEC.rounds:
            return None  # the caller kills the server now
        assert await clients[0].next_task("fl", timeout=60) is None  # finished
        final = await clients[0].run("fl")
        assert final.finished and final.version == 5
        return final.global_cid
    finally:
        for client in clients:
            await client.aclose()


def test_kill_9_during_a_run_resumes_to_the_same_final_model(
    tmp_path: Path, servers: list[Server]
) -> None:
    straight = Server(tmp_path / "straight")
    servers.append(straight)
    expected = asyncio.run(_play(straight.port, range(1, 6), create=True))
    assert expected is not None

    first = Server(tmp_path / "killed")
    servers.append(first)
    asyncio.run(_play(first.port, range(1, 4), create=True))
    first.kill()  # SIGKILL right after round 3's last submit returned
    again = Server(tmp_path / "killed")
    servers.append(again)
    resumed = asyncio.run(_play(again.port, range(4, 6), create=False))
    assert resumed == expected

    address = f"127.0.0.1:{again.port}"
    result = CliRunner().invoke(status_command, [address, "--key", SECRET, "--json"])
    assert result.exit_code == 0, result.output
    (listed,) = json.loads(result.output)["runs"]
    assert listed["version"] == 5 and listed["global_cid"] == expected
    assert listed["optimizer"] == "fedadam" and len(listed["participants"]) == 3
    result = CliRunner().invoke(run_command, ["show", address, "--key", SECRET])
    assert result.exit_code == 0, result.output
    assert "fedadam" in result.output and "fl" in result.output


def test_run_create_from_a_file(tmp_path: Path, servers: list[Server]) -> None:
    server = Server(tmp_path / "data")
    servers.append(server)
    np.savez(tmp_path / "init.npz", **_initial())
    address = f"127.0.0.1:{server.port}"
    args = ["create", address, "cli-run", "--initial", str(tmp_path / "init.npz"), "--key", SECRET]
    more = ["--per-round", "2", "--optimizer", "fedavgm", "--opt", "server_momentum=0.5"]
    result = CliRunner().invoke(run_command, [*args, *more])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("run cli-run: version 0, global model b")
    bad = CliRunner().invoke(run_command, [*args, "--opt", "server_momentum=lots"])
    assert bad.exit_code == 2 and "a number is expected" in bad.output
    private = ["create", address, "dp-run", "--initial", str(tmp_path / "init.npz")]
    dp = ["--key", SECRET, "--per-round", "2", "--dp-clip", "1.0", "--dp-noise", "0.5"]
    result = CliRunner().invoke(run_command, [*private, *dp, "--dp-max-epsilon", "8"])
    assert result.exit_code == 0, result.output
    shown = CliRunner().invoke(run_command, ["show", address, "dp-run", "--key", SECRET, "--json"])
    assert shown.exit_code == 0, shown.output
    (row,) = json.loads(shown.output)
    assert row["dp_delta"] == 1e-5 and row["epsilon"] is not None
