"""Coordinator: validation, automatic aggregation, quorum at the deadline, restarts, counters."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tensorswap.cid import Cid, Multicodec
from tensorswap.rounds.core import (
    Aggregating,
    Collecting,
    Complete,
    Contribution,
    DuplicateContribution,
    Failed,
    FakeClock,
    InvalidRoundSpec,
    InvalidUpdate,
    LayerSpec,
    RoundAlreadyTerminal,
    RoundClosed,
    RoundFailed,
    RoundId,
    RoundNotFound,
    RoundSpec,
    RoundTracker,
    UnknownUpdate,
    UpdateMismatch,
)
from tensorswap.rounds.engine import Coordinator
from tensorswap.rounds.journal import RoundDatabase
from tensorswap.store import (
    DEFAULT_CHUNK_BYTES,
    BlockStore,
    DirectoryStore,
    MemoryStore,
    ModelUpdate,
    TensorManifest,
    UpdateManifest,
    get_update,
    put_update,
    read_manifest,
)

RID = RoundId(1, "init")


def put(store: BlockStore, n: int, scale: float, **shapes: tuple[int, ...]) -> Cid:
    """A model update whose tensors are all ``scale`` (default layers w (2, 3) and b (3,))."""
    shapes = shapes or {"w": (2, 3), "b": (3,)}
    tensors = {k: np.full(s, scale, dtype=np.float32) for k, s in shapes.items()}
    return put_update(store, ModelUpdate(tensors, n))


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1000.0)


@pytest.fixture
def coord(clock: FakeClock) -> Iterator[Coordinator]:
    with Coordinator(MemoryStore(), clock=clock, run_timer=False) as c:
        yield c


def test_fedavg_round_completes_by_itself_with_a_stored_result(coord: Coordinator) -> None:
    coord.start_round(RID, RoundSpec(3))
    cids = [put(coord.store, n, v) for n, v in [(100, 0.0), (300, 2.0), (0, 50.0)]]
    assert coord.submit(RID, "a", cids[0]) == Collecting(1, 3)
    coord.submit(RID, "b", str(cids[1]))
    coord.submit(RID, "c", cids[2])
    result = coord.result(RID, timeout=30)
    assert coord.status(RID) == Complete(str(result))
    update = get_update(coord.store, result)
    assert update.num_samples == 400
    np.testing.assert_allclose(update.tensors["w"], np.full((2, 3), 1.5, np.float32))
    assert update.tensors["b"].dtype == np.float32
    assert update.metadata["strategy"] == "fedavg" and update.metadata["contributors"] == "3"
    stats = coord.stats()
    assert (stats.contributions, stats.rounds_completed, stats.rounds_started) == (3, 1, 1)
    assert stats.contribution_bytes > 3 * 9 * 4 and stats.aggregation_seconds > 0


def test_duplicate_submission_is_refused_and_counted(coord: Coordinator) -> None:
    coord.start_round(RID, RoundSpec(2))
    cid = put(coord.store, 1, 1.0)
    coord.submit(RID, "a", cid)
    with pytest.raises(DuplicateContribution):
        coord.submit(RID, "a", put(coord.store, 1, 2.0))
    assert coord.status(RID) == Collecting(1, 2)
    assert coord.stats().rejected == 1


def test_unknown_round_and_terminal_round(coord: Coordinator) -> None:
    cid = put(coord.store, 1, 1.0)
    with pytest.raises(RoundNotFound):
        coord.submit(RID, "a", cid)
    coord.start_round(RID, RoundSpec(1))
    coord.submit(RID, "a", cid)
    coord.wait(RID, timeout=30)
    with pytest.raises(RoundAlreadyTerminal, match="Complete"):
        coord.submit(RID, "b", cid)


def test_updates_the_store_lacks_are_unknown(coord: Coordinator) -> None:
    coord.start_round(RID, RoundSpec(2))
    other = MemoryStore()
    with pytest.raises(UnknownUpdate, match="not in the store"):
        coord.submit(RID, "a", put(other, 1, 1.0))
    with pytest.raises(UnknownUpdate, match="not a CID"):
        coord.submit(RID, "a", "grad-cid-a")
    raw = coord.store.put(b"not a manifest")
    with pytest.raises(UnknownUpdate, match="not a manifest CID"):
        coord.submit(RID, "a", raw)
    cid = put(coord.store, 1, 7.0)
    manifest = read_manifest(coord.store, cid)
    tensor = read_manifest(coord.store, manifest.links()[0])
    coord.store.delete(tensor.links()[0])
    with pytest.raises(UnknownUpdate, match="lacks 1 of 1 chunks"):
        coord.submit(RID, "a", cid)
    assert coord.status(RID) is not None and coord.contributions(RID) == []


def test_tensor_manifest_is_not_an_update(coord: Coordinator) -> None:
    coord.start_round(RID, RoundSpec(2))
    manifest = read_manifest(coord.store, put(coord.store, 1, 1.0))
    with pytest.raises(UpdateMismatch, match="not a model update"):
        coord.submit(RID, "a", manifest.links()[0])


def test_layers_must_match_the_first_contribution(coord: Coordinator) -> None:
    coord.start_round(RID, RoundSpec(3))
    coord.submit(RID, "a", put(coord.store, 1, 1.0))
    with pytest.raises(UpdateMismatch, match=r"'w': expected shape \[2, 3\], got \[3, 2\]"):
        coord.submit(RID, "b", put(coord.store, 1, 1.0, w=(3, 2), b=(3,)))
    with pytest.raises(UpdateMismatch, match="missing \\['b'\\]"):
        coord.submit(RID, "b", put(coord.store, 1, 1.0, w=(2, 3)))
    assert coord.status(RID) == Collecting(1, 3)


def test_a_layout_fixed_up_front_applies_to_the_first_peer(coord: Coordinator) -> None:
    layout = (LayerSpec("w", "float32", (4,)),)
    coord.start_round(RID, RoundSpec(2, layout=layout))
    with pytest.raises(UpdateMismatch):
        coord.submit(RID, "a", put(coord.store, 1, 1.0))
    coord.submit(RID, "a", put(coord.store, 1, 1.0, w=(4,)))


def test_integer_and_non_finite_updates_are_refused(coord: Coordinator) -> None:
    coord.start_round(RID, RoundSpec(2))
    ints = put_update(coord.store, ModelUpdate({"w": np.ones(3, np.int32)}, 1))
    with pytest.raises(UpdateMismatch, match="only float tensors"):
        coord.submit(RID, "a", ints)
    bad = np.ones(3, np.float32)
    bad[1] = np.nan
    with pytest.raises(InvalidUpdate, match="1 non-finite values"):
        coord.submit(RID, "a", put_update(coord.store, ModelUpdate({"w": bad}, 1)))
    # The refused update left the sums untouched: the round still aggregates correctly.
    coord.submit(RID, "a", put_update(coord.store, ModelUpdate({"w": np.ones(3, np.float32)}, 1)))
    coord.submit(RID, "b", put_update(coord.store, ModelUpdate({"w": np.zeros(3, np.float32)}, 1)))
    out = get_update(coord.store, coord.result(RID, timeout=30))
    np.testing.assert_allclose(out.tensors["w"], 0.5)


def test_full_round_refuses_a_late_peer(coord: Coordinator) -> None:
    coord.start_round(RID, RoundSpec(1))
    coord.submit(RID, "a", put(coord.store, 1, 1.0))
    with pytest.raises((RoundClosed, RoundAlreadyTerminal)):
        coord.submit(RID, "b", put(coord.store, 1, 2.0))


def test_deadline_with_quorum_aggregates_what_is_there(
    coord: Coordinator, clock: FakeClock
) -> None:
    coord.start_round(RID, RoundSpec(3, quorum=2, timeout_s=10.0))
    coord.submit(RID, "a", put(coord.store, 1, 1.0))
    coord.submit(RID, "b", put(coord.store, 3, 3.0))
    clock.advance(9.9)
    assert coord.check_deadlines() == []
    clock.advance(0.1)
    assert coord.check_deadlines() == [RID]
    out = get_update(coord.store, coord.result(RID, timeout=30))
    np.testing.assert_allclose(out.tensors["w"], 2.5)
    assert out.num_samples == 4


def test_deadline_below_quorum_fails_with_the_count(coord: Coordinator, clock: FakeClock) -> None:
    coord.start_round(RID, RoundSpec(8, quorum=5, timeout_s=10.0))
    for peer in "abc":
        coord.submit(RID, peer, put(coord.store, 1, 1.0))
    clock.advance(11)
    coord.check_deadlines()
    assert coord.status(RID) == Failed("timeout: 3 of 8 peers (quorum 5)")
    with pytest.raises(RoundFailed, match="timeout: 3 of 8 peers"):
        coord.result(RID, timeout=0)
    assert coord.stats().rounds_failed == 1


def test_timer_thread_reacts_to_the_fake_clock(clock: FakeClock) -> None:
    with Coordinator(MemoryStore(), clock=clock) as coord:
        coord.start_round(RID, RoundSpec(2, quorum=1, timeout_s=5.0))
        coord.submit(RID, "a", put(coord.store, 1, 4.0))
        clock.advance(5.0)
        out = get_update(coord.store, coord.result(RID, timeout=30))
        np.testing.assert_allclose(out.tensors["b"], 4.0)


@pytest.mark.parametrize(
    ("strategy", "params", "expected"),
    [
        ("median", {}, 3.0),
        ("trimmed_mean", {"trim_count": 1}, 3.0),
        ("mean", {}, 22.0),
        ("krum", {"byzantine": 1}, 2.0),
        ("multi_krum", {"byzantine": 1, "select": 2}, 2.5),
    ],
)
def test_other_strategies(
    coord: Coordinator, strategy: str, params: dict[str, float], expected: float
) -> None:
    coord.start_round(RID, RoundSpec(5, strategy=strategy, params=params))
    for peer, value in zip("abcde", [1.0, 2.0, 3.0, 4.0, 100.0], strict=True):
        coord.submit(RID, peer, put(coord.store, 10, value))
    out = get_update(coord.store, coord.result(RID, timeout=30))
    np.testing.assert_allclose(out.tensors["w"], expected, rtol=1e-6)
    assert out.metadata["strategy"] == strategy


def test_aggregation_errors_fail_the_round(coord: Coordinator) -> None:
    coord.start_round(RID, RoundSpec(2, strategy="krum", params={"byzantine": 1}))
    coord.submit(RID, "a", put(coord.store, 1, 1.0))
    coord.submit(RID, "b", put(coord.store, 1, 1.0))
    status = coord.wait(RID, timeout=30)
    assert isinstance(status, Failed) and status.reason.startswith("aggregation failed:")


@pytest.mark.parametrize(
    ("strategy", "params"),
    [("nope", {}), ("fedavg", {"byzantine": 1}), ("median", {"colour": 1})],
)
def test_bad_strategies_are_refused_at_start(
    coord: Coordinator, strategy: str, params: dict[str, float]
) -> None:
    with pytest.raises(InvalidRoundSpec):
        coord.start_round(RID, RoundSpec(2, strategy=strategy, params=params))
    assert coord.status(RID) is None


def test_half_precision_rounds_return_their_dtype(coord: Coordinator) -> None:
    coord.start_round(RID, RoundSpec(2))
    for peer in "ab":
        update = ModelUpdate({"w": np.full(5, 1.5, np.float16)}, 1)
        coord.submit(RID, peer, put_update(coord.store, update))
    out = get_update(coord.store, coord.result(RID, timeout=30))
    assert out.tensors["w"].dtype == np.float16


def test_concurrent_peers_in_one_round(coord: Coordinator) -> None:
    n = 24
    coord.start_round(RID, RoundSpec(n))
    cids = [put(coord.store, 1, float(i)) for i in range(n)]
    barrier = threading.Barrier(n)

    def submit(i: int) -> None:
        barrier.wait()
        coord.submit(RID, f"p{i}", cids[i])

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out = get_update(coord.store, coord.result(RID, timeout=30))
    np.testing.assert_allclose(out.tensors["w"], (n - 1) / 2, rtol=1e-6)


# ── restarts ─────────────────────────────────────────────────────────────────
def test_reopen_goes_on_with_every_accepted_contribution(tmp_path: Path) -> None:
    clock = FakeClock()
    with Coordinator.open(tmp_path, clock=clock, run_timer=False) as coord:
        coord.start_round(RID, RoundSpec(3))
        coord.submit(RID, "a", put(coord.store, 1, 3.0))
        coord.submit(RID, "b", put(coord.store, 1, 6.0))
    with Coordinator.open(tmp_path, clock=clock, run_timer=False) as coord:
        assert coord.status(RID) == Collecting(2, 3)
        with pytest.raises(DuplicateContribution):
            coord.submit(RID, "a", put(coord.store, 1, 0.0))
        coord.submit(RID, "c", put(coord.store, 1, 9.0))
        out = get_update(coord.store, coord.result(RID, timeout=30))
        np.testing.assert_allclose(out.tensors["w"], 6.0)
        assert isinstance(coord.store, DirectoryStore)


def test_a_round_left_aggregating_is_aggregated_on_reopen(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path / "blocks")
    cids = [put(store, 1, 2.0), put(store, 1, 4.0)]
    with RoundDatabase.in_dir(tmp_path) as db:
        tracker = RoundTracker(2, journal=db)
        tracker.start(RID)
        for peer, cid in zip("ab", cids, strict=True):
            tracker.submit(Contribution(RID, peer, str(cid), 1))
        tracker.begin_aggregation(RID)
        assert tracker.status(RID) == Aggregating()
    with Coordinator.open(tmp_path, run_timer=False) as coord:
        out = get_update(coord.store, coord.result(RID, timeout=30))
        np.testing.assert_allclose(out.tensors["w"], 3.0)


def test_a_deadline_that_passed_while_down_is_handled_on_reopen(tmp_path: Path) -> None:
    clock = FakeClock()
    with Coordinator.open(tmp_path, clock=clock, run_timer=False) as coord:
        coord.start_round(RID, RoundSpec(3, quorum=2, timeout_s=60))
        coord.submit(RID, "a", put(coord.store, 1, 1.0))
    clock.advance(3600)
    with Coordinator.open(tmp_path, clock=clock, run_timer=False) as coord:
        assert coord.check_deadlines() == [RID]
        assert coord.status(RID) == Failed("timeout: 1 of 3 peers (quorum 2)")


def test_result_cid_is_a_manifest(coord: Coordinator) -> None:
    coord.start_round(RID, RoundSpec(1))
    coord.submit(RID, "a", put(coord.store, 5, 1.0))
    assert coord.result(RID, timeout=30).codec is Multicodec.TENSORSWAP_MANIFEST


def test_updates_cut_into_different_chunks_fold_to_the_same_aggregate(coord: Coordinator) -> None:
    coord.start_round(RID, RoundSpec(3))
    rng = np.random.default_rng(1)
    values = [rng.standard_normal((10, 7)).astype(np.float32) for _ in range(3)]
    for peer, v, chunk in zip("abc", values, [64, 100, 1 << 20], strict=True):
        cid = put_update(coord.store, ModelUpdate({"w": v}, 2), chunk_bytes=chunk)
        coord.submit(RID, peer, cid)
    out = get_update(coord.store, coord.result(RID, timeout=30))
    np.testing.assert_allclose(out.tensors["w"], sum(values) / 3, rtol=1e-5, atol=1e-6)


def test_bfloat16_scalar_and_empty_tensors(coord: Coordinator) -> None:
    import ml_dtypes

    bf16 = np.dtype(ml_dtypes.bfloat16)
    coord.start_round(RID, RoundSpec(2))
    for peer, value in (("a", 1.0), ("b", 3.0)):
        tensors = {
            "h": np.full(300, value, bf16),
            "s": np.array(value, np.float32),
            "e": np.zeros((0, 4), np.float32),
        }
        coord.submit(RID, peer, put_update(coord.store, ModelUpdate(tensors, 1), chunk_bytes=128))
    out = get_update(coord.store, coord.result(RID, timeout=30))
    assert out.tensors["h"].dtype == bf16
    np.testing.assert_allclose(out.tensors["h"].astype(np.float32), 2.0)
    assert out.tensors["s"].shape == () and float(out.tensors["s"]) == 2.0
    assert out.tensors["e"].shape == (0, 4)


def _chunk_cids(store: BlockStore, update_cid: Cid, name: str) -> list[bytes]:
    update = read_manifest(store, update_cid)
    assert isinstance(update, UpdateManifest)
    (ref,) = [t for t in update.tensors if t.name == name]
    tensor = read_manifest(store, ref.cid)
    assert isinstance(tensor, TensorManifest)
    return [chunk.cid_bytes for chunk in tensor.chunks]


def _frozen_round(
    coord: Coordinator, spec: RoundSpec, weights: tuple[int, ...] = (1, 2, 4)
) -> tuple[np.ndarray, list[np.ndarray], Cid]:
    """Peers that share one 2-chunk tensor's first chunk (a frozen part) and differ elsewhere."""
    rng = np.random.default_rng(7)
    per_chunk = DEFAULT_CHUNK_BYTES // 4
    frozen = rng.standard_normal(per_chunk).astype(np.float32)
    tails = [rng.standard_normal(1000).astype(np.float32) for _ in weights]
    coord.start_round(RID, spec)
    cid = None
    for peer, n, tail in zip("abc", weights, tails, strict=True):
        tensors = {"t": np.concatenate([frozen, tail]), "f": frozen[:1000].copy()}
        cid = put_update(coord.store, ModelUpdate(tensors, n))
        coord.submit(RID, peer, cid)
    assert cid is not None
    return frozen, tails, cid


