"""Differential privacy for runs: DP-FedAvg's clipping, noise and adaptive clipping against
Flower's formulas, ε from dp-accounting, and DP runs that journal ε, resume without a second
noise draw, stop at their budget and refuse over-norm client updates."""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from tensorswap.cid import Cid
from tensorswap.privacy import (
    ClipBoundExceeded,
    PrivacyBudgetExhausted,
    PrivacyError,
    adaptive_noise,
    clip_factor,
    clip_update,
    epsilon,
    next_clip,
    noise_std,
    round_epsilons,
    secure_generator,
    update_norm,
)
from tensorswap.rounds import Coordinator, FakeClock
from tensorswap.rounds.core import Complete, RoundId
from tensorswap.rounds.journal import DB_FILENAME
from tensorswap.runs import (
    ClientRegistry,
    FutureVersion,
    InvalidRunSpec,
    RunDatabase,
    RunManager,
    RunsError,
    RunSpec,
)
from tensorswap.runs.views import row_of
from tensorswap.store import ModelUpdate, get_update, put_update

dp_accounting = pytest.importorskip("dp_accounting")

PEERS = [f"site-{i}" for i in range(6)]


# ── the arithmetic, against Flower 1.42's formulas ──────────────────────────
def test_noise_std_is_flowers_compute_stdv() -> None:
    # flwr.supercore.differential_privacy.compute_stdv(1.3, 0.5, 8) == 0.08125
    assert noise_std(1.3, 0.5, 8) == pytest.approx(0.08125)
    assert noise_std(0.0, 2.0, 3) == 0.0
    with pytest.raises(ValueError):
        noise_std(1.0, 1.0, 0)


def test_clipping_is_flowers_flat_clip() -> None:
    update = {"a": np.array([3.0, 0.0], np.float32), "b": np.array([[4.0]], np.float32)}
    assert update_norm(update) == pytest.approx(5.0)
    clipped, bit = clip_update(update, 1.0)  # Flower: scaling_factor = min(1, 1 / 5)
    assert bit is True and update_norm(clipped) == pytest.approx(1.0, rel=1e-6)
    np.testing.assert_allclose(clipped["a"], [0.6, 0.0], rtol=1e-6)
    assert clipped["a"].dtype == np.float32
    same, bit = clip_update(update, 10.0)
    assert bit is False and same["b"][0, 0] == 4.0
    assert clip_factor(0.0, 1.0) == 1.0 and clip_factor(math.nan, 1.0) == 1.0


def test_adaptive_noise_split_is_flowers() -> None:
    # compute_adaptive_noise_params(1.0, 100, None) == (5.0, (1 - 1 / 100) ** -0.5)
    assert adaptive_noise(1.0, 100 / 20) == pytest.approx(1.005037815259212)
    assert adaptive_noise(0.0, 5.0) == 0.0
    with pytest.raises(ValueError):
        adaptive_noise(2.0, 1.0)  # Flower: ValueError, noise_multiplier >= 2 * stddev


def test_adaptive_clip_follows_andrew_et_al_and_converges_to_the_quantile() -> None:
    # Andrew et al.: C exp(-lr (b - gamma)), b the unclipped fraction: 0.8 unclipped, gamma 0.5
    assert next_clip(1.0, 0.2, 0.5, 0.2) == pytest.approx(math.exp(-0.2 * (0.8 - 0.5)))
    norms = np.linspace(1.0, 10.0, 100)
    clip = 0.1
    for _ in range(300):
        clip = next_clip(clip, float(np.mean(norms > clip)), 0.25, 0.2)
    assert float(np.mean(norms > clip)) == pytest.approx(0.25, abs=0.03)  # a quarter clipped


