"""kill -9 of `tensorswap serve` between SecAgg+ phases: the restarted coordinator fails that
round cleanly (a typed reason, journaled), samples a new round, and the run finishes; nothing
it kept lets anyone read one peer's update."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

pytest.importorskip("cryptography")

from helpers.serve import SECRET, Server
from tensorswap.cli.run_cmd import run as run_command
from tensorswap.privacy.secagg import SecAggClient, SecureRoundFailed, decode, encode
from tensorswap.privacy.secagg.protocol import KeysBroadcast, SharesUpload
from tensorswap.rounds.core import Failed, RoundId
from tensorswap.runs import RunSpec
from tensorswap.runs.client import RunClient
from tensorswap.runs.messages import SecAggRequest
from tensorswap.store import DirectoryStore

pytestmark = pytest.mark.slow

PEERS = ("p0", "p1", "p2")
SPEC = RunSpec(per_round=3, min_clients=3, rounds=1, secagg=True)


def _initial() -> dict[str, np.ndarray]:
    return {"w": np.zeros((16, 4), np.float32), "b": np.zeros(4, np.float32)}


def _delta(i: int) -> np.ndarray:
    return np.random.default_rng(7 + i).uniform(-0.5, 0.5, 68).astype(np.float32)


async def _peers(port: int) -> list[RunClient]:
    out = []
    for name in PEERS:
        client = await RunClient.connect("127.0.0.1", port, peer=name, key=SECRET.encode())
        await client.register({"num_samples": 5})
        out.append(client)
    return out


def _call(client: RunClient, after: int, message: bytes = b"", wait: bool = True) -> SecAggRequest:
    return SecAggRequest(
        peer=client.peer,
        run="fl",
        round=1,
        after=after,
        message=message,
        timeout=None if wait else 0.0,
    )


async def _into_the_share_phase(port: int) -> None:
    """All three advertise, get their neighbours' keys; two upload their shares; return with
    the share phase open (waiting for the third)."""
    clients = await _peers(port)
    try:
        await clients[0].create_run("fl", SPEC, _initial())
        for client in clients:
            client.secure_ahead = False  # the phases are spoken here, by hand
            assert (await client.next_task("fl", timeout=60)) is not None
        machines = []
        for i, client in enumerate(clients):
            answer = await client.call(_call(client, 0))
            machines.append(SecAggClient(answer.secagg_peer or 0, _delta(i), 5))
            advert = machines[-1].handle(decode(answer.secagg or b""))
            await client.call(_call(client, 1, encode(advert), wait=False))
        for client, machine in zip(clients[:2], machines[:2], strict=True):
            keys = decode((await client.call(_call(client, 1), long=True)).secagg or b"")
            assert isinstance(keys, KeysBroadcast)
            shares = machine.handle(keys)
            assert isinstance(shares, SharesUpload)
            await client.call(_call(client, 2, encode(shares), wait=False))
    finally:
        for client in clients:
            await client.aclose()


async def _after_restart(port: int) -> None:
    clients = await _peers(port)
    try:
        # round 1's session is gone: a peer still in it is told so, typed
        with pytest.raises(SecureRoundFailed, match="restarted during phase 'share'"):
            await clients[2].call(_call(clients[2], 1), long=True)
        status = await clients[0].rounds.status(RoundId(1, "fl"))
        assert isinstance(status, Failed) and "restarted during phase 'share'" in status.reason

        async def train(i: int, client: RunClient) -> None:
            task = await client.next_task("fl", timeout=60)
            assert task is not None and task.secagg and task.round_id.round == 2
            model = await client.fetch_model(task)
            delta = _delta(i)
            new = {"w": model["w"] + delta[:64].reshape(16, 4), "b": model["b"] + delta[64:]}
            await client.submit(task, new, num_samples=5)

        await asyncio.gather(*(train(i, c) for i, c in enumerate(clients)))
        assert await clients[0].next_task("fl", timeout=60) is None
        final = await clients[0].run("fl")
        assert final.finished and final.version == 1 and final.round == 2
        model = await clients[0].rounds.fetch_result(RoundId(2, "fl"))
        want = np.mean([_delta(i) for i in range(3)], axis=0)
        np.testing.assert_allclose(model["w"].ravel(), want[:64], atol=1e-4)
    finally:
        for client in clients:
            await client.aclose()


def test_kill_9_between_phases_fails_the_round_cleanly(
    tmp_path: Path, servers: list[Server]
) -> None:
    first = Server(tmp_path / "data")
    servers.append(first)
    asyncio.run(_into_the_share_phase(first.port))
    first.kill()
    again = Server(tmp_path / "data")
    servers.append(again)
    asyncio.run(_after_restart(again.port))
    np.savez(tmp_path / "init.npz", **_initial())
    address = f"127.0.0.1:{again.port}"
    args = ["create", address, "cli", "--initial", str(tmp_path / "init.npz"), "--key", SECRET]
    more = ["--per-round", "4", "--min-clients", "4", "--secagg", "--secagg-threshold", "4"]
    result = CliRunner().invoke(run_command, [*args, *more])
    assert result.exit_code == 0, result.output
    bad = CliRunner().invoke(
        run_command, ["create", address, "bad", *args[3:], *more[:2], "--secagg"]
    )
    assert bad.exit_code != 0 and "min_clients" in bad.output
    shown = CliRunner().invoke(run_command, ["show", address, "cli", "--key", SECRET, "--json"])
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.output)[0]["secagg"] is True
    again.stop()
    with sqlite3.connect(tmp_path / "data" / "rounds.sqlite3") as db:
        rows = db.execute("SELECT round, phase, reason FROM run_secagg ORDER BY round").fetchall()
    assert [(r, p) for r, p, _ in rows] == [(1, "failed"), (2, "done")]
    assert "memory only" in rows[0][2]
    store = DirectoryStore(tmp_path / "data" / "blocks")
    try:
        secrets = {_delta(i).tobytes() for i in range(3)}
        for cid in store:
            data = bytes(store.get(cid))
            assert not any(s in data for s in secrets)
    finally:
        store.close()
