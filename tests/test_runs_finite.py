"""Only finite global models: a step, a DP release or a round's aggregate that would publish
NaN or Inf is refused (typed, journaled), the run stays on its last finite version and goes
on; DP parameters are bounded; a non-finite initial model is refused at creation."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from tensorswap.cid import Cid
from tensorswap.rounds import Coordinator, FakeClock
from tensorswap.rounds.core import Complete, Failed, RoundId, RoundSpec
from tensorswap.rounds.journal import DB_FILENAME
from tensorswap.runs import (
    ClientRegistry,
    InvalidRunSpec,
    NonFiniteModel,
    NonFiniteStep,
    RunDatabase,
    RunManager,
    RunMode,
    RunSpec,
)
from tensorswap.store import MemoryStore, ModelUpdate, get_update, put_update

PEERS = ["a", "b", "c"]


@contextmanager
def federation(root: Path) -> Iterator[tuple[Coordinator, RunManager]]:
    clock = FakeClock()
    coord = Coordinator.open(root, clock=clock, run_timer=False, durable=False)
    journal = RunDatabase(root / DB_FILENAME, durable=False)
    manager = RunManager(coord, journal, ClientRegistry(journal, clock, inactive_after=60))
    for peer in PEERS:
        manager.registry.register(peer, {"num_samples": 10})
    try:
        yield coord, manager
    finally:
        manager.close()
        journal.close()
        coord.close()


def _put(coord: Coordinator, value: float, dtype: type = np.float32, n: int = 1) -> Cid:
    return put_update(coord.store, ModelUpdate({"w": np.full(8, value, dtype)}, n))


def _w(coord: Coordinator, cid: Cid | str) -> np.ndarray:
    return np.asarray(get_update(coord.store, Cid.parse(cid)).tensors["w"])


@pytest.mark.parametrize(
    ("dtype", "model", "delta"),
    [(np.float32, 3e38, 3.4e38), (np.float16, 6e4, 1e4)],  # streamed; whole models
)
def test_an_async_delta_that_would_overflow_the_model_is_refused_and_the_run_goes_on(
    tmp_path: Path, dtype: type, model: float, delta: float
) -> None:
    with federation(tmp_path) as (coord, manager):
        initial = _put(coord, model, dtype)
        manager.create_run("a", RunSpec(mode=RunMode.ASYNC, buffer=1), initial)
        manager.drain()
        with pytest.raises(NonFiniteStep) as refused:
            manager.submit(RoundId(1, "a"), "a", _put(coord, delta, dtype), trained_on=0)
        got = refused.value  # told to the peer whose delta filled the buffer
        assert (got.run, got.round, got.version, got.current) == ("a", 1, 1, 0)
        assert (got.stage, got.tensor, got.count, got.peers) == ("optimizer step", "w", 8, "'a'")
        manager.drain()
        info = manager.run("a")
        assert info.version == 0 and info.global_cid == initial  # the last finite one
        status = coord.status(RoundId(1, "a"))
        assert isinstance(status, Failed) and "non-finite" in status.reason
        assert [str(r) for r in manager.journal.refusals("a")] == [str(got)]
        task = manager.task("a", "b")  # the run keeps working: a new buffer, same version
        assert task is not None and task.version == 0 and task.round_id.round == 2
        manager.submit(task.round_id, "b", _put(coord, -model / 2, dtype), trained_on=0)
        info = manager.wait_version("a", 1, timeout=60)
        np.testing.assert_allclose(_w(coord, info.global_cid), model / 2, rtol=1e-3)


def test_a_sync_step_whose_optimizer_state_would_overflow_fails_the_round_with_why(
    tmp_path: Path,
) -> None:
    """FedAdam's second moment of a delta of 1e21 is 1e40: inf in float32, while the model
    itself stays finite. The state is published too (the next step reads it): refused."""
    spec = RunSpec(per_round=2, min_clients=2, seed=1, optimizer="fedadam")
    with federation(tmp_path) as (coord, manager):
        manager.create_run("s", spec, _put(coord, 0.0))
        manager.drain()
        sampled = manager.run("s").selected
        for peer in sampled:
            manager.submit(RoundId(1, "s"), peer, _put(coord, 1e21, n=10))
        status = coord.wait(RoundId(1, "s"), timeout=60)
        assert isinstance(status, Failed)
        assert "optimizer state" in status.reason and "'v/w'" in status.reason
        assert all(repr(p) in status.reason for p in sampled)  # the peers are told why
        manager.drain()
        (refused,) = manager.journal.refusals("s", 1)
        assert refused.stage == "optimizer state" and refused.tensor == "v/w"
        info = manager.run("s")
        assert info.version == 0 and info.round == 2  # a new round from the same version
        for peer in info.selected:
            manager.submit(RoundId(2, "s"), peer, _put(coord, 1.0, n=10))
        info = manager.wait_version("s", 1, timeout=60)
        assert np.isfinite(_w(coord, info.global_cid)).all()
        assert [v.round for v in manager.versions("s")] == [0, 2]


def test_a_refused_step_is_not_redone_into_a_version_after_a_restart(tmp_path: Path) -> None:
    with federation(tmp_path) as (coord, manager):
        manager.create_run("a", RunSpec(mode=RunMode.ASYNC, buffer=1), _put(coord, 3e38))
        manager.drain()
        with pytest.raises(NonFiniteStep):
            manager.submit(RoundId(1, "a"), "a", _put(coord, 3.4e38), trained_on=0)
        manager.drain()
    with federation(tmp_path) as (coord, manager):
        manager.drain()
        info = manager.run("a")
        assert info.version == 0 and info.round == 2
        assert len(manager.journal.refusals("a")) == 1


def test_a_non_finite_dp_release_is_refused_and_spends_no_epsilon(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("dp_accounting")
    from tensorswap.privacy import dp

    real = dp.add_noise

    def broken(values: np.ndarray, *args: object) -> np.ndarray:
        out = real(values, *args)  # type: ignore[arg-type]
        out.reshape(-1)[0] = np.inf
        return out

    spec = RunSpec(per_round=2, min_clients=2, seed=2, dp_clip=1.0, dp_noise=0.5)
    with federation(tmp_path) as (coord, manager):
        manager.create_run("dp", spec, _put(coord, 0.0))
        manager.drain()
        monkeypatch.setattr(dp, "add_noise", broken)
        for peer in manager.run("dp").selected:
            task = manager.task("dp", peer)
            assert task is not None
            manager.submit(task.round_id, peer, _put(coord, 0.1), trained_on=0)
        status = coord.wait(RoundId(1, "dp"), timeout=60)
        assert isinstance(status, Failed) and "DP release" in status.reason
        manager.drain()
        assert manager.privacy.steps("dp") == []  # nothing released: no epsilon spent
        assert manager.run("dp").version == 0 and manager.run("dp").round == 2
        monkeypatch.setattr(dp, "add_noise", real)
        for peer in manager.run("dp").selected:
            manager.submit(RoundId(2, "dp"), peer, _put(coord, 0.1), trained_on=0)
        info = manager.wait_version("dp", 1, timeout=60)
        assert np.isfinite(_w(coord, info.global_cid)).all()


@pytest.mark.parametrize(
    "options",
    [
        {"dp_noise": 1e39},
        {"dp_noise": 1e300},
        {"dp_noise": 2e6},
        {"dp_clip": 1e10},
        {"dp_adaptive": True, "dp_clip_norm_lr": 100.0, "dp_noise": 0.0},
        {"dp_adaptive": True, "dp_clipped_count_stddev": 1e7},
    ],
)
def test_dp_parameters_are_bounded_at_creation(options: dict[str, object]) -> None:
    given = {"dp_clip": 1.0, **options}
    with pytest.raises(InvalidRunSpec, match="must be <="):
        RunSpec(per_round=2, **given)  # type: ignore[arg-type]


def test_dp_noise_too_large_for_the_model_is_refused_at_create_run(tmp_path: Path) -> None:
    spec = RunSpec(per_round=2, dp_clip=1e9, dp_noise=1e6)  # both at their bounds
    with federation(tmp_path) as (coord, manager):
        big = put_update(coord.store, ModelUpdate({"w": np.zeros(1_000_001, np.float32)}))
        with pytest.raises(InvalidRunSpec, match=r"sqrt\(1000001\)"):
            manager.create_run("big", spec, big)
        assert manager.runs() == []
        manager.create_run("small", spec, _put(coord, 0.0))  # 1e15 x sqrt(8): inside


def test_an_adaptive_clip_never_overflows() -> None:
    from tensorswap.privacy.dp import next_clip
    from tensorswap.runs.dp_params import MAX_DP_CLIP

    # a noised clipped fraction far above 1 (count noise of 1e6 over 2 peers)
    assert next_clip(1.0, 5e5, 0.5, 10.0, MAX_DP_CLIP) == MAX_DP_CLIP
    assert next_clip(1.0, -5e5, 0.5, 10.0, MAX_DP_CLIP) == 0.0
    assert next_clip(0.5, 1.0, 0.5, 0.2) == pytest.approx(0.5 * math.exp(0.1))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_initial_model_is_refused_naming_the_tensor(
    tmp_path: Path, bad: float
) -> None:
    with federation(tmp_path) as (coord, manager):
        values = {"w": np.zeros(8, np.float32), "b": np.array([0, bad, bad], np.float32)}
        initial = put_update(coord.store, ModelUpdate(values))
        with pytest.raises(NonFiniteModel, match="'b'") as refused:
            manager.create_run("r", RunSpec(), initial)
        assert (refused.value.run, refused.value.tensor, refused.value.count) == ("r", "b", 2)
        assert manager.runs() == [] and manager.journal.load_runs() == []


def test_a_round_aggregate_that_is_not_finite_fails_the_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A backstop under every round (a region's fold, a plain round, a run's buffer): the
    aggregate is checked before it is stored and named. The aggregators already refuse an
    accumulator that overflows; a result that is not finite all the same is refused here."""
    from tensorswap.aggregate import streaming

    real = streaming.StreamingAccumulator.result

    def poisoned(self: streaming.StreamingAccumulator, *, consume: bool = False) -> object:
        out = real(self, consume=consume)
        for piece in out.values.values():  # type: ignore[union-attr]
            piece.reshape(-1)[-1] = np.nan
        return out

    monkeypatch.setattr(streaming.StreamingAccumulator, "result", poisoned)
    with Coordinator(MemoryStore(), run_timer=False) as coord:
        rid = RoundId(1, "plain")
        coord.start_round(rid, RoundSpec(2))
        for i, peer in enumerate(("p", "q")):
            update = ModelUpdate({"w": np.full(4, 1.0 + i, np.float32)}, 1)
            coord.submit(rid, peer, put_update(coord.store, update))
        status = coord.wait(rid, timeout=60)
        assert isinstance(status, Failed) and "NaN or Inf" in status.reason
        assert "'p', 'q'" in status.reason and not isinstance(status, Complete)