def test_noise_is_gaussian_from_a_secure_generator() -> None:
    from tensorswap.runs.stream import stream_noised
    from tensorswap.store import MemoryStore, ModelUpdate, get_update, put_update

    store = MemoryStore()
    zeros = put_update(store, ModelUpdate({"w": np.zeros((200, 100), np.float32)}))

    def draw() -> np.ndarray:
        cid = stream_noised(store, zeros, 1.0, 0.5, secure_generator(), metadata={}, name="n")
        return np.asarray(get_update(store, cid).tensors["w"])

    one, two = draw(), draw()
    assert one.dtype == np.float32 and not np.array_equal(one, two)  # fresh seeds each time
    assert float(one.std()) == pytest.approx(0.5, rel=0.05)
    assert abs(float(one.mean())) < 0.02


# ── accounting ───────────────────────────────────────────────────────────────
def test_epsilon_is_dp_accountings_composition() -> None:
    from dp_accounting import rdp

    from tensorswap.privacy.accountant import RDP_ORDERS

    eps = round_epsilons(1.1, [0.1] * 20, 1e-5)
    assert all(b > a for a, b in itertools.pairwise(eps))  # grows every round
    direct = rdp.RdpAccountant(list(RDP_ORDERS))
    direct.compose(dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(1.1)), 20)
    assert eps[-1] == pytest.approx(direct.get_epsilon(1e-5), rel=1e-12)
    default = rdp.RdpAccountant()  # dp-accounting's own orders agree where ε is useful
    default.compose(
        dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(1.1)), 20
    )
    assert eps[-1] == pytest.approx(default.get_epsilon(1e-5), rel=1e-3)
    mixed = rdp.RdpAccountant(list(RDP_ORDERS))
    for q in (0.1, 0.5, 0.1):
        mixed.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(1.1)))
    assert epsilon(1.1, [0.1, 0.5, 0.1], 1e-5) == pytest.approx(mixed.get_epsilon(1e-5))
    assert epsilon(1.1, [], 1e-5) == 0.0 and epsilon(0.0, [0.1], 1e-5) == math.inf
    assert epsilon(1.1, [1.0], 1e-5) > epsilon(1.1, [0.5], 1e-5)  # sampling amplifies


# ── the spec ─────────────────────────────────────────────────────────────────
def test_dp_options_are_validated_and_round_trip() -> None:
    spec = RunSpec(per_round=3, dp_clip=0.5, dp_noise=1.0, dp_max_epsilon=8.0)
    assert RunSpec.from_json(spec.to_json()) == spec
    old = json.loads(RunSpec(per_round=3).to_json())
    for key in [k for k in old if k.startswith("dp_")]:
        del old[key]
    assert RunSpec.from_json(json.dumps(old)).dp_clip is None  # an old spec: no DP
    for bad in (
        {"dp_noise": 1.0},  # no dp_clip
        {"dp_clip": 0.0},
        {"dp_clip": 1.0, "dp_noise": -1.0},
        {"dp_clip": 1.0, "dp_delta": 1.0},
        {"dp_clip": 1.0, "dp_clipping": "peer"},
        {"dp_clip": 1.0, "dp_max_epsilon": 0},
        {"dp_clip": 1.0, "dp_target_clipped_quantile": 1.5},
        {"dp_clip": 1.0, "mode": "async"},
        {"dp_clip": 1.0, "strategy": "median"},
        {"dp_clip": 1.0, "params": {"max_norm": 2.0}},
        {"dp_clip": 1.0, "dp_adaptive": True, "dp_noise": 1.0, "min_clients": 4},  # 4/20
    ):
        with pytest.raises(InvalidRunSpec):
            RunSpec(**bad)  # type: ignore[arg-type]
    RunSpec(dp_clip=1.0, dp_adaptive=True, dp_noise=1.0, dp_clipped_count_stddev=1.0)


# ── runs ─────────────────────────────────────────────────────────────────────
def _model(value: float) -> dict[str, np.ndarray]:
    return {"w": np.full((8, 4), value, np.float32), "b": np.full(4, value, np.float32)}


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


def _delta(coord: Coordinator, peer: str, size: float) -> Cid:
    """A peer's delta: every value ``size`` times a peer-specific factor (norm 6 x that)."""
    bump = size * (1.0 + PEERS.index(peer) / 10)
    return put_update(coord.store, ModelUpdate({k: v + bump for k, v in _model(0.0).items()}))


