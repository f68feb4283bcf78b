"""Batched runs requests for many virtual peers (register, task, contribute), grouped
registrations, and per-peer proofs for runs contributions."""

from __future__ import annotations

import asyncio
import tracemalloc
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

import msgspec
import numpy as np
import pytest

from tensorswap.cid import Cid
from tensorswap.rounds import Coordinator, FakeClock, RoundId
from tensorswap.rounds.client import VirtualClients
from tensorswap.rounds.core import Collecting, Complete, PeerNotAuthorised
from tensorswap.rounds.server import RoundServer
from tensorswap.runs import NotRegistered, RunManager, RunSpec
from tensorswap.runs.batch import MAX_RUN_BATCH, decode_batch
from tensorswap.runs.client import RunClient
from tensorswap.runs.errors import InvalidRunSpec
from tensorswap.runs.messages import ContributeRequest
from tensorswap.runs.registry import ClientRegistry
from tensorswap.runs.service import RunService
from tensorswap.runs.virtual import RunContribution, VirtualRuns
from tensorswap.store import ModelUpdate
from tensorswap.wire import ProtocolViolation

KEY = b"runs-batch-key"
PEER_KEYS = {f"v{i}": bytes([i + 1]) * 16 for i in range(6)}


def _model(value: float) -> dict[str, np.ndarray]:
    return {"w": np.full(8, value, np.float32)}


async def _served(
    tmp_path: Path, peer_keys: Mapping[str, bytes] | None = None
) -> AsyncIterator[tuple[RoundServer, RunManager, RunService]]:
    coord = Coordinator.open(tmp_path, clock=FakeClock(), run_timer=False, durable=False)
    runs = RunManager.open(coord, durable=False)
    server = RoundServer(coord, key=KEY, max_wait=30, peer_keys=peer_keys)
    service = RunService(runs, server)
    try:
        await server.start("127.0.0.1", 0)
        yield server, runs, service
    finally:
        await server.aclose()
        runs.close()
        coord.close()


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[RoundServer, RunManager, RunService]]:
    async for value in _served(tmp_path):
        yield value


@pytest.fixture
async def keyed(tmp_path: Path) -> AsyncIterator[tuple[RoundServer, RunManager, RunService]]:
    async for value in _served(tmp_path, PEER_KEYS):
        yield value


def _count_journal_writes(runs: RunManager) -> list[int]:
    """Wrap the journal's register_many: the list gets each call's row count."""
    calls: list[int] = []
    journal = runs.registry._journal
    assert journal is not None
    original = journal.register_many

    def counted(rows: list[tuple[str, dict[str, object], float]]) -> None:
        calls.append(len(rows))
        original(rows)  # type: ignore[arg-type]

    journal.register_many = counted  # type: ignore[method-assign]
    return calls


async def test_a_virtual_federation_registers_trains_and_contributes_in_batches(
    served: tuple[RoundServer, RunManager, RunService],
) -> None:
    server, runs, _ = served
    calls = _count_journal_writes(runs)
    async with await VirtualClients.connect(
        "127.0.0.1", server.port, connections=2, key=KEY
    ) as pool:
        vruns = VirtualRuns(pool, max_batch=4)
        names = [f"v{i}" for i in range(6)]
        requests = server.stats.requests
        assert await vruns.register_many({n: {"num_samples": 10} for n in names}) == [None] * 6
        assert server.stats.requests - requests == 2  # 4 + 2 peers
        assert sorted(runs.registry.active()) == names
        lead = RunClient(pool.client_for("v0"))
        await lead.create_run("fl", RunSpec(per_round=4, rounds=1, seed=3), ModelUpdate(_model(0)))
        tasks = await vruns.tasks("fl", names, timeout=20)
        chosen = [(n, t) for n, t in zip(names, tasks, strict=True) if t is not None]
        assert len(chosen) == 4 and not any(isinstance(t, Exception) for t in tasks)
        statuses = await vruns.contribute_many(
            [RunContribution(n, t, _model(2.0), 10) for n, t in chosen]  # type: ignore[arg-type]
        )
        assert all(isinstance(s, Collecting | Complete) for s in statuses), statuses
        assert isinstance(await pool.wait(RoundId(1, "fl"), timeout=30), Complete)
    assert sum(calls) == 6 and len(calls) <= 2  # one transaction per batch at most
    final = await asyncio.to_thread(runs.wait_version, "fl", 1, 30)
    assert final.version == 1 and sorted(runs.versions("fl")[-1].participants) == sorted(
        n for n, _ in chosen
    )