async def test_a_secure_release_whose_step_would_overflow_fails_the_round(
    tmp_path: Path,
) -> None:
    """SecAgg+: the unmasked sum is released through the same hook; a step that would not
    be finite fails the secure round with the refusal, and the run samples a new round."""
    pytest.importorskip("cryptography")
    import asyncio

    from tensorswap.rounds.server import RoundServer
    from tensorswap.runs.client import RunClient
    from tensorswap.runs.service import RunService

    key = b"finite-secagg-key"
    coord = Coordinator.open(tmp_path, clock=FakeClock(), durable=False)
    runs = RunManager.open(coord, durable=False)
    server = RoundServer(coord, key=key, max_wait=30)
    RunService(runs, server)
    await server.start("127.0.0.1", 0)
    peers = [
        await RunClient.connect("127.0.0.1", server.port, peer=f"p{i}", key=key) for i in range(3)
    ]
    try:
        for peer in peers:
            await peer.register({"num_samples": 10})
        spec = RunSpec(
            per_round=3,
            min_clients=3,
            secagg=True,
            secagg_clip=1.0,
            optimizer="fedavgm",
            optimizer_params={"server_learning_rate": 1e39},  # finite, if absurd
        )
        await peers[0].create_run("fl", spec, ModelUpdate({"w": np.ones(8, np.float32)}))

        async def train(client: RunClient) -> object:
            task = await client.next_task("fl", timeout=30)
            assert task is not None and task.secagg
            model = await client.fetch_model(task)
            try:
                return await client.submit(task, {"w": model["w"] + 0.5}, num_samples=10)
            except Exception as exc:  # what a peer is told, whichever way
                return exc

        told = await asyncio.gather(*(train(p) for p in peers))
        status = coord.status(RoundId(1, "fl"))
        assert isinstance(status, Failed), told
        assert "secure aggregation" in status.reason and "SecAgg release" not in status.reason
        assert "optimizer step" in status.reason and "non-finite" in status.reason
        assert any("non-finite" in str(t) for t in told), told  # the last to unmask hears
        await asyncio.to_thread(runs.drain, 60)
        info = runs.run("fl")
        assert info.version == 0 and info.round == 2
        (refused,) = runs.journal.refusals("fl")
        assert refused.stage == "optimizer step" and refused.round == 1
    finally:
        for peer in peers:
            await peer.aclose()
        await server.aclose()
        runs.close()
        coord.close()