def _play(coord: Coordinator, manager: RunManager, run: str, size: float = 1.0) -> list[str]:
    done = []
    for peer in PEERS:
        task = manager.task(run, peer)
        if task is None:
            continue
        manager.submit(task.round_id, peer, _delta(coord, peer, size), trained_on=task.version)
        done.append(peer)
    return done


def _start(coord: Coordinator, manager: RunManager, spec: RunSpec) -> None:
    for peer in PEERS:
        manager.registry.register(peer, {"num_samples": 10})
    manager.create_run("dp", spec, put_update(coord.store, ModelUpdate(_model(0.5))))
    manager.drain()


SPEC = RunSpec(per_round=3, rounds=3, seed=5, dp_clip=0.5, dp_noise=1.0, dp_delta=1e-5)


def test_a_dp_run_clips_noises_and_journals_epsilon_per_version(tmp_path: Path) -> None:
    with federation(tmp_path, FakeClock()) as (coord, manager):
        _start(coord, manager, SPEC)
        peer = manager.run("dp").selected[0]
        task = manager.task("dp", peer)
        assert task is not None and task.dp == "server" and task.clip == 0.5
        with pytest.raises(RunsError, match="differentially private"):  # a full model, directly
            coord.submit(task.round_id, peer, task.global_cid)
        noise: list[np.ndarray] = []
        for version in (1, 2, 3):
            before = manager.run("dp")
            played = _play(coord, manager, "dp")
            assert len(played) == 3
            after = manager.wait_version("dp", version, timeout=60)
            manager.drain()
            status = coord.status(RoundId(before.round, "dp"))
            assert isinstance(status, Complete)
            # the round is Complete with its noised aggregate: the clean one is never named
            assert status.cid == manager.privacy.steps("dp")[-1].noised_cid
            clipped = [
                clip_update(get_update(coord.store, _delta(coord, p, 1.0)).tensors, 0.5)[0]["w"]
                for p in played
            ]
            mean = np.mean(clipped, axis=0)  # the clipped mean (unweighted)
            assert float(np.linalg.norm(mean)) <= 0.5 + 1e-5
            old = get_update(coord.store, Cid.parse(before.global_cid)).tensors["w"]
            new = get_update(coord.store, Cid.parse(after.global_cid)).tensors["w"]
            moved = new - old
            assert not np.allclose(moved, mean)  # noise of std 1.0 * 0.5 / 3 was added
            noise.append((moved - mean).reshape(-1))
        drawn = np.concatenate(noise)  # 96 draws: their std within 7 standard errors
        assert float(np.std(drawn)) == pytest.approx(1 / 6, rel=0.5)
        steps = manager.privacy.steps("dp")
        assert [s.round for s in steps] == [1, 2, 3]
        assert all(s.noise_std == pytest.approx(1 / 6) for s in steps)
        assert all(s.rate == 0.5 and s.clipped == 3 and s.contributors == 3 for s in steps)
        assert [s.epsilon for s in steps] == pytest.approx(round_epsilons(1.0, [0.5] * 3, 1e-5))
        row = row_of(manager, manager.run("dp"))
        assert row.epsilon == pytest.approx(steps[-1].epsilon) and row.dp_delta == 1e-5
        assert row.stop_reason == ""


