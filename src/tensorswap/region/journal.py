"""RegionJournal: what a regional coordinator told its upstream, per round, in SQLite (WAL).

It lives in the coordinator's ``rounds.sqlite3`` beside the rounds tables (its own
connection, as the runs journal does). One row per round the region forwards: the partial
aggregate it submits upstream (by CID) and how far it got, so a region killed at any point
resumes without submitting twice or recomputing a different partial; and one row per run's
round the region folds (``region_run_rounds``: the sampled peers it covers).
"""

from __future__ import annotations

import enum
import json
import os
from dataclasses import dataclass
from pathlib import Path

from tensorswap.cid import Cid
from tensorswap.region.errors import RegionError
from tensorswap.rounds.core import RoundId
from tensorswap.rounds.journal import Journal

__all__ = ["Forward", "ForwardState", "RegionJournal"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS region_forwards (
    round      INTEGER NOT NULL,
    initiator  TEXT    NOT NULL,
    partial    TEXT    NOT NULL,
    state      TEXT    NOT NULL,
    global_cid TEXT,
    PRIMARY KEY (round, initiator)
);
CREATE TABLE IF NOT EXISTS region_run_rounds (
    round      INTEGER NOT NULL,
    initiator  TEXT    NOT NULL,
    covers     TEXT    NOT NULL,
    PRIMARY KEY (round, initiator)
);
"""


class ForwardState(enum.Enum):
    """How far a round's upstream submission got."""

    PARTIAL = "partial"
    """The partial aggregate is stored and named; not yet accepted upstream."""
    SUBMITTED = "submitted"
    """The upstream accepted it (durably): only the global result is left to fetch."""
    LATE = "late"
    """The upstream round had closed without it: the region still serves the global result."""
    RESULT = "result"
    """The upstream round completed with ``global_cid``: fetch it (if not done) and finish."""


@dataclass(frozen=True, slots=True)
class Forward:
    """One round's row: the partial submitted upstream and its state."""

    round_id: RoundId
    partial: Cid
    state: ForwardState
    global_cid: Cid | None = None


class RegionJournal:
    """The region's journal; every write commits before it returns (see ``RoundDatabase``)."""

    def __init__(self, path: str | os.PathLike[str], *, durable: bool = True) -> None:
        self.path = Path(path)
        self.journal = Journal(
            self.path, durable=durable, foreign_keys=False, error=RegionError, what="region journal"
        )
        try:
            self.journal.register("region", _SCHEMA)
        except BaseException:
            self.journal.close()
            raise

    def get(self, round_id: RoundId) -> Forward | None:
        """The round's row, or None if the region has not forwarded it."""
        row = self.journal.query_one(
            "SELECT partial, state, global_cid FROM region_forwards"
            " WHERE round = ? AND initiator = ?",
            (round_id.round, round_id.initiator),
        )
        if row is None:
            return None
        partial, state, global_cid = row
        try:
            return Forward(
                round_id,
                Cid.parse(str(partial)),
                ForwardState(state),
                None if global_cid is None else Cid.parse(str(global_cid)),
            )
        except ValueError as exc:
            raise RegionError(f"region journal {self.path}: round {round_id}: {exc}") from exc

    def record_partial(self, round_id: RoundId, partial: Cid) -> Forward:
        """Name the partial aggregate of the round (replacing one whose blocks were lost)."""
        with self.journal.transaction() as db:
            db.execute(
                "INSERT OR REPLACE INTO region_forwards VALUES (?, ?, ?, ?, NULL)",
                (round_id.round, round_id.initiator, str(partial), ForwardState.PARTIAL.value),
            )
        return Forward(round_id, partial, ForwardState.PARTIAL)

    def set_state(
        self, round_id: RoundId, state: ForwardState, global_cid: Cid | None = None
    ) -> None:
        """Move the round's row to ``state`` (with the global result's CID for RESULT)."""
        with self.journal.transaction() as db:
            db.execute(
                "UPDATE region_forwards SET state = ?, global_cid = ?"
                " WHERE round = ? AND initiator = ?",
                (
                    state.value,
                    None if global_cid is None else str(global_cid),
                    round_id.round,
                    round_id.initiator,
                ),
            )

    def record_run_round(self, round_id: RoundId, covers: list[str]) -> None:
        """Name round ``round_id`` a run's round folded here, for the peers ``covers``
        (before the regional round starts)."""
        with self.journal.transaction() as db:
            db.execute(
                "INSERT OR REPLACE INTO region_run_rounds VALUES (?, ?, ?)",
                (round_id.round, round_id.initiator, json.dumps(sorted(covers))),
            )

    def run_round(self, round_id: RoundId) -> tuple[str, ...] | None:
        """The peers a run's round folded here covers; None for any other round."""
        row = self.journal.query_one(
            "SELECT covers FROM region_run_rounds WHERE round = ? AND initiator = ?",
            (round_id.round, round_id.initiator),
        )
        return None if row is None else self._covers(round_id, row[0])

    def run_rounds(self) -> dict[RoundId, tuple[str, ...]]:
        """Every run's round folded here, with the peers it covers."""
        rows = self.journal.query("SELECT round, initiator, covers FROM region_run_rounds")
        return {
            RoundId(int(r), str(i)): self._covers(RoundId(int(r), str(i)), c) for r, i, c in rows
        }

    def _covers(self, round_id: RoundId, text: str) -> tuple[str, ...]:
        try:
            covers = json.loads(text)
        except ValueError:
            covers = None
        if not isinstance(covers, list) or not all(isinstance(p, str) for p in covers):
            raise RegionError(f"region journal {self.path}: round {round_id}: bad covers")
        return tuple(covers)

    def forget(self, keep: set[RoundId]) -> int:
        """Delete the rows of rounds not in ``keep`` (the coordinator collected them)."""
        doomed_total = 0
        for table in ("region_forwards", "region_run_rounds"):
            rows = self.journal.query(f"SELECT round, initiator FROM {table}")
            doomed = [(r, i) for r, i in rows if RoundId(int(r), str(i)) not in keep]
            if doomed:
                with self.journal.transaction() as db:
                    db.executemany(f"DELETE FROM {table} WHERE round = ? AND initiator = ?", doomed)
            doomed_total += len(doomed)
        return doomed_total

    def roots(self) -> list[Cid]:
        """The partials and global results named here (kept through collections)."""
        rows = self.journal.query("SELECT partial, global_cid FROM region_forwards")
        return [Cid.parse(c) for row in rows for c in row if c]

    def close(self) -> None:
        self.journal.close()
