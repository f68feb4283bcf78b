"""A DP run's sample stays secret from peers (issue 23, fault 3).

The accountant amplifies ε by subsampling (q = m/N per round), which assumes nobody but
the curator knows who was sampled. Before: ``RunClient.runs``/``versions``, ``tensorswap
status --json`` and ``run show`` listed every round's participants to any key holder.
Now a peer sees counts and its own part; the operator key shows the names; runs without
DP are unchanged.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from tensorswap.cli import cli
from tensorswap.rounds import Coordinator, FakeClock, RoundClient, SampleHidden
from tensorswap.rounds.core.state import RoundId
from tensorswap.rounds.protocol.paging import page_peers, page_rounds
from tensorswap.rounds.server import RoundServer
from tensorswap.runs import RunManager, RunSpec
from tensorswap.runs.client import RunClient
from tensorswap.runs.service import RunService
from tensorswap.store import ModelUpdate
from tensorswap.wire import AuthenticationFailed

KEY = b"peers-shared-key"
OPERATOR = b"the-operators-own-key"
PEERS = ("peer-0", "peer-1", "peer-2")  # no base32 CID holds a "-"


def _model(value: float) -> dict[str, np.ndarray]:
    return {"w": np.full((4, 4), value, np.float32)}


@dataclass
class Served:
    server: RoundServer
    runs: RunManager
    peers: dict[str, RunClient]

    @property
    def port(self) -> int:
        return self.server.port


@asynccontextmanager
async def served(root: Path) -> AsyncIterator[Served]:
    coord = Coordinator.open(root, clock=FakeClock(), run_timer=False, durable=False)
    runs = RunManager.open(coord, durable=False)
    server = RoundServer(coord, key=KEY, operator_key=OPERATOR, max_wait=30)
    RunService(runs, server)
    peers: dict[str, RunClient] = {}
    try:
        await server.start("127.0.0.1", 0)
        for name in PEERS:
            peers[name] = await RunClient.connect("127.0.0.1", server.port, peer=name, key=KEY)
            await peers[name].register({"num_samples": 10})
        yield Served(server, runs, peers)
    finally:
        for client in peers.values():
            await client.aclose()
        await server.aclose()
        runs.close()
        coord.close()


async def _play(s: Served, run: str, spec: RunSpec) -> set[str]:
    """Create ``run``, let every sampled peer train its one round; who took part."""
    await s.peers["peer-0"].create_run(run, spec, ModelUpdate(_model(0.0)))
    took_part: set[str] = set()

    async def peer(name: str) -> None:
        client = s.peers[name]
        task = await client.next_task(run, timeout=0.5)
        if task is None or task.round_id.round != 1:  # not sampled in round 1
            return
        model = await client.fetch_model(task)
        await client.submit(task, {k: v + 0.1 for k, v in model.items()}, num_samples=10)
        took_part.add(name)

    await asyncio.gather(*(peer(name) for name in PEERS))
    while (await s.peers["peer-0"].run(run)).version < 1:
        await s.peers["peer-0"].versions(run, 1, wait=5)
    return took_part


DP = RunSpec(per_round=2, rounds=2, seed=3, dp_clip=1.0, dp_noise=1.0, dp_delta=1e-5)


async def test_a_peer_sees_counts_and_its_own_part_only(tmp_path: Path) -> None:
    async with served(tmp_path) as s:
        took_part = await _play(s, "dp", DP)
        assert len(took_part) == 2
        for name, client in s.peers.items():
            row = await client.run("dp")
            assert row.hidden and row.selected == [] and row.participants == []
            assert row.selected_count == 2 and row.participant_count == 2
            assert row.you_took_part is (name in took_part)
            assert isinstance(row.you_selected, bool)
            (version,) = await client.versions("dp", 1)
            assert version.hidden and version.participants == []
            assert version.participant_count == 2
            assert version.you_took_part is (name in took_part)
            assert version.epsilon is not None  # the accounting is still shown
        async with await RunClient.connect(
            "127.0.0.1", s.port, peer="ops", key=OPERATOR
        ) as operator:
            row = await operator.run("dp")
            assert not row.hidden and set(row.participants) == took_part
            assert len(row.selected) == 2 and row.you_took_part is None
            (version,) = await operator.versions("dp", 1)
            assert set(version.participants) == took_part and not version.hidden


async def test_the_coordinator_rounds_of_a_dp_run_list_no_names(tmp_path: Path) -> None:
    async with served(tmp_path) as s:
        took_part = await _play(s, "dp", DP)
        rid = RoundId(1, "dp")
        peer = s.peers["peer-1"].rounds
        (row,) = [r for r in (await peer.server_status()).rounds if r.initiator == "dp"][:1]
        assert row.hidden and row.peers == [] and row.received == 2
        page = await page_rounds(peer, 0, 10, peers=10)
        assert all(r.peers == [] and r.hidden for r in page.rounds if r.initiator == "dp")
        with pytest.raises(SampleHidden):
            await page_peers(peer, rid, 0, 10)
        async with await RoundClient.connect(
            "127.0.0.1", s.port, peer="ops", key=OPERATOR
        ) as operator:
            page = await page_peers(operator, rid, 0, 10)
            assert set(page.peers) == took_part
            rows = [r for r in (await operator.server_status()).rounds if r.initiator == "dp"]
            assert set(rows[0].peers) == took_part and not rows[0].hidden


async def test_status_json_and_run_show_of_a_key_holder_name_no_other_peer(
    tmp_path: Path,
) -> None:
    async with served(tmp_path) as s:
        await _play(s, "dp", DP)
        key_file, op_file = tmp_path / "peer.key", tmp_path / "operator.key"
        key_file.write_bytes(KEY)
        op_file.write_bytes(OPERATOR)
        address = f"127.0.0.1:{s.port}"

        def invoke(*args: str) -> str:
            result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
            assert result.exit_code == 0, result.output
            return result.output

        status = await asyncio.to_thread(
            invoke, "status", address, "--json", "--key-file", str(key_file)
        )
        shown = await asyncio.to_thread(
            invoke, "run", "show", address, "dp", "--json", "--key-file", str(key_file)
        )
        for text in (status, shown):
            assert not any(name in text for name in PEERS), text
        (run,) = json.loads(shown)
        assert run["hidden"] and run["participant_count"] == 2
        for_operator = await asyncio.to_thread(
            invoke, "run", "show", address, "dp", "--json", "--key-file", str(op_file)
        )
        assert len(json.loads(for_operator)[0]["participants"]) == 2


async def test_runs_without_dp_still_name_their_peers(tmp_path: Path) -> None:
    async with served(tmp_path) as s:
        took_part = await _play(s, "plain", RunSpec(per_round=2, rounds=2, seed=3))
        row = await s.peers["peer-2"].run("plain")
        assert not row.hidden and set(row.participants) == took_part
        assert row.participant_count == 2 and row.you_took_part is None
        rows = (await s.peers["peer-2"].rounds.server_status()).rounds
        assert set(rows[0].peers) == took_part


async def test_an_operator_key_needs_a_shared_key_and_is_not_it(tmp_path: Path) -> None:
    coord = Coordinator.open(tmp_path, clock=FakeClock(), run_timer=False, durable=False)
    try:
        with pytest.raises(ValueError, match="operator key"):
            RoundServer(coord, operator_key=OPERATOR)
        with pytest.raises(ValueError, match="operator key"):
            RoundServer(coord, key=KEY, operator_key=KEY)
        server = RoundServer(coord, key=KEY, operator_key=OPERATOR)
        await server.start("127.0.0.1", 0)
        try:  # a third key proves neither
            with pytest.raises(AuthenticationFailed):
                await RoundClient.connect("127.0.0.1", server.port, peer="x", key=b"other")
        finally:
            await server.aclose()
    finally:
        coord.close()


def test_a_secret_sample_is_not_the_seeded_one() -> None:
    """A DP run's sample comes from the OS's CSPRNG: whoever knows the run's seed (its
    creator, anyone told the spec) cannot recompute it from the active names."""
    from tensorswap.runs import sample_peers

    names = [f"p{i}" for i in range(6)]
    draws = {sample_peers(names, 3, 7, 1, secret=True) for _ in range(50)}
    assert len(draws) > 1  # 50 equal draws of 3 of 6 would have probability 20**-49
    assert all(len(d) == 3 and set(d) <= set(names) and list(d) == sorted(d) for d in draws)
    assert sample_peers(names, 6, 7, 1, secret=True) == tuple(names)