def test_a_restart_reuses_the_journaled_noise(tmp_path: Path) -> None:
    """The process dies after round 2's noised aggregate is journaled, before the optimizer
    steps it: the new process steps that very aggregate (no second draw), same ε."""
    clock = FakeClock()
    with federation(tmp_path, clock) as (coord, manager):
        _start(coord, manager, SPEC)
        _play(coord, manager, "dp")
        manager.wait_version("dp", 1, timeout=60)
        manager.drain()
        info = manager.run("dp")
        manager.close()  # dies: round 2's step never runs in this process
        _play(coord, manager, "dp")
        rid = RoundId(info.round, "dp")
        status = coord.wait(rid, timeout=60)
        assert isinstance(status, Complete)
        kept = coord.contributions(rid)
        noised = manager.privacy.noised_aggregate(coord.store, info, Cid.parse(status.cid), kept)
        journaled = manager.privacy.steps("dp")
    with federation(tmp_path, clock) as (coord, manager):
        manager.wait_version("dp", 2, timeout=60)
        manager.drain()
        steps = manager.privacy.steps("dp")
        assert steps == journaled and steps[-1].noised_cid == str(noised)
        old = get_update(coord.store, Cid.parse(info.global_cid)).tensors
        new = get_update(coord.store, Cid.parse(manager.run("dp").global_cid)).tensors
        delta = get_update(coord.store, noised).tensors
        for name in old:  # fedavg: the new global model is the old one plus that delta
            np.testing.assert_array_equal(new[name], old[name] + delta[name])
        _play(coord, manager, "dp")
        manager.wait_version("dp", 3, timeout=60)
        assert manager.privacy.steps("dp")[:2] == journaled


def test_a_run_stops_before_the_round_that_would_exceed_its_budget(tmp_path: Path) -> None:
    eps = round_epsilons(1.0, [0.5] * 3, 1e-5)
    limit = (eps[1] + eps[2]) / 2  # two rounds fit, the third does not
    spec = RunSpec(per_round=3, seed=5, dp_clip=0.5, dp_noise=1.0, dp_max_epsilon=limit)
    with federation(tmp_path, FakeClock()) as (coord, manager):
        _start(coord, manager, spec)
        for version in (1, 2):
            manager.drain()
            _play(coord, manager, "dp")
            manager.wait_version("dp", version, timeout=60)
        manager.drain()
        info = manager.run("dp")
        assert info.finished and info.version == 2 and info.round == 2
        reason = manager.privacy.stop_reason("dp")
        assert "budget exhausted" in reason and f"{limit:.4g}" in reason
        assert row_of(manager, info).stop_reason == reason
        with pytest.raises(PrivacyBudgetExhausted) as caught:
            manager.privacy.before_round(info, 3, 3, 6)
        assert caught.value.spent == pytest.approx(eps[1]) and caught.value.limit == limit
        assert caught.value.next_epsilon == pytest.approx(eps[2])
        assert isinstance(caught.value, PrivacyError)
    with federation(tmp_path, FakeClock()) as (coord, manager):  # stays stopped
        manager.drain()
        assert manager.run("dp").finished and manager.run("dp").round == 2


def test_client_side_clipping_refuses_an_update_above_the_norm(tmp_path: Path) -> None:
    spec = RunSpec(per_round=3, seed=5, dp_clip=1.0, dp_noise=0.5, dp_clipping="client")
    with federation(tmp_path, FakeClock()) as (coord, manager):
        _start(coord, manager, spec)
        peer = manager.run("dp").selected[0]
        task = manager.task("dp", peer)
        assert task is not None and task.dp == "client" and task.clip == 1.0
        big = _delta(coord, peer, 1.0)
        with pytest.raises(ClipBoundExceeded, match=peer) as caught:
            manager.submit(task.round_id, peer, big, trained_on=task.version)
        assert caught.value.norm >= 6 and caught.value.clip == 1.0
        tensors = dict(get_update(coord.store, big).tensors)
        clipped, bit = clip_update(tensors, 1.0)
        ok = put_update(coord.store, ModelUpdate(clipped))
        with pytest.raises(FutureVersion) as future:  # a version not made yet: not "stale"
            manager.submit(task.round_id, peer, ok, trained_on=task.version + 1)
        assert (future.value.trained_on, future.value.current) == (task.version + 1, 0)
        manager.submit(task.round_id, peer, ok, trained_on=task.version, clipped=bit)
        assert manager.privacy.ledger.clip_bits("dp", 1) == {(peer, str(ok)): True}


