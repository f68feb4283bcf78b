"""Federated runs over the coordinator: a global model across rounds, sampling, the server
optimizer, every decision journaled so a restart resumes with identical state."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from tensorswap.cid import Cid
from tensorswap.rounds import Coordinator, FakeClock
from tensorswap.rounds.core import Complete, RoundId
from tensorswap.rounds.journal import DB_FILENAME
from tensorswap.runs import (
    ClientRegistry,
    InvalidRunSpec,
    NotRegistered,
    NotSelected,
    RunDatabase,
    RunExists,
    RunManager,
    RunMode,
    RunSpec,
    StaleContribution,
    sample_peers,
)
from tensorswap.store import ModelUpdate, get_update, put_update

PEERS = [f"site-{i}" for i in range(6)]


def _model(value: float) -> dict[str, np.ndarray]:
    return {
        "w": np.full((8, 4), value, np.float32),
        "b": np.linspace(0, value, 4, dtype=np.float32),
    }


@contextmanager
def federation(root: Path, clock: FakeClock) -> Iterator[tuple[Coordinator, RunManager]]:
    coord = Coordinator.open(root, clock=clock, run_timer=False, durable=False)
    journal = RunDatabase(root / DB_FILENAME, durable=False)
    registry = ClientRegistry(journal, clock, inactive_after=60)
    manager = RunManager(coord, journal, registry)
    try:
        yield coord, manager
    finally:
        manager.close()
        journal.close()
        coord.close()


def _train(coord: Coordinator, global_cid: str, peer: str) -> Cid:
    """A peer's local training, deterministic: the global model plus a peer-specific step."""
    base = get_update(coord.store, Cid.parse(global_cid)).tensors
    bump = 1.0 + PEERS.index(peer) / 10
    values = {k: np.asarray(v) + np.float32(bump) for k, v in base.items()}
    return put_update(coord.store, ModelUpdate(values, 10 + PEERS.index(peer)))


def _play_round(coord: Coordinator, manager: RunManager, run: str) -> list[str]:
    """Every peer asks for its task; the sampled ones train and submit, in name order."""
    done = []
    for peer in PEERS:
        task = manager.task(run, peer)
        if task is None:
            continue
        manager.submit(task.round_id, peer, _train(coord, task.global_cid, peer))
        done.append(peer)
    return done


def _register_all(manager: RunManager) -> None:
    for peer in PEERS:
        manager.registry.register(peer, {"num_samples": 10})


def test_sampling_is_a_function_of_seed_round_and_active_peers() -> None:
    first = sample_peers(PEERS, 3, seed=7, round=1)
    assert first == sample_peers(list(reversed(PEERS)), 3, seed=7, round=1)
    assert len(set(first)) == 3 and set(first) <= set(PEERS)
    picks = {sample_peers(PEERS, 3, seed=7, round=r) for r in range(1, 30)}
    assert len(picks) > 5  # rounds differ
    assert sample_peers(PEERS, 6, seed=1, round=1) == tuple(sorted(PEERS))
    with pytest.raises(ValueError):
        sample_peers(PEERS, 7, seed=1, round=1)


def test_run_specs_are_validated_and_round_trip_through_json() -> None:
    spec = RunSpec(per_round=3, optimizer="fedadam", optimizer_params={"eta": 0.1}, seed=4)
    assert RunSpec.from_json(spec.to_json()) == spec
    assert spec.sample_size(10) == 3 and spec.sample_size(2) == 2
    assert RunSpec(fraction=0.25, min_clients=2).sample_size(20) == 5
    assert RunSpec(fraction=0.01, min_clients=2).sample_size(20) == 2
    assert RunSpec(quorum=0.5).quorum_of(5) == 3
    assert RunSpec(mode="async").scale_for(3) == pytest.approx(0.5)
    for bad in (
        {"per_round": 0},
        {"per_round": 2, "fraction": 0.5},
        {"fraction": 1.5},
        {"quorum": 0},
        {"mode": "sometimes"},
        {"per_round": 1, "min_clients": 2},
        {"max_staleness": -1},
    ):
        with pytest.raises(InvalidRunSpec):
            RunSpec(**bad)  # type: ignore[arg-type]


