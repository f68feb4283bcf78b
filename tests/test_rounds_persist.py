"""RoundDatabase: a tracker over SQLite (WAL) restores exactly what it had accepted."""

from __future__ import annotations

import logging
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tensorswap.cli import main
from tensorswap.errors import RoundsError
from tensorswap.rounds.core import (
    Aggregating,
    Collecting,
    Complete,
    Contribution,
    DuplicateContribution,
    Failed,
    JournalDamaged,
    JournalMissing,
    LayerSpec,
    Pending,
    RoundId,
    RoundSpec,
    RoundTracker,
)
from tensorswap.rounds.engine import STORE_DIRNAME, Coordinator
from tensorswap.rounds.journal import DB_FILENAME, RoundDatabase
from tensorswap.store import DirectoryStore


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
    with sqlite3.connect(tmp_path / DB_FILENAME) as conn:  # the file itself, read apart
        assert conn.execute("SELECT COUNT(*) FROM contributions").fetchone()[0] == 0
    conn.close()


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
        from tensorswap.rounds.journal import RoundDatabase
        from tensorswap.rounds.core import Contribution, RoundId, RoundTracker
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


# ── a lost or damaged journal is refused, never silently replaced ────────────
def _store_with_a_block(data: Path) -> None:
    with DirectoryStore(data / STORE_DIRNAME) as store:
        store.put(b"a block some journaled round refers to")


def _journal_with_rounds(data: Path, rounds: int = 40) -> None:
    with Coordinator.open(data, run_timer=False) as coordinator:
        for number in range(1, rounds + 1):
            rid = RoundId(number, "init")
            coordinator.tracker.start(rid, RoundSpec(3))
            for peer in ("a", "b"):
                coordinator.tracker.submit(Contribution(rid, peer, f"cid-{number}-{peer}"))
    _store_with_a_block(data)


def test_an_empty_journal_next_to_a_store_with_blocks_is_refused(tmp_path: Path) -> None:
    _store_with_a_block(tmp_path)
    (tmp_path / DB_FILENAME).write_bytes(b"")
    with pytest.raises(JournalMissing) as info:
        Coordinator.open(tmp_path)
    assert info.value.path == tmp_path / DB_FILENAME and info.value.state == "empty"
    assert str(tmp_path / DB_FILENAME) in str(info.value) and "reset" in str(info.value)
    assert (tmp_path / DB_FILENAME).read_bytes() == b""  # left as it was found


def test_a_missing_journal_next_to_a_store_with_blocks_is_refused(tmp_path: Path) -> None:
    _journal_with_rounds(tmp_path)
    (tmp_path / DB_FILENAME).unlink()
    with pytest.raises(JournalMissing, match="missing") as info:
        Coordinator.open(tmp_path)
    assert info.value.state == "missing"
    assert not (tmp_path / DB_FILENAME).exists()  # nothing created in its place


def test_a_journal_without_tables_counts_as_empty(tmp_path: Path) -> None:
    """What is left when the WAL holding a new journal's first commits is deleted."""
    _store_with_a_block(tmp_path)
    conn = sqlite3.connect(tmp_path / DB_FILENAME)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.close()
    with pytest.raises(JournalMissing, match="empty"):
        Coordinator.open(tmp_path)


def test_a_new_data_directory_starts_a_journal(tmp_path: Path) -> None:
    with Coordinator.open(tmp_path / "fresh") as coordinator:
        assert coordinator.tracker.rounds() == []
    assert (tmp_path / "fresh" / DB_FILENAME).stat().st_size > 0


