"""Bounds a hostile or careless user meets: a version from the future, absurd run sizes, a
claim of 2^62 samples, a second server on a data directory in use; and the refusals of
non-finite models as a peer over the wire and the CLI see them."""

from __future__ import annotations

import asyncio
import inspect
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from helpers.serve import Server
from tensorswap.cid import Cid
from tensorswap.cli import main, serve_cmd
from tensorswap.rounds import (
    Coordinator,
    DataDirInUse,
    FakeClock,
    RoundClient,
    RoundId,
    RoundSpec,
    TooManySamples,
)
from tensorswap.rounds.server import RoundServer
from tensorswap.rounds.storage import LOCK_FILENAME, DataDirLock
from tensorswap.runs import (
    FutureVersion,
    InvalidRunSpec,
    NonFiniteModel,
    NonFiniteStep,
    RunManager,
    RunMode,
    RunSpec,
)
from tensorswap.runs.client import RunClient
from tensorswap.runs.service import RunService
from tensorswap.store import ModelUpdate, get_update, put_update

KEY = b"runs-bounds-key"


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[RoundServer, RunManager]]:
    coord = Coordinator.open(tmp_path, clock=FakeClock(), run_timer=False, durable=False)
    runs = RunManager.open(coord, durable=False)
    server = RoundServer(coord, key=KEY, max_wait=30)
    RunService(runs, server)
    try:
        await server.start("127.0.0.1", 0)
        yield server, runs
    finally:
        await server.aclose()
        runs.close()
        coord.close()


async def _client(server: RoundServer, peer: str) -> RunClient:
    client = await RunClient.connect("127.0.0.1", server.port, peer=peer, key=KEY)
    await client.register({"num_samples": 10})
    return client


def _w(value: float, n: int = 8) -> dict[str, np.ndarray]:
    return {"w": np.full(n, value, np.float32)}


# ── a version from the future ────────────────────────────────────────────────
async def test_a_delta_from_a_future_version_is_refused_naming_both_versions(
    served: tuple[RoundServer, RunManager],
) -> None:
    server, _ = served
    peer = await _client(server, "p")
    try:
        await peer.create_run("a", RunSpec(mode=RunMode.ASYNC, buffer=2), ModelUpdate(_w(0.0)))
        task = await peer.next_task("a", timeout=10)
        assert task is not None and task.version == 0
        forged = replace(task, version=999)  # a peer that says it trained on version 999
        with pytest.raises(FutureVersion) as refused:  # typed, across the wire
            await peer.submit(forged, _w(0.1), num_samples=1)
        assert (refused.value.trained_on, refused.value.current) == (999, 0)
        assert "version 999" in str(refused.value) and "version 0" in str(refused.value)
        assert "staleness" not in str(refused.value)
    finally:
        await peer.aclose()


# ── absurd sizes ─────────────────────────────────────────────────────────────
@pytest.mark.parametrize(
    "options",
    [
        {"per_round": 2**62},
        {"min_clients": 2**62},
        {"mode": "async", "buffer": 2**62},
        {"deadline_window": 10**9},
        {"max_samples_per_peer": 0},
        {"max_samples_per_peer": 2**62},
    ],
)
def test_run_sizes_are_bounded(options: dict[str, Any]) -> None:
    with pytest.raises(InvalidRunSpec, match=r"must be at most|>= 1"):
        RunSpec(**options)


def test_the_bounds_hold_at_their_limit() -> None:
    RunSpec(per_round=1_000_000, min_clients=1_000_000, deadline_window=1000)
    RunSpec(mode=RunMode.ASYNC, buffer=1_000_000, max_samples_per_peer=2**53)