def test_chunks_every_peer_shares_aggregate_to_themselves_bit_for_bit(coord: Coordinator) -> None:
    frozen, tails, peer_cid = _frozen_round(coord, RoundSpec(3))
    result = coord.result(RID, timeout=30)
    out = get_update(coord.store, result)
    # float32 FedAvg of 1/7, 2/7, 4/7 of the same values is off by an ulp here and there ...
    weighted = sum(np.float32(w / 7) * frozen for w in (1, 2, 4))
    assert not np.array_equal(weighted, frozen)
    # ... but a chunk every peer stored identically is the aggregate as it is
    assert out.tensors["t"][: frozen.size].tobytes() == frozen.tobytes()
    assert out.tensors["f"].tobytes() == frozen[:1000].tobytes()
    np.testing.assert_allclose(
        out.tensors["t"][frozen.size :], (tails[0] + 2 * tails[1] + 4 * tails[2]) / 7, rtol=1e-5
    )
    # so the result names the very blocks the peers hold: fetching it moves no frozen bytes
    ours, theirs = _chunk_cids(coord.store, result, "t"), _chunk_cids(coord.store, peer_cid, "t")
    assert ours[0] == theirs[0] and ours[1] != theirs[1]
    assert _chunk_cids(coord.store, result, "f") == _chunk_cids(coord.store, peer_cid, "f")


