"""RoundDatabase: a tracker over SQLite (WAL) restores exactly what it had accepted."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tensorswap.errors import RoundsError
from tensorswap.rounds.errors import DuplicateContribution
from tensorswap.rounds.persist import DB_FILENAME, RoundDatabase
from tensorswap.rounds.state import (
    Aggregating,
    Collecting,
    Complete,
    Contribution,
    Failed,
    LayerSpec,
    Pending,
    RoundId,
    RoundSpec,
    RoundTracker,
)


def test_database_is_wal(tmp_path: Path) -> None:
    with RoundDatabase.in_dir(tmp_path) as db:
        assert db.path == tmp_path / DB_FILENAME
    conn = sqlite3.connect(tmp_path / DB_FILENAME)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        conn.close()


def test_reopen_restores_rounds_statuses_and_contributions(tmp_path: Path) -> None:
    layout = (LayerSpec("w", "float32", (4, 2)), LayerSpec("b", "bfloat16", ()))
    spec = RoundSpec(3, quorum=2, timeout_s=30.0, strategy="trimmed_mean", params={"trim": 1})
    r1, r2, r3, r4 = (RoundId(i, "init") for i in range(1, 5))
    with RoundDatabase.in_dir(tmp_path) as db:
        tracker = RoundTracker(2, journal=db, clock=lambda: 100.0)
        tracker.start(r1, spec)
        tracker.submit(Contribution(r1, "a", "cid-a", 10, 1000, 101.0), layout=layout)
        tracker.submit(Contribution(r1, "b", "cid-b", 20, 2000, 102.0), layout=layout)
        tracker.start(r2)
        tracker.start(r3)
        tracker.mark_complete(r3, "agg")
        tracker.start(r4)
        tracker.begin_aggregation(r4)
        before = tracker.rounds()
    with RoundDatabase.in_dir(tmp_path) as db:
        tracker = RoundTracker(2, journal=db)
        assert tracker.rounds() == before
        assert tracker.status(r1) == Collecting(2, 3)
        assert tracker.status(r2) == Pending()
        assert tracker.status(r3) == Complete("agg")
        assert tracker.status(r4) == Aggregating()
        info = tracker.info(r1)
        assert info is not None
        assert info.spec == spec and info.layout == layout and info.deadline == 130.0
        rows = [(c.peer, c.update_cid, c.num_samples, c.nbytes) for c in tracker.contributions(r1)]
        assert rows == [
            ("a", "cid-a", 10, 1000),
            ("b", "cid-b", 20, 2000),
        ]
        # The restored tracker goes on: duplicates still refused, new peers accepted.
        with pytest.raises(DuplicateContribution):
            tracker.submit(Contribution(r1, "a", "cid-x"))
        assert tracker.submit(Contribution(r1, "c", "cid-c"), layout=layout) == Collecting(3, 3)
        tracker.mark_failed(r2, "timeout: 0 of 2 peers (quorum 2)")
    with RoundDatabase.in_dir(tmp_path) as db:
        tracker = RoundTracker(2, journal=db)
        assert tracker.status(r2) == Failed("timeout: 0 of 2 peers (quorum 2)")
        assert len(tracker.contributions(r1)) == 3


def test_gc_deletes_rounds_and_their_contributions(tmp_path: Path) -> None:
    with RoundDatabase.in_dir(tmp_path) as db:
        tracker = RoundTracker(1, journal=db)
        old, new = RoundId(1, "i"), RoundId(9, "i")
        tracker.start(old)
        tracker.submit(Contribution(old, "a", "cid"))
        tracker.mark_complete(old, "agg")
        tracker.start(new)
        assert tracker.gc_before_round(5) == 1
    with RoundDatabase.in_dir(tmp_path) as db:
        tracker = RoundTracker(1, journal=db)
        assert [i.round_id for i in tracker.rounds()] == [new]
        with db._transaction() as conn:
            assert conn.execute("SELECT COUNT(*) FROM contributions").fetchone()[0] == 0


def test_a_failed_write_changes_nothing_in_memory(tmp_path: Path) -> None:
    with RoundDatabase.in_dir(tmp_path) as db:
        tracker = RoundTracker(2, journal=db)
        rid = RoundId(1, "i")
        tracker.start(rid)
        db.close()  # every later write fails
        with pytest.raises(RoundsError):
            tracker.submit(Contribution(rid, "a", "cid"))
        assert tracker.status(rid) == Pending()
        assert tracker.contributions(rid) == []


def test_huge_round_numbers_are_refused_by_the_database(tmp_path: Path) -> None:
    with RoundDatabase.in_dir(tmp_path) as db:
        tracker = RoundTracker(1, journal=db)
        with pytest.raises(RoundsError, match="does not fit"):
            tracker.start(RoundId(2**64 - 1, "i"))
        assert tracker.rounds() == []


def test_unknown_schema_version_is_refused(tmp_path: Path) -> None:
    conn = sqlite3.connect(tmp_path / DB_FILENAME)
    conn.execute("PRAGMA user_version=99")
    conn.commit()
    conn.close()
    with pytest.raises(RoundsError, match="schema version 99"):
        RoundDatabase.in_dir(tmp_path)


def test_contributions_survive_the_process_being_killed(tmp_path: Path) -> None:
    """A submit that returned is on disk even if the process dies right after (SIGKILL)."""
    script = textwrap.dedent(
        f"""
        import os, signal
        from tensorswap.rounds.persist import RoundDatabase
        from tensorswap.rounds.state import Contribution, RoundId, RoundTracker
        db = RoundDatabase.in_dir({str(tmp_path)!r})
        tracker = RoundTracker(8, journal=db)
        rid = RoundId(7, "init")
        tracker.start(rid)
        for i in range(5):
            tracker.submit(Contribution(rid, f"p{{i}}", f"cid{{i}}", i))
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert proc.returncode == -9, proc.stderr.decode()
    with RoundDatabase.in_dir(tmp_path) as db:
        tracker = RoundTracker(8, journal=db)
        rid = RoundId(7, "init")
        assert tracker.status(rid) == Collecting(5, 8)
        assert [c.num_samples for c in tracker.contributions(rid)] == [0, 1, 2, 3, 4]