def test_registered_peers_go_inactive_without_heartbeats(tmp_path: Path) -> None:
    clock = FakeClock()
    journal = RunDatabase(tmp_path / "runs.sqlite3")
    registry = ClientRegistry(journal, clock, inactive_after=30)
    registry.register("a", {"num_samples": 5, "tags": "gpu"})
    registry.register("b")
    clock.advance(20)
    registry.seen("a")
    clock.advance(15)
    assert registry.active() == ["a"]
    with pytest.raises(NotRegistered):
        registry.seen("stranger")
    with pytest.raises(InvalidRunSpec):
        registry.register("c", {f"k{i}": i for i in range(17)})
    with pytest.raises(InvalidRunSpec):
        registry.register("c", {"num_samples": -1})
    journal.close()
    again = ClientRegistry(RunDatabase(tmp_path / "runs.sqlite3"), clock, inactive_after=30)
    assert again.active() == ["a", "b"]  # a restart gives everyone a fresh period
    assert dict(again.get("a").facts) == {"num_samples": 5, "tags": "gpu"}  # type: ignore[union-attr]


def test_a_sync_run_samples_peers_and_steps_the_global_model(tmp_path: Path) -> None:
    clock = FakeClock()
    with federation(tmp_path, clock) as (coord, manager):
        initial = put_update(coord.store, ModelUpdate(_model(0.0)))
        spec = RunSpec(per_round=3, rounds=3, seed=11, optimizer="fedavg")
        _register_all(manager)
        manager.create_run("mnist", spec, initial)
        assert manager.create_run("mnist", spec, initial).name == "mnist"  # idempotent
        with pytest.raises(RunExists):
            manager.create_run("mnist", RunSpec(per_round=2), initial)
        for bad in (
            RunSpec(optimizer="sgd"),
            RunSpec(strategy="vote"),
            RunSpec(optimizer_params={"eta": -1}),
        ):
            with pytest.raises(InvalidRunSpec):
                manager.create_run("other", bad, initial)
        for version in (1, 2, 3):
            manager.drain()
            info = manager.run("mnist")
            outsider = next(p for p in PEERS if p not in info.selected)
            assert manager.task("mnist", outsider) is None
            with pytest.raises(NotSelected, match=outsider):
                manager.submit(RoundId(info.round, "mnist"), outsider, initial)
            played = _play_round(coord, manager, "mnist")
            assert played == list(info.selected) and len(played) == 3
            assert played == list(sample_peers(PEERS, 3, 11, info.round))
            manager.wait_version("mnist", version, timeout=60)
        final = manager.run("mnist")
        assert final.finished and final.version == 3
        versions = manager.versions("mnist")
        assert [v.version for v in versions] == [0, 1, 2, 3]
        assert all(len(v.participants) == 3 for v in versions[1:])
        # fedavg: the new global model is the round's aggregate, exactly
        last_round = RoundId(final.round, "mnist")
        status = coord.status(last_round)
        assert isinstance(status, Complete)
        np.testing.assert_array_equal(
            get_update(coord.store, Cid.parse(final.global_cid)).tensors["w"],
            get_update(coord.store, Cid.parse(status.cid)).tensors["w"],
        )


def test_a_run_waits_for_min_clients_then_starts(tmp_path: Path) -> None:
    clock = FakeClock()
    with federation(tmp_path, clock) as (coord, manager):
        initial = put_update(coord.store, ModelUpdate(_model(0.0)))
        manager.create_run("r", RunSpec(per_round=2, min_clients=2), initial)
        manager.drain()
        assert manager.run("r").round == 0
        manager.registry.register("site-0")
        manager.drain()
        assert manager.run("r").round == 0
        manager.registry.register("site-1")
        manager.drain()
        assert manager.run("r").round == 1
        assert manager.run("r").selected == ("site-0", "site-1")


def _finish(root: Path, crash_in_round: int | None) -> str:
    """Five rounds of fedadam; with ``crash_in_round``, the process 'dies' after that round's
    aggregate is stored and before the optimizer steps it, and a new one resumes."""
    clock = FakeClock()
    spec = RunSpec(
        per_round=4, rounds=5, seed=3, optimizer="fedadam", optimizer_params={"eta": 0.05}
    )
    with federation(root, clock) as (coord, manager):
        _register_all(manager)
        manager.create_run("fl", spec, put_update(coord.store, ModelUpdate(_model(0.5))))
        for version in range(1, 6):
            manager.drain()
            if version == crash_in_round:
                manager.close()  # dies: the step of this round never runs in this process
                _play_round(coord, manager, "fl")
                status = coord.wait(RoundId(manager.run("fl").round, "fl"), timeout=60)
                assert isinstance(status, Complete) and manager.run("fl").version == version - 1
                break
            _play_round(coord, manager, "fl")
            manager.wait_version("fl", version, timeout=60)
        else:
            return manager.run("fl").global_cid
    assert crash_in_round is not None
    with federation(root, clock) as (coord, manager):  # a new process over the same files
        manager.wait_version("fl", crash_in_round, timeout=60)  # the step, redone
        for version in range(crash_in_round + 1, 6):
            manager.drain()
            _play_round(coord, manager, "fl")
            manager.wait_version("fl", version, timeout=60)
        info = manager.run("fl")
        assert info.finished and info.version == 5
        assert [v.version for v in manager.versions("fl")] == [0, 1, 2, 3, 4, 5]
        assert info.state_cid is not None  # fedadam's moments, journaled as blocks
        return info.global_cid