def test_run_create_refuses_absurd_sizes_and_non_finite_models_before_sending(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "m.npz"
    np.savez(model, w=np.zeros(4, np.float32))
    nan = tmp_path / "nan.npz"
    np.savez(nan, w=np.zeros(4, np.float32), b=np.array([np.nan], np.float32))
    nowhere = "127.0.0.1:1"  # nothing listens: the refusals come before any connection
    code = main(["run", "create", nowhere, "r", "--initial", str(model), "--per-round", str(2**62)])
    assert code == 2 and "--per-round" in capsys.readouterr().err
    code = main(["run", "create", nowhere, "r", "--initial", str(nan)])
    err = capsys.readouterr().err
    assert code == 2 and "'b'" in err and "non-finite" in err
    code = main(["run", "create", nowhere, "r", "--initial", str(model), "--secagg",
                 "--min-clients", "2", "--max-samples-per-peer", "5"])  # fmt: skip
    assert code == 2 and "secagg_max_weight" in capsys.readouterr().err


# ── non-finite, over the wire ────────────────────────────────────────────────
async def test_a_peer_hears_why_its_delta_was_refused_and_a_creator_why_its_model_was(
    served: tuple[RoundServer, RunManager],
) -> None:
    server, manager = served
    peer = await _client(server, "p")
    try:
        with pytest.raises(NonFiniteModel, match="'w'"):
            await peer.create_run("bad", RunSpec(), ModelUpdate(_w(np.inf)))
        await peer.create_run("a", RunSpec(mode=RunMode.ASYNC, buffer=1), ModelUpdate(_w(3e38)))
        task = await peer.next_task("a", timeout=10)
        assert task is not None
        with pytest.raises(NonFiniteStep) as refused:
            await peer.submit(task, _w(3.4e38), num_samples=1)
        assert refused.value.stage == "optimizer step" and refused.value.current == 0
        assert refused.value.peers == "'p'"
        await asyncio.to_thread(manager.drain, 60)
        row = await peer.run("a")
        assert row.version == 0 and row.round == 2  # the next buffer is open
    finally:
        await peer.aclose()


# ── a weight claim of 2^62 ───────────────────────────────────────────────────
def test_a_run_refuses_a_claim_above_its_sample_cap(tmp_path: Path) -> None:
    coord = Coordinator.open(tmp_path, clock=FakeClock(), run_timer=False, durable=False)
    manager = RunManager.open(coord, durable=False)
    try:
        for peer in ("a", "b"):
            manager.registry.register(peer, {"num_samples": 10})
        spec = RunSpec(per_round=2, max_samples_per_peer=1000)
        manager.create_run("r", spec, put_update(coord.store, ModelUpdate(_w(0.0))))
        manager.drain()
        huge = put_update(coord.store, ModelUpdate(_w(5.0), 2**62))
        with pytest.raises(TooManySamples) as refused:
            manager.submit(RoundId(1, "r"), "a", huge)
        assert (refused.value.claimed, refused.value.cap, refused.value.peer) == (2**62, 1000, "a")
        assert coord.contributions(RoundId(1, "r")) == []  # nothing recorded
        manager.submit(RoundId(1, "r"), "a", put_update(coord.store, ModelUpdate(_w(5.0), 1000)))
        manager.submit(RoundId(1, "r"), "b", put_update(coord.store, ModelUpdate(_w(1.0), 1000)))
        info = manager.wait_version("r", 1, timeout=60)
        got = get_update(coord.store, Cid.parse(info.global_cid)).tensors["w"]
        np.testing.assert_allclose(got, 3.0)  # equal claims at the cap: an even mean
    finally:
        manager.close()
        coord.close()


def test_a_regions_fold_may_claim_the_cap_once_per_peer_it_covers(tmp_path: Path) -> None:
    coord = Coordinator.open(tmp_path, clock=FakeClock(), run_timer=False, durable=False)
    manager = RunManager.open(coord, durable=False)
    try:
        for peer, facts in (("e1", {"region": "east"}), ("e2", {"region": "east"}), ("w", {})):
            manager.registry.register(peer, facts)
        spec = RunSpec(per_round=3, max_samples_per_peer=100)
        manager.create_run("r", spec, put_update(coord.store, ModelUpdate(_w(0.0))))
        manager.drain()
        rid, cap = RoundId(1, "r"), coord.hooks.sample_cap
        assert manager in coord.hooks
        assert cap(rid, "east", None) == 200 and cap(rid, "w", None) == 100
        assert cap(rid, "w", 50) == 50  # the coordinator's own cap, when tighter
        assert cap(RoundId(1, "not-a-run"), "w", 50) == 50
    finally:
        manager.close()
        coord.close()


async def test_a_plain_round_refuses_a_claim_above_the_coordinators_cap(tmp_path: Path) -> None:
    with Coordinator.open(tmp_path, durable=False) as coord:
        coord.samples.limit = 100
        coord.start_round(RoundId(1, "plain"), RoundSpec(2))
        server = RoundServer(coord, key=KEY)
        async with await server.start("127.0.0.1", 0):
            client = await RoundClient.connect("127.0.0.1", server.port, peer="p", key=KEY)
            try:
                with pytest.raises(TooManySamples) as refused:  # typed, across the wire
                    await client.submit(RoundId(1, "plain"), _w(1.0), num_samples=2**62)
                assert (refused.value.claimed, refused.value.cap) == (2**62, 100)
                await client.submit(RoundId(1, "plain"), _w(1.0), num_samples=100)
            finally:
                await client.aclose()


def test_serve_and_run_create_take_the_sample_cap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, Any] = {}
    signature = inspect.signature(serve_cmd.run_server)

    async def fake_run(*args: Any, **kwargs: Any) -> None:
        seen.update(signature.bind(*args, **kwargs).arguments)

    monkeypatch.setattr(serve_cmd, "run_server", fake_run)
    monkeypatch.setattr(serve_cmd, "release_large_frees", lambda: True)
    args = ["--listen", "127.0.0.1:0", "--data", str(tmp_path / "d")]
    result = CliRunner().invoke(serve_cmd.serve, [*args, "--max-samples-per-peer", "5000"])
    assert result.exit_code == 0, result.output
    assert seen["max_samples_per_peer"] == 5000