def test_reset_starts_a_fresh_journal_and_keeps_the_old_one_aside(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _journal_with_rounds(tmp_path, rounds=3)
    caplog.set_level(logging.INFO, logger="tensorswap.rounds.journal.persist")
    with Coordinator.open(tmp_path, reset=True, run_timer=False) as coordinator:
        assert coordinator.tracker.rounds() == []
    (aside,) = tmp_path.glob(f"{DB_FILENAME}.reset-*[0-9Z]")
    assert "fresh round journal" in caplog.text and str(aside) in caplog.text
    with RoundDatabase(aside) as old:  # nothing was lost: the old journal opens as it was
        assert len(old.load()) == 3
    with Coordinator.open(tmp_path, run_timer=False) as coordinator:  # the fresh one stays
        assert coordinator.tracker.rounds() == []


def test_reset_over_an_empty_journal_starts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _store_with_a_block(tmp_path)
    (tmp_path / DB_FILENAME).write_bytes(b"")
    caplog.set_level(logging.INFO, logger="tensorswap.rounds.journal.persist")
    with Coordinator.open(tmp_path, reset=True, run_timer=False) as coordinator:
        coordinator.tracker.start(RoundId(1, "init"))
    with Coordinator.open(tmp_path, run_timer=False) as coordinator:
        assert [i.round_id for i in coordinator.tracker.rounds()] == [RoundId(1, "init")]
    assert "fresh round journal" in caplog.text


def _corrupt_page(path: Path, page: int) -> None:
    with sqlite3.connect(path) as conn:
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
    conn.close()
    with open(path, "r+b") as f:
        f.seek((page - 1) * page_size)
        f.write(bytes(range(256)) * (page_size // 256))


@pytest.mark.parametrize("page", [3, 4])
def test_a_journal_with_damaged_pages_is_refused(tmp_path: Path, page: int) -> None:
    _journal_with_rounds(tmp_path)
    _corrupt_page(tmp_path / DB_FILENAME, page)
    with pytest.raises(JournalDamaged) as info:
        Coordinator.open(tmp_path)
    assert info.value.path == tmp_path / DB_FILENAME
    assert str(tmp_path / DB_FILENAME) in str(info.value) and info.value.detail
    assert info.value.detail in str(info.value)


def test_quick_check_findings_are_named(tmp_path: Path) -> None:
    _journal_with_rounds(tmp_path)
    _corrupt_page(tmp_path / DB_FILENAME, 3)  # an index page: quick_check reports it
    with pytest.raises(JournalDamaged, match="quick_check") as info:
        RoundDatabase.in_dir(tmp_path)
    assert "Page 3" in info.value.detail


def test_a_file_that_is_no_database_is_refused(tmp_path: Path) -> None:
    (tmp_path / DB_FILENAME).write_bytes(b"not a database, " * 512)
    with pytest.raises(JournalDamaged, match="not a database"):
        RoundDatabase.in_dir(tmp_path)


def test_rows_that_do_not_parse_are_a_damaged_journal(tmp_path: Path) -> None:
    _journal_with_rounds(tmp_path, rounds=1)
    with sqlite3.connect(tmp_path / DB_FILENAME) as conn:
        conn.execute("UPDATE rounds SET params = '{not json'")
    conn.close()
    with pytest.raises(JournalDamaged, match="round 1-init"):
        Coordinator.open(tmp_path)


def test_restored_rounds_and_contributions_are_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _journal_with_rounds(tmp_path, rounds=3)
    caplog.set_level(logging.INFO, logger="tensorswap.rounds.journal.persist")
    with Coordinator.open(tmp_path, run_timer=False):
        pass
    (record,) = [r for r in caplog.records if "restored" in r.getMessage()]
    assert record.levelno == logging.INFO
    assert "3 round(s) and 6 contribution(s)" in record.getMessage()
    assert str(tmp_path / DB_FILENAME) in record.getMessage()


def test_serve_refuses_a_lost_journal_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _store_with_a_block(tmp_path)
    (tmp_path / DB_FILENAME).write_bytes(b"")
    rc = main(["serve", "--listen", "127.0.0.1:0", "--data", str(tmp_path)])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error")]
    assert (rc, len(lines)) == (2, 1), err
    assert "Traceback" not in err and "is empty" in lines[0] and "--reset" in lines[0]


def test_serve_help_says_what_reset_does(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--reset Start a fresh round journal" in text and "rounds are forgotten" in text


def test_serve_reset_starts_over_a_lost_journal(tmp_path: Path) -> None:
    _store_with_a_block(tmp_path)
    (tmp_path / DB_FILENAME).write_bytes(b"")
    argv = ["--listen", "127.0.0.1:0", "--data", str(tmp_path), "--reset"]
    seen: list[str] = []
    with subprocess.Popen(
        [sys.executable, "-m", "tensorswap.cli.serve_cmd", *argv],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        try:
            assert proc.stderr is not None
            for line in proc.stderr:  # ends when the process exits
                seen.append(line)
                if line.startswith("listening on"):
                    break
        finally:
            proc.terminate()
            proc.communicate(timeout=60)
    text = "".join(seen)
    assert "listening on 127.0.0.1:" in text, text
    assert "fresh round journal" in text and "restored 0 round(s)" in text