async def test_items_are_refused_one_by_one(
    served: tuple[RoundServer, RunManager, RunService],
) -> None:
    server, _, _ = served
    async with await VirtualClients.connect("127.0.0.1", server.port, key=KEY) as pool:
        vruns = VirtualRuns(pool)
        outcomes = await vruns.register_many({"ok": {"num_samples": 1}, "bad": {"num_samples": -1}})
        assert outcomes[0] is None and isinstance(outcomes[1], InvalidRunSpec)
        lead = RunClient(pool.client_for("ok"))
        await lead.create_run("fl", RunSpec(per_round=1, rounds=1), ModelUpdate(_model(0)))
        tasks = await vruns.tasks("fl", ["ok", "stranger"], timeout=20)
        assert tasks[0] is not None and isinstance(tasks[1], NotRegistered)


async def test_concurrent_registrations_share_one_transaction(
    served: tuple[RoundServer, RunManager, RunService],
) -> None:
    _, runs, service = served
    calls = _count_journal_writes(runs)
    intake = service.batches.intake
    infos = await asyncio.gather(*(intake.register(f"p{i}", {"num_samples": i}) for i in range(50)))
    assert [i.name for i in infos] == [f"p{i}" for i in range(50)]
    assert calls == [50]  # queued in one loop turn: one journal transaction
    with pytest.raises(InvalidRunSpec):
        await intake.register("p1", {"num_samples": -1})
    assert runs.registry.get("p1") is not None and runs.registry.get("p1").facts == {  # type: ignore[union-attr]
        "num_samples": 1
    }


async def test_with_peer_keys_a_contribution_needs_its_peers_proof(
    keyed: tuple[RoundServer, RunManager, RunService],
) -> None:
    server, runs, _ = keyed
    names = [f"v{i}" for i in range(4)]
    keys = {n: PEER_KEYS[n] for n in names[:3]} | {"v3": b"not v3's key"}
    async with await VirtualClients.connect("127.0.0.1", server.port, key=KEY, keys=keys) as pool:
        vruns = VirtualRuns(pool)
        assert await vruns.register_many(names) == [None] * 4
        lead = RunClient(pool.client_for("v0"))
        await lead.create_run("fl", RunSpec(per_round=4, rounds=1, seed=1), ModelUpdate(_model(0)))
        tasks = await vruns.tasks("fl", names, timeout=20)
        assert all(t is not None and not isinstance(t, Exception) for t in tasks)
        items = [RunContribution(n, t, _model(1.0), 1) for n, t in zip(names, tasks, strict=True)]  # type: ignore[arg-type]
        outcomes = await vruns.contribute_many(items)
        assert all(isinstance(o, Collecting | Complete) for o in outcomes[:3]), outcomes
        assert isinstance(outcomes[3], PeerNotAuthorised)  # a wrong key: no contribution
        pool.keys.pop("v3")
        (missing,) = await vruns.contribute_many(items[3:])
        assert isinstance(missing, PeerNotAuthorised)  # a gateway without v3's key
        # the plain contribute op (no proof field) is refused on such a coordinator
        plain = RunClient(pool.client_for("v3"))
        with pytest.raises(PeerNotAuthorised, match="only proven"):
            update = Cid.parse(items[0].task.global_cid).to_bytes()
            await plain.call(ContributeRequest(peer="v3", run="fl", round=1, update=update))
    assert sorted(c.peer for c in runs.coordinator.contributions(RoundId(1, "fl"))) == names[:3]