def test_adaptive_clipping_moves_the_norm_from_the_clipped_count(tmp_path: Path) -> None:
    spec = RunSpec(
        per_round=3, rounds=2, seed=5, dp_clip=0.5, dp_adaptive=True, dp_clip_norm_lr=0.2
    )  # no noise: the count is exact, the next norm known
    with federation(tmp_path, FakeClock()) as (coord, manager):
        _start(coord, manager, spec)
        _play(coord, manager, "dp")  # every delta has norm >= 6: all three clipped
        manager.wait_version("dp", 1, timeout=60)
        manager.drain()
        step = manager.privacy.steps("dp")[0]
        assert step.clipped == 3 and step.noised_clipped == 3.0
        want = 0.5 * math.exp(0.2 * (1.0 - 0.5))
        assert step.next_clip == pytest.approx(want)
        task = manager.task("dp", manager.run("dp").selected[0])
        assert task is not None and task.clip == pytest.approx(want)


# ── over the wire ────────────────────────────────────────────────────────────
KEY = b"privacy-dp-key"


async def test_peers_submit_models_and_the_client_makes_clipped_deltas(tmp_path: Path) -> None:
    """RunClient.submit takes the trained model, as in any run: it sends the delta, clipped
    to the task's norm (client-side clipping); an over-norm delta is refused typed."""
    import asyncio

    from tensorswap.rounds.server import RoundServer
    from tensorswap.runs.client import RunClient
    from tensorswap.runs.manager import Task
    from tensorswap.runs.messages import ContributeRequest
    from tensorswap.runs.service import RunService

    coord = Coordinator.open(tmp_path, clock=FakeClock(), run_timer=False, durable=False)
    runs = RunManager.open(coord, durable=False)
    server = RoundServer(coord, key=KEY, max_wait=30)
    RunService(runs, server)
    peers: list[RunClient] = []
    try:
        await server.start("127.0.0.1", 0)
        for i in range(3):
            peers.append(await RunClient.connect("127.0.0.1", server.port, peer=f"p{i}", key=KEY))
            await peers[-1].register({"num_samples": 10})
        spec = RunSpec(
            per_round=2, rounds=2, seed=1, dp_clip=1.0, dp_noise=0.8, dp_clipping="client"
        )
        await peers[0].create_run("fl", spec, ModelUpdate(_model(0.0)))

        async def contribute(client: RunClient, task: Task, cid: Cid) -> None:
            """A contribute request by hand, without RunClient.submit's clipping."""
            await client.rounds.blocks.push(client.rounds.store, cid)
            request = ContributeRequest(
                peer=client.peer,
                run=task.run,
                round=task.round_id.round,
                update=cid.to_bytes(),
                trained_on=task.version,
            )
            await client.call(request)

        async def loop(client: RunClient) -> int:
            done = 0
            while (task := await client.next_task("fl", timeout=20)) is not None:
                model = await client.fetch_model(task)
                if done == 0:  # a raw delta above the norm, contributed by hand: refused
                    raw = await asyncio.to_thread(
                        put_update, client.rounds.store, ModelUpdate(_model(3.0))
                    )
                    with pytest.raises(ClipBoundExceeded) as caught:
                        await contribute(client, task, raw)
                    assert caught.value.clip == 1.0
                await client.submit(task, {k: v + 3 for k, v in model.items()}, num_samples=10)
                done += 1
            return done

        counts = await asyncio.gather(*(loop(p) for p in peers))
        assert sum(counts) == 4
        row = await peers[0].run("fl")
        assert row.finished and row.version == 2 and row.epsilon is not None
        assert row.epsilon == pytest.approx(runs.privacy.steps("fl")[-1].epsilon)
        assert all(s.clipped == 2 for s in runs.privacy.steps("fl"))  # every peer clipped
    finally:
        for client in peers:
            await client.aclose()
        await server.aclose()
        runs.close()
        coord.close()


def test_a_noised_run_without_dp_accounting_is_refused_when_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tensorswap.privacy import AccountantUnavailable

    monkeypatch.setitem(__import__("sys").modules, "dp_accounting", None)  # not installed
    with federation(tmp_path, FakeClock()) as (coord, manager):
        initial = put_update(coord.store, ModelUpdate(_model(0.0)))
        with pytest.raises(AccountantUnavailable, match=r"tensorswap\[privacy\]"):
            manager.create_run("dp", SPEC, initial)
        assert manager.runs() == []


