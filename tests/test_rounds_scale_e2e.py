"""`tensorswap serve` as a process: batched virtual submits survive kill -9; paged status."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from helpers.serve import SECRET, Server
from tensorswap.cli.status_cmd import status as status_command
from tensorswap.rounds.client import PeerSubmit, RoundClient, VirtualClients
from tensorswap.rounds.core import Collecting, Complete, RoundId, RoundSpec
from tensorswap.rounds.protocol import page_peers

RID = RoundId(1, "sim")
PEERS = 30


async def submit_batch(port: int) -> None:
    async with await VirtualClients.connect(
        "127.0.0.1", port, connections=2, key=SECRET.encode()
    ) as pool:
        assert await pool.clients[0].start_round(RID, RoundSpec(PEERS + 1))
        items = [
            PeerSubmit(f"v{i:02}", {"w": np.full(4, float(i), np.float32)}, 1) for i in range(PEERS)
        ]
        outcomes = await pool.submit_many(RID, items, batch=8)
        assert all(isinstance(o, Collecting) for o in outcomes)  # each answered once durable


async def after_restart(port: int) -> list[str]:
    async with await RoundClient.connect("127.0.0.1", port, peer="x", key=SECRET.encode()) as c:
        assert await c.status(RID) == Collecting(PEERS, PEERS + 1)
        names = (await page_peers(c, RID, 0, 1000)).peers
        await c.submit(RID, {"w": np.full(4, 100.0, np.float32)}, 1)
        assert isinstance(await c.wait(RID, timeout=60), Complete)
        return names


@pytest.mark.timeout(180)
def test_batched_submits_survive_kill_9_and_status_pages(
    tmp_path: Path, servers: list[Server]
) -> None:
    data = tmp_path / "coordinator"
    first = Server(data)
    servers.append(first)
    asyncio.run(submit_batch(first.port))
    first.kill()  # SIGKILL right after the last answer
    second = Server(data)
    servers.append(second)
    assert asyncio.run(after_restart(second.port)) == [f"v{i:02}" for i in range(PEERS)]

    runner = CliRunner()
    address = f"127.0.0.1:{second.port}"
    out = runner.invoke(
        status_command, [address, "--json", "--key", SECRET, "--limit", "1"], catch_exceptions=False
    )
    assert out.exit_code == 0, out.output
    (row,) = json.loads(out.output)["rounds"]
    assert (row["received"], len(row["peers"])) == (PEERS + 1, 6)  # a few names, all counted
    out = runner.invoke(
        status_command,
        [
            address,
            "--json",
            "--key",
            SECRET,
            "--peers-of",
            "1-sim",
            "--start",
            "25",
            "--limit",
            "4",
        ],
        catch_exceptions=False,
    )
    assert out.exit_code == 0, out.output
    page = json.loads(out.output)
    assert page == {
        "round": "1-sim",
        "peers": ["v25", "v26", "v27", "v28"],
        "total": 31,
        "next": 29,
    }