def test_a_restart_between_aggregate_and_step_gives_the_same_final_model(
    tmp_path: Path,
) -> None:
    straight = _finish(tmp_path / "straight", None)
    resumed = _finish(tmp_path / "resumed", 3)
    assert resumed == straight


def test_an_async_run_steps_every_buffer_contributions_with_staleness(tmp_path: Path) -> None:
    clock = FakeClock()
    with federation(tmp_path, clock) as (coord, manager):
        initial = put_update(coord.store, ModelUpdate(_model(0.0)))
        spec = RunSpec(mode=RunMode.ASYNC, buffer=2, max_staleness=1, rounds=3)
        _register_all(manager)
        manager.create_run("a", spec, initial)
        manager.drain()
        delta = put_update(coord.store, ModelUpdate({k: v + 1 for k, v in _model(0.0).items()}, 1))
        zeros = _model(0.0)
        with pytest.raises(ValueError, match="trained_on"):
            manager.submit(RoundId(1, "a"), "site-0", delta)
        manager.submit(RoundId(1, "a"), "site-0", delta, trained_on=0)
        manager.submit(RoundId(1, "a"), "site-1", delta, trained_on=0)
        info = manager.wait_version("a", 1, timeout=60)
        manager.drain()
        got = get_update(coord.store, Cid.parse(info.global_cid)).tensors["w"]
        np.testing.assert_allclose(got, zeros["w"] + 1)  # fresh deltas: scale 1
        task = manager.task("a", "site-2")
        assert task is not None and task.version == 1 and task.mode is RunMode.ASYNC
        manager.submit(task.round_id, "site-2", delta, trained_on=0)  # one version behind
        manager.submit(task.round_id, "site-3", delta, trained_on=1)
        info = manager.wait_version("a", 2, timeout=60)
        manager.drain()
        got = get_update(coord.store, Cid.parse(info.global_cid)).tensors["w"]
        np.testing.assert_allclose(got, zeros["w"] + 1 + (1 / np.sqrt(2) + 1) / 2, rtol=1e-6)
        assert manager.versions("a")[2].staleness == (1, 0)
        with pytest.raises(StaleContribution, match="version 0"):
            manager.submit(RoundId(3, "a"), "site-4", delta, trained_on=0)  # two behind


def test_a_collection_never_falls_between_storing_a_version_and_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retention with no grace at all: the new global model is a block no root names until the
    step records it, so the step runs with collections held off (``no_collection``); one
    started meanwhile waits, then keeps the model. (It once deleted it, and the run stopped.)
    The step is made at the round's release (``runs.publish``), and the version it holds
    is a root until the manager records it."""
    import threading

    from tensorswap.runs import publish as manager_module

    clock = FakeClock()
    coord = Coordinator.open(
        tmp_path, clock=clock, run_timer=False, durable=False, keep_rounds=1, gc_grace=0.0
    )
    journal = RunDatabase(tmp_path / DB_FILENAME, durable=False)
    manager = RunManager(coord, journal, ClientRegistry(journal, clock, inactive_after=60))
    real, collections = manager_module.apply_step, []

    def step_then_collect(*args: object, **kwargs: object) -> object:
        record = real(*args, **kwargs)  # type: ignore[arg-type]
        with pytest.raises(RuntimeError, match="wait for itself"):  # held off, shared
            coord.collect_garbage(1, grace=0.0, dry_run=True)
        worker = threading.Thread(target=coord.collect_garbage, args=(1,), kwargs={"grace": 0.0})
        worker.start()  # it waits for the step to record the version
        collections.append(worker)
        return record

    monkeypatch.setattr(manager_module, "apply_step", step_then_collect)
    try:
        initial = put_update(coord.store, ModelUpdate(_model(0.0)))
        _register_all(manager)
        manager.create_run("mnist", RunSpec(per_round=3, rounds=3, seed=5), initial)
        for version in (1, 2, 3):
            manager.drain()
            _play_round(coord, manager, "mnist")
            manager.wait_version("mnist", version, timeout=60)
            for worker in collections:
                worker.join(60)
            # the round's end queued a collection too (keep_rounds, no grace): let it run
            # before the next round's updates are stored, or it may take them for garbage
            coord.drain_collections(60)
            current = manager.run("mnist").global_cid
            assert get_update(coord.store, Cid.parse(current)).tensors["w"].shape == (8, 4)
        assert manager.run("mnist").finished and len(collections) == 3
    finally:
        manager.close()
        journal.close()
        coord.close()
