"""Coordinator retention: old rounds forgotten, unreferenced blocks collected, nothing live lost."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from helpers.store import STORE_KINDS, make_older, make_store
from tensorswap.cid import Cid
from tensorswap.rounds.core import Complete, FakeClock, RoundId, RoundSpec, UnknownUpdate
from tensorswap.rounds.engine import Coordinator
from tensorswap.store import (
    BlockStore,
    DirectoryStore,
    MemoryStore,
    ModelUpdate,
    get_update,
    manifest_closure,
    put_update,
)


def put(store: BlockStore, seed: int) -> Cid:
    values = np.random.default_rng(seed).standard_normal((4, 5)).astype(np.float32)
    return put_update(store, ModelUpdate({"w": values}, 10 + seed))


def age_everything(coord: Coordinator) -> None:
    """Ten thousand seconds pass: for every block, and for the rounds that have ended."""
    for cid in list(coord.store):
        make_older(coord.store, cid, 10_000)
    assert isinstance(coord.clock, FakeClock)
    coord.clock.advance(10_000)


@pytest.fixture(params=STORE_KINDS)
def coord(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Coordinator]:
    store = make_store(request.param, tmp_path / "blocks")
    with Coordinator(store, clock=FakeClock(1000.0), run_timer=False) as c:
        yield c


def run_round(coord: Coordinator, number: int, seeds: list[int]) -> tuple[list[Cid], Cid]:
    rid = RoundId(number, "lead")
    coord.start_round(rid, RoundSpec(len(seeds)))
    cids = [put(coord.store, seed) for seed in seeds]
    for i, cid in enumerate(cids):
        coord.submit(rid, f"peer-{i}", cid)
    return cids, coord.result(rid, timeout=30)


def closure(store: BlockStore, roots: list[Cid]) -> set[Cid]:
    return {cid for root in roots for cid in manifest_closure(store, root)}


def test_old_rounds_and_their_blocks_go_the_newest_stay(coord: Coordinator) -> None:
    rounds = [run_round(coord, n, [10 * n, 10 * n + 1]) for n in (1, 2, 3)]
    age_everything(coord)
    kept = closure(coord.store, [*rounds[2][0], rounds[2][1]])
    gone = closure(coord.store, [*rounds[0][0], rounds[0][1], *rounds[1][0], rounds[1][1]])

    done = coord.collect_garbage(keep_rounds=1)

    assert done.rounds_removed == 2
    assert [info.round_id.round for info in coord.rounds()] == [3]
    assert done.blocks.removed == len(gone - kept) and done.blocks.spared == 0
    assert set(coord.store) == kept
    latest = get_update(coord.store, rounds[2][1])  # the newest aggregate is whole
    assert latest.num_samples == 10 + 30 + 10 + 31
    stats = coord.stats()
    assert (stats.gc_runs, stats.gc_rounds_removed) == (1, 2)
    assert stats.gc_blocks_removed == done.blocks.removed


def test_a_dry_run_changes_nothing(coord: Coordinator) -> None:
    for n in (1, 2):
        run_round(coord, n, [n])
    age_everything(coord)
    before = set(coord.store)
    done = coord.collect_garbage(keep_rounds=1, dry_run=True)
    assert done.rounds_removed == 1 and done.blocks.removed > 0
    assert set(coord.store) == before and len(coord.rounds()) == 2
    assert coord.stats().gc_runs == 0


def test_running_rounds_are_kept_whatever_their_number(coord: Coordinator) -> None:
    running = RoundId(1, "slow")
    coord.start_round(running, RoundSpec(2))
    early = put(coord.store, 99)
    coord.submit(running, "early", early)
    run_round(coord, 5, [5])
    age_everything(coord)
    done = coord.collect_garbage(keep_rounds=1)
    assert done.rounds_removed == 0
    assert closure(coord.store, [early]) <= set(coord.store)  # the accepted contribution
    coord.submit(running, "late", put(coord.store, 98))
    assert isinstance(coord.wait(running, timeout=30), Complete)


def test_recent_unreferenced_blocks_are_spared_for_a_submit_to_come(coord: Coordinator) -> None:
    run_round(coord, 1, [1])
    age_everything(coord)
    pushed = put(coord.store, 7)  # pushed for round 2, not submitted yet
    done = coord.collect_garbage(keep_rounds=1, grace=600)
    assert done.blocks.spared == len(closure(coord.store, [pushed]))
    rid = RoundId(2, "lead")
    coord.start_round(rid, RoundSpec(1))
    coord.submit(rid, "p", pushed)  # still whole
    assert isinstance(coord.wait(rid, timeout=30), Complete)
    age_everything(coord)
    coord.collect_garbage(keep_rounds=1, grace=0)
    stale = put(coord.store, 8)
    age_everything(coord)
    coord.collect_garbage(keep_rounds=1, grace=600)  # too old: collected
    rid3 = RoundId(3, "lead")
    coord.start_round(rid3, RoundSpec(1))
    with pytest.raises(UnknownUpdate):
        coord.submit(rid3, "p", stale)


def test_keep_rounds_collects_by_itself_as_rounds_end(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path / "blocks")
    with Coordinator(
        store, clock=FakeClock(1000.0), run_timer=False, keep_rounds=1, gc_grace=0
    ) as coord:
        first = run_round(coord, 1, [1, 2])
        # With no grace, a collection running while round 2's updates are put (not yet
        # submitted) would delete them: let round 1's collection finish first.
        coord.drain_collections(timeout=30)
        second = run_round(coord, 2, [3, 4])
        coord.drain_collections(timeout=30)  # they run on a background thread
        assert coord.stats().gc_runs == 2
        assert [info.round_id.round for info in coord.rounds()] == [2]
        assert not store.has(first[1])
        assert get_update(store, second[1]).num_samples == 13 + 14


def test_collection_waits_for_a_submit_in_progress(coord: Coordinator) -> None:
    run_round(coord, 1, [1])
    rid = RoundId(2, "lead")
    coord.start_round(rid, RoundSpec(1))
    update = put(coord.store, 5)
    age_everything(coord)  # old enough to be collected if nothing referenced it
    entered, release = threading.Event(), threading.Event()
    original = coord.tracker.check_submit

    def slow_check(*args: object) -> object:
        entered.set()
        release.wait(30)
        return original(*args)  # type: ignore[arg-type]

    coord.tracker.check_submit = slow_check  # type: ignore[method-assign]
    submitter = threading.Thread(target=coord.submit, args=(rid, "p", update))
    submitter.start()
    assert entered.wait(30)
    collector = threading.Thread(target=coord.collect_garbage, kwargs={"keep_rounds": 1})
    collector.start()
    collector.join(0.2)  # it must be waiting for the submit, not deleting the update
    assert collector.is_alive()
    release.set()
    submitter.join(30)
    collector.join(30)
    coord.tracker.check_submit = original  # type: ignore[method-assign]
    assert isinstance(coord.wait(rid, timeout=30), Complete)
    assert closure(coord.store, [update]) <= set(coord.store)


def test_bad_settings_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep_rounds"):
        Coordinator(MemoryStore(), run_timer=False, keep_rounds=0)
    with pytest.raises(ValueError, match="gc_grace"):
        Coordinator(MemoryStore(), run_timer=False, gc_grace=-1)
    with Coordinator(MemoryStore(), run_timer=False) as coord, pytest.raises(ValueError):
        coord.collect_garbage(keep_rounds=0)


def test_rounds_that_just_ended_are_kept_for_the_grace_period(coord: Coordinator) -> None:
    run_round(coord, 1, [1])
    run_round(coord, 2, [2])
    for cid in list(coord.store):
        make_older(coord.store, cid, 10_000)
    assert coord.collect_garbage(keep_rounds=1, grace=600).rounds_removed == 0  # peers may fetch
    assert isinstance(coord.clock, FakeClock)
    coord.clock.advance(601)
    assert coord.collect_garbage(keep_rounds=1, grace=600).rounds_removed == 1


def test_a_listener_may_submit_while_a_collection_waits() -> None:
    """A status listener runs inside an aggregation (which holds the collection lock shared);
    its submit must not queue behind the collection that waits for that very aggregation."""
    store = MemoryStore()
    with Coordinator(
        store, clock=FakeClock(1000.0), run_timer=False, keep_rounds=1, gc_grace=0
    ) as coord:
        first, second = RoundId(1, "lead"), RoundId(2, "lead")
        coord.start_round(first, RoundSpec(1))
        coord.start_round(second, RoundSpec(1))
        chained = threading.Event()
        lock = coord.collection_lock

        def listener(rid: RoundId, status: object) -> None:
            if rid == first and isinstance(status, Complete):
                # the collection queued by round 1 now waits, exclusive
                assert lock.wait_for_waiter(timeout=30) and lock.waiting > 0
                coord.submit(second, "p", put(store, 2))
                chained.set()

        coord.subscribe(listener)
        coord.submit(first, "p", put(store, 1))
        assert isinstance(coord.wait(second, timeout=30), Complete)
        assert chained.is_set()
        coord.drain_collections(timeout=30)


def test_collect_garbage_from_inside_a_submit_is_refused(coord: Coordinator) -> None:
    with coord.no_collection(), pytest.raises(RuntimeError, match="wait for itself"):
        coord.collect_garbage(keep_rounds=1)


def test_a_collection_that_cannot_be_queued_does_not_stop_the_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import tensorswap.rounds.storage.retention as module

    class NoThreads(module.ThreadPoolExecutor):
        refuse = True  # the first queueing fails, as with no thread to spare; later ones run

        def submit(self, *args: object, **kwargs: object) -> module.Future[None]:
            if NoThreads.refuse:
                raise RuntimeError("can't start new thread")
            return super().submit(*args, **kwargs)  # type: ignore[arg-type]

    store = MemoryStore()
    with Coordinator(store, clock=FakeClock(1000.0), run_timer=False, keep_rounds=1) as coord:
        monkeypatch.setattr(module, "ThreadPoolExecutor", NoThreads)
        rid = RoundId(1, "lead")
        coord.start_round(rid, RoundSpec(1))
        coord.submit(rid, "p", put(store, 1))
        assert isinstance(coord.wait(rid, timeout=30), Complete)
        coord.drain_collections(timeout=30)
        assert coord.stats().gc_runs == 0  # none was queued...
        NoThreads.refuse = False
        second = RoundId(2, "lead")
        coord.start_round(second, RoundSpec(1))
        coord.submit(second, "p", put(store, 2))
        assert isinstance(coord.wait(second, timeout=30), Complete)
        coord.drain_collections(timeout=30)
        assert coord.stats().gc_runs == 1  # ...and the next round end tries again


def test_a_round_failed_at_its_deadline_is_collected_after_it_is_failed() -> None:
    store, clock = MemoryStore(), FakeClock(1000.0)
    with Coordinator(store, clock=clock, run_timer=False, keep_rounds=1, gc_grace=0) as coord:
        late, done = RoundId(1, "lead"), RoundId(2, "lead")
        coord.start_round(late, RoundSpec(2, timeout_s=10))
        coord.submit(late, "a", put(store, 1))  # below quorum when the deadline passes
        coord.start_round(done, RoundSpec(1))
        coord.submit(done, "p", put(store, 2))
        assert isinstance(coord.wait(done, timeout=30), Complete)
        clock.advance(20)
        assert coord.check_deadlines() == [late]
        coord.drain_collections(timeout=30)
        assert [info.round_id for info in coord.rounds()] == [done]


def test_a_collection_walks_the_store_before_it_holds_submits_off(
    coord: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The walk of the whole store (and the temp-file sweep) happen while submits go on; only
    the decision and the deletes hold them off."""
    held: list[bool] = []
    kind = type(coord.store)
    walk, sweep = kind.__iter__, getattr(kind, "remove_temp_files", None)

    def spy_walk(self: object) -> Iterator[Cid]:
        held.append(coord.collection_lock.exclusive_held)
        return walk(self)  # type: ignore[arg-type]

    monkeypatch.setattr(kind, "__iter__", spy_walk)
    if sweep is not None:

        def spy_sweep(self: object, **kwargs: float) -> int:
            held.append(coord.collection_lock.exclusive_held)
            return sweep(self, **kwargs)  # type: ignore[misc]

        monkeypatch.setattr(kind, "remove_temp_files", spy_sweep)
    coord.collect_garbage(1, grace=0.0)
    assert held and not any(held)