def test_a_runs_batch_is_bounded_when_decoded() -> None:
    def body(**call: object) -> bytes:
        return msgspec.msgpack.encode(call)

    assert decode_batch(body(op="register_batch", items=[["a", {}]]))
    for bad in [
        body(op="register_batch", items=[]),
        body(op="register_batch", items=[["a", {}]] * (MAX_RUN_BATCH + 1)),
        body(op="register_batch", items=[["", {}]]),
        body(op="task_batch", run="fl", peers=["a"], timeout=-1.0),
        body(op="task_batch", run="", peers=["a"]),
        body(op="contribute_batch", run="fl", items=[["a", 1, b"not a cid"]]),
        body(op="contribute_batch", run="fl", items=[["a", 0, b""]]),
        body(op="unknown"),
        b"\xc1",
    ]:
        with pytest.raises(ProtocolViolation):
            decode_batch(bad)


def test_ten_thousand_registrations_cost_a_few_kib_each(tmp_path: Path) -> None:
    from tensorswap.runs.journal import RunDatabase

    journal = RunDatabase(tmp_path / "runs.sqlite3", durable=False)
    try:
        registry = ClientRegistry(journal, FakeClock())
        items = [(f"client-{i:05}", {"num_samples": i, "region": "eu"}) for i in range(10_000)]
        tracemalloc.start()
        try:
            before, _ = tracemalloc.get_traced_memory()
            outcomes = registry.register_many(items)
            after, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert not any(isinstance(o, Exception) for o in outcomes)
        per_client = (after - before - _outcomes_size(outcomes)) / len(items)
        assert per_client < 2048, per_client
        assert len(ClientRegistry(journal, FakeClock())) == 10_000  # all journaled
    finally:
        journal.close()


def _outcomes_size(outcomes: list[object]) -> int:
    """The returned list itself (its ClientInfos are the registry's own)."""
    import sys

    return sys.getsizeof(outcomes)


@pytest.mark.parametrize(
    "spec",
    [
        RunSpec(mode="async", buffer=2, rounds=1, seed=3),
        RunSpec(per_round=2, rounds=1, seed=3, dp_clip=1.0, dp_noise=0.0, dp_clipping="client"),
    ],
    ids=["async", "dp-client-clipping"],
)
async def test_with_peer_keys_a_run_client_proves_async_and_dp_contributions(
    keyed: tuple[RoundServer, RunManager, RunService], spec: RunSpec
) -> None:
    """Async deltas and DP contributions go through the runs app, not a rounds submit: with a
    peer key RunClient sends them with its proof (a one-item contribute_batch)."""
    server, _, _ = keyed
    peers = []
    for name in ("v0", "v1"):
        client = await RunClient.connect(
            "127.0.0.1", server.port, peer=name, key=KEY, peer_key=PEER_KEYS[name]
        )
        peers.append(client)
    try:
        for client in peers:
            await client.register({"num_samples": 1})
        await peers[0].create_run("fl", spec, ModelUpdate(_model(0)))
        impostor = await RunClient.connect("127.0.0.1", server.port, peer="v1", key=KEY)
        try:
            for client in peers:
                task = await client.next_task("fl", timeout=20)
                assert task is not None
                if client.peer == "v1":  # the same contribution without v1's key: refused
                    with pytest.raises(PeerNotAuthorised):
                        await impostor.submit(task, _model(0.5), num_samples=1)
                status = await client.submit(task, _model(0.5), num_samples=1)
                assert isinstance(status, Collecting | Complete)
        finally:
            await impostor.aclose()
        (v1,) = await peers[0].versions("fl", since=1, wait=20)
        assert v1.participant_count == 2
        if spec.dp_clip is not None:  # a DP run's sample is hidden from peers (runs.views)
            assert v1.hidden and v1.participants == [] and v1.you_took_part is True
        else:
            assert sorted(v1.participants) == ["v0", "v1"]
    finally:
        for client in peers:
            await client.aclose()