# ── the fast paths ───────────────────────────────────────────────────────────
def test_update_norm_in_cache_sized_pieces_is_the_l2_norm() -> None:
    rng = np.random.default_rng(5)
    tensors = {"a": rng.standard_normal((300, 700), dtype=np.float32), "b": np.arange(5.0)}
    flat = np.concatenate([v.ravel().astype(np.float64) for v in tensors.values()])
    assert update_norm(tensors) == pytest.approx(float(np.linalg.norm(flat)), rel=1e-12)
    assert update_norm({"z": np.zeros(0, np.float32)}) == 0.0


def test_add_noise_is_the_scaled_values_plus_gaussian_noise_in_their_dtype() -> None:
    from tensorswap.privacy.dp import add_noise

    values = np.full((400, 500), 2.0, np.float32)
    one = add_noise(values, 0.5, 0.1, np.random.default_rng(1))
    assert one.dtype == np.float32 and one.shape == values.shape
    assert float(one.mean()) == pytest.approx(1.0, abs=1e-3)
    assert float(one.std()) == pytest.approx(0.1, rel=0.01)
    np.testing.assert_array_equal(one, add_noise(values, 0.5, 0.1, np.random.default_rng(1)))
    assert not np.array_equal(one, add_noise(values, 0.5, 0.1, np.random.default_rng(2)))


def test_noise_drawn_by_several_workers_depends_on_the_generator_only() -> None:
    from tensorswap.runs.stream import stream_noised
    from tensorswap.store import MemoryStore, ModelUpdate, get_update, put_update

    store = MemoryStore()
    model = {"w": np.zeros(3_000_000, np.float32), "b": np.zeros(10, np.float32)}
    zeros = put_update(store, ModelUpdate(model))

    def draw(seed: int, workers: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        cid = stream_noised(store, zeros, 1.0, 0.5, rng, metadata={}, name="n", workers=workers)
        return {k: np.asarray(v) for k, v in get_update(store, cid).tensors.items()}

    one, again, other = draw(1, 3), draw(1, 3), draw(2, 3)
    np.testing.assert_array_equal(one["w"], again["w"])
    assert not np.array_equal(one["w"], other["w"])
    chunks = np.split(one["w"][: 3 * (1 << 20)], 3)  # 4 MiB chunks, one per worker
    assert not np.array_equal(chunks[0], chunks[1])  # each worker its own stream
    assert float(one["w"].std()) == pytest.approx(0.5, rel=0.01)
    assert one["b"].shape == (10,) and draw(1, 1)["w"].dtype == np.float32


def test_a_peers_delta_read_chunk_by_chunk_from_its_store_is_model_minus_base() -> None:
    from tensorswap.privacy.delta import delta_from_store
    from tensorswap.privacy.dp import model_delta
    from tensorswap.store import MemoryStore, ModelUpdate, put_update

    store = MemoryStore()
    rng = np.random.default_rng(9)
    base = {"w": rng.standard_normal((700, 3000), dtype=np.float32), "b": np.arange(3.0)}
    cid = put_update(store, ModelUpdate(base), chunk_bytes=1 << 20)  # several chunks
    model = {"w": base["w"] + np.float32(0.25), "b": np.ones(3, np.float32)}
    got = delta_from_store(store, cid, model)
    assert got is not None
    want = model_delta(model, base)
    for name in model:
        assert got[name].dtype == model[name].dtype and got[name].shape == model[name].shape
        np.testing.assert_array_equal(got[name], want[name])
    # what it cannot do here it leaves to the general path (None), never guesses
    assert delta_from_store(store, cid, {"missing": np.zeros(3)}) is None
    assert delta_from_store(store, cid, {"b": np.zeros(4)}) is None
    assert delta_from_store(MemoryStore(), cid, model) is None
