"""RoundDatabase: the rounds journal in SQLite (WAL), so a coordinator survives restarts."""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Self

from tensorswap.errors import RoundsError
from tensorswap.rounds.state import (
    Aggregating,
    Collecting,
    Complete,
    Contribution,
    Failed,
    LayerSpec,
    Layout,
    Pending,
    RoundId,
    RoundInfo,
    RoundSpec,
    RoundStatus,
)

__all__ = ["DB_FILENAME", "SCHEMA_VERSION", "RoundDatabase"]

DB_FILENAME = "rounds.sqlite3"
SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS rounds (
    round       INTEGER NOT NULL,
    initiator   TEXT    NOT NULL,
    expected    INTEGER NOT NULL,
    quorum      INTEGER NOT NULL,
    timeout_s   REAL,
    strategy    TEXT    NOT NULL,
    params      TEXT    NOT NULL,
    spec_layout TEXT,
    layout      TEXT,
    status      TEXT    NOT NULL,
    result_cid  TEXT,
    reason      TEXT,
    created_at  REAL    NOT NULL,
    deadline    REAL,
    PRIMARY KEY (round, initiator)
);
CREATE TABLE IF NOT EXISTS contributions (
    round        INTEGER NOT NULL,
    initiator    TEXT    NOT NULL,
    peer         TEXT    NOT NULL,
    seq          INTEGER NOT NULL,
    update_cid   TEXT    NOT NULL,
    num_samples  INTEGER NOT NULL,
    nbytes       INTEGER NOT NULL,
    submitted_at REAL    NOT NULL,
    PRIMARY KEY (round, initiator, peer),
    FOREIGN KEY (round, initiator) REFERENCES rounds (round, initiator) ON DELETE CASCADE
);
CREATE TABLE IF NOT EXISTS dropped (
    round        INTEGER NOT NULL,
    initiator    TEXT    NOT NULL,
    peer         TEXT    NOT NULL,
    reason       TEXT    NOT NULL,
    PRIMARY KEY (round, initiator, peer),
    FOREIGN KEY (round, initiator) REFERENCES rounds (round, initiator) ON DELETE CASCADE
);
"""


class RoundDatabase:
    """Rounds and contributions in one SQLite file, WAL mode, written by one serialized writer.

    Guarantees: each write method commits before it returns. With ``durable=True`` (the
    default, ``synchronous=FULL``) a committed change survives a power loss; with
    ``durable=False`` (``synchronous=NORMAL``) it survives the process being killed but
    perhaps not the machine losing power. Safe to share between threads: a lock serializes
    every use of the one connection. Round numbers are stored as SQLite integers, so rounds
    above 2**63-1 are refused here.
    """

    def __init__(self, path: str | os.PathLike[str], *, durable: bool = True) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._conn = sqlite3.connect(
                self.path, isolation_level=None, check_same_thread=False, timeout=30.0
            )
        except (OSError, sqlite3.Error) as exc:
            raise RoundsError(f"cannot open round database {self.path}: {exc}") from exc
        try:
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
            self._conn.execute("PRAGMA foreign_keys=ON")
            version = self._conn.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, SCHEMA_VERSION):
                raise RoundsError(
                    f"round database {self.path} has schema version {version}, "
                    f"this tensorswap reads {SCHEMA_VERSION}"
                )
            self._conn.executescript(_SCHEMA)
            self._conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        except sqlite3.Error as exc:
            self._conn.close()
            raise RoundsError(f"cannot initialise round database {self.path}: {exc}") from exc
        except BaseException:
            self._conn.close()
            raise

    @classmethod
    def in_dir(cls, data_dir: str | os.PathLike[str], *, durable: bool = True) -> RoundDatabase:
        """The database ``<data_dir>/rounds.sqlite3`` (created if missing)."""
        return cls(Path(data_dir) / DB_FILENAME, durable=durable)

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            try:
                self._conn.execute("BEGIN IMMEDIATE")
                try:
                    yield self._conn
                except BaseException:
                    self._conn.execute("ROLLBACK")
                    raise
                self._conn.execute("COMMIT")
            except sqlite3.Error as exc:
                raise RoundsError(f"round database {self.path}: {exc}") from exc

    # ── RoundJournal ─────────────────────────────────────────────────────────
    def insert_round(self, info: RoundInfo) -> None:
        spec = info.spec
        with self._transaction() as db:
            db.execute(
                "INSERT INTO rounds (round, initiator, expected, quorum, timeout_s, strategy,"
                " params, spec_layout, layout, status, result_cid, reason, created_at, deadline)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    _round_number(info.round_id),
                    info.round_id.initiator,
                    spec.expected_peers,
                    spec.min_peers,
                    spec.timeout_s,
                    spec.strategy,
                    json.dumps(dict(spec.params), sort_keys=True),
                    _layout_json(spec.layout),
                    _layout_json(info.layout),
                    *_status_columns(info.status),
                    info.created_at,
                    info.deadline,
                ),
            )

    def add_contribution(
        self, contribution: Contribution, status: RoundStatus, layout: Layout | None
    ) -> None:
        rid = contribution.round_id
        key = (_round_number(rid), rid.initiator)
        # Acceptance order: the tracker passes Collecting(received) with this one counted.
        seq = status.received - 1 if isinstance(status, Collecting) else 0
        with self._transaction() as db:
            db.execute(
                "INSERT INTO contributions (round, initiator, peer, seq, update_cid,"
                " num_samples, nbytes, submitted_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    *key,
                    contribution.peer,
                    seq,
                    contribution.update_cid,
                    contribution.num_samples,
                    contribution.nbytes,
                    contribution.submitted_at,
                ),
            )
            self._update_status(db, rid, status)
            if layout is not None:
                db.execute(
                    "UPDATE rounds SET layout = ? WHERE round = ? AND initiator = ?",
                    (_layout_json(layout), *key),
                )

    def set_status(self, round_id: RoundId, status: RoundStatus) -> None:
        with self._transaction() as db:
            self._update_status(db, round_id, status)

    def delete_rounds(self, round_ids: Iterable[RoundId]) -> None:
        rows = [(_round_number(rid), rid.initiator) for rid in round_ids]
        with self._transaction() as db:
            db.executemany("DELETE FROM rounds WHERE round = ? AND initiator = ?", rows)

    def drop_contribution(self, round_id: RoundId, peer: str, reason: str) -> None:
        with self._transaction() as db:
            db.execute(
                "INSERT OR REPLACE INTO dropped (round, initiator, peer, reason)"
                " VALUES (?, ?, ?, ?)",
                (_round_number(round_id), round_id.initiator, peer, reason),
            )

    def load(self) -> list[tuple[RoundInfo, list[Contribution]]]:
        """Every round with its contributions in acceptance order."""
        with self._lock:
            try:
                rounds = self._conn.execute(
                    "SELECT round, initiator, expected, quorum, timeout_s, strategy, params,"
                    " spec_layout, layout, status, result_cid, reason, created_at, deadline"
                    " FROM rounds ORDER BY round, initiator"
                ).fetchall()
                contributions = self._conn.execute(
                    "SELECT round, initiator, peer, update_cid, num_samples, nbytes, submitted_at"
                    " FROM contributions ORDER BY round, initiator, seq"
                ).fetchall()
                dropped_rows = self._conn.execute(
                    "SELECT round, initiator, peer, reason FROM dropped"
                    " ORDER BY round, initiator, rowid"
                ).fetchall()
            except sqlite3.Error as exc:
                raise RoundsError(f"cannot read round database {self.path}: {exc}") from exc
        by_round: dict[RoundId, list[Contribution]] = {}
        for number, initiator, peer, cid, samples, nbytes, at in contributions:
            rid = RoundId(number, initiator)
            by_round.setdefault(rid, []).append(Contribution(rid, peer, cid, samples, nbytes, at))
        dropped: dict[RoundId, list[tuple[str, str]]] = {}
        for number, initiator, peer, why in dropped_rows:
            dropped.setdefault(RoundId(number, initiator), []).append((peer, why))
        loaded: list[tuple[RoundInfo, list[Contribution]]] = []
        for row in rounds:
            (number, initiator, expected, quorum, timeout_s, strategy, params) = row[:7]
            (spec_layout, layout, status, result_cid, reason, created_at, deadline) = row[7:]
            rid = RoundId(number, initiator)
            spec = RoundSpec(
                expected,
                quorum,
                timeout_s,
                strategy,
                json.loads(params),
                _parse_layout(spec_layout),
            )
            items = by_round.get(rid, [])
            info = RoundInfo(
                rid,
                spec,
                _parse_status(status, result_cid, reason, len(items), expected),
                tuple(c.peer for c in items),
                sum(c.nbytes for c in items),
                created_at,
                deadline,
                _parse_layout(layout),
                tuple(dropped.get(rid, ())),
            )
            loaded.append((info, items))
        return loaded

    # ── lifecycle ────────────────────────────────────────────────────────────
    def close(self) -> None:
        """Close the connection (checkpointing the WAL); idempotent."""
        with self._lock:
            self._conn.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RoundDatabase({str(self.path)!r})"

    @staticmethod
    def _update_status(db: sqlite3.Connection, rid: RoundId, status: RoundStatus) -> None:
        name, cid, reason = _status_columns(status)
        db.execute(
            "UPDATE rounds SET status = ?, result_cid = ?, reason = ?"
            " WHERE round = ? AND initiator = ?",
            (name, cid, reason, _round_number(rid), rid.initiator),
        )


def _round_number(rid: RoundId) -> int:
    if rid.round > 2**63 - 1:
        raise RoundsError(f"round number {rid.round} does not fit the round database")
    return rid.round


def _status_columns(status: RoundStatus) -> tuple[str, str | None, str | None]:
    if isinstance(status, Complete):
        return status.name, status.cid, None
    if isinstance(status, Failed):
        return status.name, None, status.reason
    return status.name, None, None


def _parse_status(
    name: str, cid: str | None, reason: str | None, received: int, expected: int
) -> RoundStatus:
    if name == Pending.name:
        return Pending()
    if name == Collecting.name:
        return Collecting(received, expected)
    if name == Aggregating.name:
        return Aggregating()
    if name == Complete.name and cid is not None:
        return Complete(cid)
    if name == Failed.name and reason is not None:
        return Failed(reason)
    raise RoundsError(f"round database holds an unknown status {name!r}")


def _layout_json(layout: Layout | None) -> str | None:
    return None if layout is None else json.dumps([layer.to_list() for layer in layout])


def _parse_layout(text: str | None) -> Layout | None:
    if text is None:
        return None
    return tuple(LayerSpec.from_list(item) for item in json.loads(text))
