"""`tensorswap serve` as a process: kill -9 mid-round, restart, the round goes on; `status`."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from helpers.serve import SECRET, Server
from tensorswap.cid import Cid
from tensorswap.cli.status_cmd import status as status_command
from tensorswap.rounds.client import RoundClient
from tensorswap.rounds.core import Collecting, Complete, DuplicateContribution, RoundId, RoundSpec
from tensorswap.rounds.engine import Coordinator
from tensorswap.store import get_update

RID = RoundId(1, "lead")


def update(value: float) -> dict[str, np.ndarray]:
    return {"w": np.full((8, 8), value, np.float32), "b": np.full(8, value, np.float32)}


async def client(port: int, peer: str) -> RoundClient:
    return await RoundClient.connect("127.0.0.1", port, peer=peer, key=SECRET.encode())


async def first_half(port: int) -> None:
    async with await client(port, "lead") as lead:
        assert await lead.start_round(RID, RoundSpec(3))
    for peer, value, n in (("a", 1.0, 10), ("b", 2.0, 20)):
        async with await client(port, peer) as c:
            await c.submit(RID, update(value), n)


async def second_half(port: int) -> dict[str, np.ndarray]:
    async with await client(port, "a") as a:
        assert await a.status(RID) == Collecting(2, 3)
        with pytest.raises(DuplicateContribution):
            await a.submit(RID, update(9.0), 1)
    async with await client(port, "c") as c:
        await c.submit(RID, update(4.0), 70)
        assert isinstance(await c.wait(RID, timeout=60), Complete)
        return await c.fetch_result(RID, timeout=60)


@pytest.mark.timeout(180)
def test_kill_9_mid_round_then_restart_keeps_every_contribution(
    tmp_path: Path, servers: list[Server]
) -> None:
    data = tmp_path / "coordinator"
    first = Server(data)
    servers.append(first)
    asyncio.run(first_half(first.port))
    first.kill()  # SIGKILL in the middle of the round
    second = Server(data)
    servers.append(second)
    result = asyncio.run(second_half(second.port))
    expected = (1.0 * 10 + 2.0 * 20 + 4.0 * 70) / 100
    np.testing.assert_allclose(result["w"], expected, rtol=1e-6)

    runner = CliRunner()
    out = runner.invoke(
        status_command,
        [f"127.0.0.1:{second.port}", "--json", "--key", SECRET],
        catch_exceptions=False,
    )
    assert out.exit_code == 0, out.output
    report = json.loads(out.output)
    (row,) = report["rounds"]
    assert row["status"]["status"] == "Complete"
    assert (row["received"], row["expected"], sorted(row["peers"])) == (3, 3, ["a", "b", "c"])
    assert report["stats"]["contributions"] == 1  # counters restart with the process
    assert report["omitted"] == 0

    table = runner.invoke(status_command, [f"127.0.0.1:{second.port}", "--key", SECRET])
    assert table.exit_code == 0, table.output
    assert "1-lead" in table.output and "Complete" in table.output and "3/3" in table.output
    assert second.stop() == 0


def test_status_without_the_key_is_refused(tmp_path: Path, servers: list[Server]) -> None:
    server = Server(tmp_path / "coordinator")
    servers.append(server)
    result = CliRunner().invoke(status_command, [f"127.0.0.1:{server.port}", "--json"])
    assert result.exit_code != 0


async def tiny_rounds(port: int, count: int) -> list[str]:
    """``count`` one-peer rounds; the aggregate CID of each."""
    results = []
    async with await client(port, "solo") as c:
        for number in range(1, count + 1):
            rid = RoundId(number, "lead")
            assert await c.start_round(rid, RoundSpec(1))
            await c.submit(rid, update(float(number)), number)
            status = await c.wait(rid, timeout=60)
            assert isinstance(status, Complete)
            results.append(status.cid)
    return results


def test_serve_keep_rounds_collects_old_rounds_and_their_blocks(
    tmp_path: Path, servers: list[Server]
) -> None:
    data = tmp_path / "coordinator"
    server = Server(
        data, "--keep-rounds", "1", "--gc-grace", "0", "--max-wait", "30", "--max-connections", "8"
    )
    servers.append(server)
    results = asyncio.run(tiny_rounds(server.port, 3))
    assert server.stop() == 0  # a clean stop lets queued collections finish
    with Coordinator.open(data) as coord:
        assert [info.round_id.round for info in coord.rounds()] == [3]
        assert not coord.store.has(Cid.parse(results[0]))
        assert not coord.store.has(Cid.parse(results[1]))
        assert get_update(coord.store, Cid.parse(results[2])).num_samples == 3