def test_queued_collections_read_the_store_account_and_walk_every_sixteenth(
    tmp_path: Path,
) -> None:
    """A queued collection takes its candidates from the store's own account (no walk of its
    shards); the first and every 16th walk, and so find what another process put."""
    walks: list[int] = []

    class Counted(DirectoryStore):
        def fault_point(self, point: str, path: str) -> None:
            if point == "walked":
                walks.append(1)

    store = Counted(tmp_path / "blocks")
    with Coordinator(
        store, clock=FakeClock(1000.0), run_timer=False, keep_rounds=1, gc_grace=0
    ) as coord:
        first = run_round(coord, 1, [1])
        coord.drain_collections(timeout=30)
        assert walks == [1]
        foreign = DirectoryStore(tmp_path / "blocks").put(b"another process's garbage")
        for number in range(2, 17):
            _, result = run_round(coord, number, [number])
            coord.drain_collections(timeout=30)
            assert store.has(result)
        assert coord.stats().gc_runs == 16 and walks == [1]
        assert not store.has(first[1]) and not store.has(first[0][0])  # from the account
        assert store.has(foreign)  # not in the account: left for the next walk
        run_round(coord, 17, [17])
        coord.drain_collections(timeout=30)
        assert walks == [1, 1] and not store.has(foreign)
        assert coord.collect_garbage(1, grace=0.0) and walks == [1, 1, 1]  # on demand: a walk
