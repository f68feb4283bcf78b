"""RegionJournal: what a region told its upstream survives a reopen; a damaged row is typed."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from tensorswap.cid import Cid
from tensorswap.region import ForwardState, RegionError, RegionJournal
from tensorswap.rounds.core import RoundId
from tensorswap.store import MemoryStore

A, B = RoundId(1, "lead"), RoundId(2, "lead")


def cids() -> tuple[Cid, Cid]:
    store = MemoryStore()
    return store.put(b"partial"), store.put(b"global")


def test_rows_survive_a_reopen_and_move_forward(tmp_path: Path) -> None:
    partial, result = cids()
    path = tmp_path / "rounds.sqlite3"
    journal = RegionJournal(path)
    assert journal.get(A) is None
    journal.record_partial(A, partial)
    journal.set_state(A, ForwardState.SUBMITTED)
    journal.record_partial(B, partial)
    journal.close()
    again = RegionJournal(path)
    try:
        row = again.get(A)
        assert row is not None
        assert (row.partial, row.state, row.global_cid) == (partial, ForwardState.SUBMITTED, None)
        again.set_state(A, ForwardState.RESULT, result)
        row = again.get(A)
        assert row is not None and row.global_cid == result
        assert sorted(map(str, again.roots())) == sorted(map(str, [partial, partial, result]))
        assert again.forget({A}) == 1  # B is no longer held by the coordinator
        assert again.get(B) is None and again.get(A) is not None
    finally:
        again.close()


def test_a_row_in_an_unknown_state_is_a_region_error(tmp_path: Path) -> None:
    partial, _ = cids()
    path = tmp_path / "rounds.sqlite3"
    journal = RegionJournal(path)
    journal.record_partial(A, partial)
    db = sqlite3.connect(path)
    with db:
        db.execute("UPDATE region_forwards SET state = 'sideways'")
    db.close()
    try:
        with pytest.raises(RegionError, match="sideways"):
            journal.get(A)
    finally:
        journal.close()