def test_shared_chunks_are_exact_after_a_reopen_too(tmp_path: Path) -> None:
    with Coordinator.open(tmp_path, run_timer=False) as coord:
        coord.start_round(RID, RoundSpec(2))
        frozen = np.random.default_rng(3).standard_normal(500).astype(np.float32)
        coord.submit(RID, "a", put_update(coord.store, ModelUpdate({"f": frozen}, 3)))
    with Coordinator.open(tmp_path, run_timer=False) as coord:  # "a" is folded again
        coord.submit(RID, "b", put_update(coord.store, ModelUpdate({"f": frozen.copy()}, 4)))
        out = get_update(coord.store, coord.result(RID, timeout=30))
        assert out.tensors["f"].tobytes() == frozen.tobytes()


def test_clipped_rounds_average_shared_chunks_like_any_other(coord: Coordinator) -> None:
    frozen, _, _ = _frozen_round(coord, RoundSpec(3, params={"max_norm": 1.0}))
    out = get_update(coord.store, coord.result(RID, timeout=30))
    # each update is scaled to norm 1, so the shared values come out scaled, not as stored
    assert np.linalg.norm(out.tensors["t"]) <= 1.0 + 1e-4
    assert not np.array_equal(out.tensors["t"][: frozen.size], frozen)
