"""Group commit: contributions arriving together share one SQLite transaction, each durable
before its submit returns; a write that fails is refused alone."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from tensorswap.errors import RoundsError
from tensorswap.rounds.core import (
    Collecting,
    Complete,
    Contribution,
    DuplicateContribution,
    FakeClock,
    RoundClosed,
    RoundId,
    RoundSpec,
    RoundTracker,
    UnknownUpdate,
)
from tensorswap.rounds.engine import Coordinator
from tensorswap.rounds.journal import RoundDatabase
from tensorswap.rounds.journal._group import GroupCommit
from tensorswap.store import MemoryStore, ModelUpdate, put_update

RID = RoundId(1, "lead")


def _table() -> tuple[sqlite3.Connection, threading.Lock]:
    conn = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
    conn.execute("CREATE TABLE t (x INTEGER PRIMARY KEY)")
    return conn, threading.Lock()


def _group(conn: sqlite3.Connection, lock: threading.Lock, **kwargs: object) -> GroupCommit:
    @contextmanager
    def transaction() -> Iterator[sqlite3.Connection]:
        with lock:
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")

    return GroupCommit(transaction, **kwargs)  # type: ignore[arg-type]


def test_writes_queued_while_a_commit_runs_share_the_next_transaction() -> None:
    conn, lock = _table()
    group = _group(conn, lock)
    release, queued = threading.Event(), threading.Event()
    group.on_queue = lambda n: queued.set() if n == 4 else None

    def first(db: sqlite3.Connection) -> None:
        db.execute("INSERT INTO t VALUES (0)")
        assert release.wait(30)

    leader = threading.Thread(target=group.write, args=(first,))
    leader.start()
    followers = [
        threading.Thread(
            target=group.write, args=(lambda db, i=i: db.execute("INSERT INTO t VALUES (?)", (i,)),)
        )
        for i in range(1, 5)
    ]
    for t in followers:
        t.start()
    assert queued.wait(30)  # four writes wait while the first one's transaction is open
    release.set()
    for t in [leader, *followers]:
        t.join(30)
    assert (group.commits, group.writes) == (2, 5)
    assert sorted(x for (x,) in conn.execute("SELECT x FROM t")) == [0, 1, 2, 3, 4]


def test_a_failing_write_is_refused_alone() -> None:
    conn, lock = _table()
    group = _group(conn, lock)
    errors = group.write_many(
        [
            lambda db: db.execute("INSERT INTO t VALUES (1)").close(),
            lambda db: db.execute("INSERT INTO t VALUES (1)").close(),  # duplicate key
            lambda db: db.execute("INSERT INTO t VALUES (2)").close(),
        ]
    )
    assert errors[0] is None and errors[2] is None
    assert isinstance(errors[1], sqlite3.IntegrityError)
    assert group.commits == 1
    assert sorted(x for (x,) in conn.execute("SELECT x FROM t")) == [1, 2]


def test_without_grouping_each_write_commits_alone() -> None:
    conn, lock = _table()
    group = _group(conn, lock, grouped=False)
    errors = group.write_many(
        [lambda db, i=i: db.execute("INSERT INTO t VALUES (?)", (i,)).close() for i in range(3)]
    )
    assert errors == [None, None, None]
    assert group.commits == 3


class _FailingJournal:
    """A journal whose contribution writes all fail (a full disk at commit)."""

    def load(self) -> list[object]:
        return []

    def insert_round(self, info: object) -> None:
        pass

    def add_contribution(self, *args: object) -> None:
        raise RoundsError("disk full")

    def add_contributions(self, items: list[object]) -> list[BaseException | None]:
        return [RoundsError("disk full") for _ in items]

    def set_status(self, *args: object) -> None:
        pass

    def delete_rounds(self, *args: object) -> None:
        pass

    def drop_contribution(self, *args: object) -> None:
        pass


def _contribution(peer: str) -> Contribution:
    return Contribution(RID, peer, "bafkq", 1, 4, 0.0)


def test_a_reserved_place_counts_until_recorded_and_is_given_back_on_failure() -> None:
    tracker = RoundTracker(journal=_FailingJournal())  # type: ignore[arg-type]
    tracker.start(RID, RoundSpec(1))
    ticket = tracker.reserve(_contribution("a"))
    with pytest.raises(DuplicateContribution):
        tracker.reserve(_contribution("a"))
    with pytest.raises(RoundClosed):  # the one place is held
        tracker.reserve(_contribution("b"))
    assert tracker.info(RID).received == 0  # type: ignore[union-attr]  # not visible yet
    (outcome,) = tracker.record([ticket])
    assert isinstance(outcome, RoundsError)
    assert tracker.info(RID).received == 0  # type: ignore[union-attr]
    tracker.reserve(_contribution("b"))  # the place is free again


def _tiny(value: float) -> ModelUpdate:
    return ModelUpdate({"w": np.full(4, value, np.float32)}, 1)


def test_submit_many_screens_each_and_journals_the_accepted_in_one_transaction(
    tmp_path: Path,
) -> None:
    with Coordinator.open(tmp_path, run_timer=False) as coord:
        coord.start_round(RID, RoundSpec(4))
        cids = [put_update(coord.store, _tiny(v)) for v in (1.0, 2.0, 3.0)]
        assert isinstance(coord.journal, RoundDatabase)
        before = coord.journal.commits
        missing = put_update(MemoryStore(), _tiny(9.0))
        outcomes = coord.submit_many(
            RID, [("a", cids[0]), ("a", cids[1]), ("b", missing), ("b", cids[1]), ("c", cids[2])]
        )
        assert outcomes[0] == Collecting(1, 4)
        assert isinstance(outcomes[1], DuplicateContribution)
        assert isinstance(outcomes[2], UnknownUpdate)
        assert outcomes[3:] == [Collecting(2, 4), Collecting(3, 4)]
        after = coord.journal.commits
        # one transaction, and one write for the three accepted (their rows in one executemany)
        assert (after[0] - before[0], after[1] - before[1]) == (1, 1)
    with Coordinator.open(tmp_path, run_timer=False) as again:  # durable: all three are back
        assert [c.peer for c in again.contributions(RID)] == ["a", "b", "c"]


def test_concurrent_submits_share_transactions_and_all_survive_a_reopen(tmp_path: Path) -> None:
    peers = 24
    with Coordinator.open(tmp_path, run_timer=False) as coord:
        coord.start_round(RID, RoundSpec(peers))
        cids = [put_update(coord.store, _tiny(float(i))) for i in range(peers)]
        assert isinstance(coord.journal, RoundDatabase)
        start = threading.Barrier(peers)

        def submit(i: int) -> None:
            start.wait(30)
            coord.submit(RID, f"p{i}", cids[i])

        threads = [threading.Thread(target=submit, args=(i,)) for i in range(peers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert isinstance(coord.wait(RID, timeout=30), Complete)
        assert len(coord.contributions(RID)) == peers
    with Coordinator.open(tmp_path, run_timer=False) as again:
        assert sorted(c.peer for c in again.contributions(RID)) == sorted(
            f"p{i}" for i in range(peers)
        )


def test_a_deadline_waits_for_a_reserved_contribution_before_its_verdict(tmp_path: Path) -> None:
    clock = FakeClock()
    with Coordinator.open(tmp_path, clock=clock, run_timer=False) as coord:
        coord.start_round(RID, RoundSpec(3, quorum=1, timeout_s=10))
        cid = put_update(coord.store, _tiny(2.0))
        contribution = Contribution(RID, "a", str(cid), 1, 64, clock.now())
        ticket = coord.tracker.reserve(contribution)  # checked, not yet journaled
        waiting = threading.Event()
        coord.tracker.on_settle_wait = lambda rid: waiting.set()
        clock.advance(11)
        judged = threading.Thread(target=coord.check_deadlines)
        judged.start()
        assert waiting.wait(30)  # the verdict waits for the reserved contribution ...
        assert coord.tracker.record([ticket])[0] == Collecting(1, 3)
        judged.join(30)
        coord.tracker.on_settle_wait = None
        # ... so it counts it: quorum met, aggregated, not failed below quorum
        assert isinstance(coord.wait(RID, timeout=30), Complete)