# ── one server per data directory ────────────────────────────────────────────
def test_a_data_directory_is_locked_by_its_first_holder(tmp_path: Path) -> None:
    data = tmp_path / "data"
    first = DataDirLock(data).acquire()  # creates the directory
    try:
        with pytest.raises(DataDirInUse) as refused:
            DataDirLock(data).acquire()  # a second server in this very process
        assert refused.value.path == str(data) and refused.value.pid == os.getpid()
        assert str(data) in str(refused.value) and str(os.getpid()) in str(refused.value)
    finally:
        first.release()
    with DataDirLock(data):  # released: the next server starts
        pass
    assert (data / LOCK_FILENAME).exists()


def test_a_second_serve_on_a_data_directory_in_use_refuses_to_start(
    tmp_path: Path, servers: list[Server]
) -> None:
    data = tmp_path / "data"
    servers.append(first := Server(data))
    second = subprocess.run(
        [sys.executable, "-m", "tensorswap.cli.serve_cmd", "--listen", "127.0.0.1:0",
         "--data", str(data)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert second.returncode == 1, second.stderr
    assert f"in use by process {first.proc.pid}" in second.stderr
    assert str(data) in second.stderr and "Traceback" not in second.stderr
    first.kill()  # SIGKILL: the kernel drops its lock, no stale file blocks a restart
    servers.append(Server(data))


def test_a_run_journaled_before_its_bounds_existed_does_not_stop_a_restart(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import json
    import sqlite3

    from tensorswap.rounds.journal import DB_FILENAME

    with Coordinator.open(tmp_path, run_timer=False, durable=False) as coord:
        manager = RunManager.open(coord, durable=False)
        manager.create_run("old", RunSpec(per_round=2), put_update(coord.store, ModelUpdate(_w(0))))
        manager.close()
    with sqlite3.connect(tmp_path / DB_FILENAME) as db:  # as an older version journaled it
        (text,) = db.execute("SELECT spec FROM runs WHERE name = 'old'").fetchone()
        db.execute(
            "UPDATE runs SET spec = ?", (json.dumps({**json.loads(text), "per_round": 2**62}),)
        )
    db.close()
    with Coordinator.open(tmp_path, run_timer=False, durable=False) as coord:
        manager = RunManager.open(coord, durable=False)  # starts; the run is left out
        try:
            assert manager.runs() == []
            assert "run old is not resumed" in caplog.text and "per_round" in caplog.text
        finally:
            manager.close()
