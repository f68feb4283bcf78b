"""RoundDatabase: the rounds journal in SQLite (WAL), so a coordinator survives restarts."""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

from tensorswap.errors import RoundsError
from tensorswap.rounds.core.errors import JournalDamaged, JournalMissing
from tensorswap.rounds.core.state import (
    Collecting,
    Contribution,
    Layout,
    RoundId,
    RoundInfo,
    RoundSpec,
    RoundStatus,
)
from tensorswap.rounds.journal._group import GroupCommit, Write
from tensorswap.rounds.journal._rows import (
    ContributionRow,
    contributions_write,
    layout_json,
    parse_layout,
    parse_status,
    round_number,
    status_columns,
)
from tensorswap.rounds.journal.wal import Journal, Tx

if TYPE_CHECKING:
    from tensorswap.store.base import BlockStore

__all__ = ["DB_FILENAME", "SCHEMA_VERSION", "RoundDatabase", "open_journal"]

DB_FILENAME = "rounds.sqlite3"
SCHEMA_VERSION = 1

log = logging.getLogger(__name__)


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
    scale        REAL    NOT NULL DEFAULT 1.0,
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


def _add_scale(tx: Tx) -> None:
    """Version 1: contributions carry a scale (journals written before had none)."""
    if "scale" not in tx.columns("contributions"):
        tx.execute("ALTER TABLE contributions ADD COLUMN scale REAL NOT NULL DEFAULT 1.0")


_MIGRATIONS = (_add_scale,)


class RoundDatabase:
    """Rounds and contributions in one SQLite file, WAL mode, written by one serialized writer.

    Guarantees: each write method commits before it returns. With ``durable=True`` (the
    default, ``synchronous=FULL``) a committed change survives a power loss; with
    ``durable=False`` (``synchronous=NORMAL``) it survives the process being killed but
    perhaps not the machine losing power. Safe to share between threads: a lock serializes
    every use of the one connection. Round numbers are stored as SQLite integers, so rounds
    above 2**63-1 are refused here.

    Group commit (``group_commit=True``, the default): writes from threads that call at the
    same time share one transaction, so one fsync covers them all (``rounds.journal._group``); each
    call still returns only once its own write has committed, and writes commit in the
    order they were made. ``add_contributions`` queues several at once. ``before_commit``
    runs before each transaction (a coordinator flushes its block store there, so the blocks
    a contribution names are on disk before the journal records it).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        durable: bool = True,
        store_with_blocks: str | None = None,
        group_commit: bool = True,
        before_commit: Callable[[], None] | None = None,
    ) -> None:
        """Open (or create) the journal at ``path``; a damaged one is refused (JournalDamaged).

        ``PRAGMA quick_check`` runs first. ``store_with_blocks`` names the block store this
        journal belongs to when that store holds blocks: a missing or empty database (no
        tables) is then refused with JournalMissing, and left as it was found.
        """
        self.path = Path(path)
        if store_with_blocks is not None and not self.path.exists():
            raise JournalMissing(self.path, "missing", store_with_blocks)

        def inspect(tx: Tx) -> None:  # before anything writes to the file
            if store_with_blocks is not None and not tx.tables():
                raise JournalMissing(self.path, "empty", store_with_blocks)
            ((version,),) = tx.query("PRAGMA user_version")
            if version not in (0, SCHEMA_VERSION):
                raise RoundsError(
                    f"round database {self.path} has schema version {version}, "
                    f"this tensorswap reads {SCHEMA_VERSION}"
                )

        self.journal = Journal(
            self.path, durable=durable, what="round database", check=True, inspect=inspect
        )
        try:
            self.journal.register("rounds", _SCHEMA, _MIGRATIONS)
            with self.journal.transaction() as tx:
                tx.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        except BaseException:
            self.journal.close()
            raise
        self._group = GroupCommit(
            self.journal.transaction, grouped=group_commit, before=before_commit
        )

    @classmethod
    def in_dir(
        cls, data_dir: str | os.PathLike[str], *, durable: bool = True, group_commit: bool = True
    ) -> RoundDatabase:
        """The database ``<data_dir>/rounds.sqlite3`` (created if missing)."""
        return cls(Path(data_dir) / DB_FILENAME, durable=durable, group_commit=group_commit)

    def _write(self, write: Write) -> None:
        """Run ``write`` in a (group) transaction; it has committed when this returns."""
        self._group.write(self._translated(write))

    def _translated(self, write: Write) -> Write:
        def run(db: Tx) -> None:
            try:
                write(db)
            except sqlite3.Error as exc:
                raise RoundsError(f"round database {self.path}: {exc}") from exc

        return run

    @property
    def commits(self) -> tuple[int, int]:
        """(transactions committed or tried, writes they held) so far."""
        return self._group.commits, self._group.writes

    # ── RoundJournal ─────────────────────────────────────────────────────────
    def insert_round(self, info: RoundInfo) -> None:
        spec = info.spec

        def write(db: Tx) -> None:
            db.execute(
                "INSERT INTO rounds (round, initiator, expected, quorum, timeout_s, strategy,"
                " params, spec_layout, layout, status, result_cid, reason, created_at, deadline)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    round_number(info.round_id),
                    info.round_id.initiator,
                    spec.expected_peers,
                    spec.min_peers,
                    spec.timeout_s,
                    spec.strategy,
                    json.dumps(spec.stored_params(), sort_keys=True),
                    layout_json(spec.layout),
                    layout_json(info.layout),
                    *status_columns(info.status),
                    info.created_at,
                    info.deadline,
                ),
            )

        self._write(write)

    def add_contribution(
        self,
        contribution: Contribution,
        status: RoundStatus,
        layout: Layout | None,
        seq: int | None = None,
    ) -> None:
        """Journal one contribution; ``seq`` (its place in fold order) defaults to the count
        ``status`` gives (Collecting(received): received - 1)."""
        if seq is None:
            seq = status.received - 1 if isinstance(status, Collecting) else 0
        (error,) = self.add_contributions([(contribution, status, layout, seq)])
        if error is not None:
            raise error

    def add_contributions(self, items: Sequence[ContributionRow]) -> list[BaseException | None]:
        """Journal each ``(contribution, status, layout, seq)`` (as ``add_contribution``), all
        queued at once; per item the error that refused it, None for those committed.

        The round's status column moves to ``status`` only while it is Pending or
        Collecting: a contribution committed after the round ended never undoes that.
        """
        if len(items) > 1:  # one write for all; if it fails, one each (so only bad ones fail)
            (error,) = self._group.write_many([self._translated(contributions_write(items))])
            if error is None:
                return [None] * len(items)
        return self._group.write_many([self._translated(contributions_write([i])) for i in items])

    def set_status(self, round_id: RoundId, status: RoundStatus) -> None:
        self._write(lambda db: self._update_status(db, round_id, status))

    def set_spec(self, round_id: RoundId, spec: RoundSpec) -> None:
        """A round's params changed (a cut-through round made deterministic)."""
        row = (json.dumps(spec.stored_params(), sort_keys=True), round_number(round_id))
        self._write(
            lambda db: db.execute(
                "UPDATE rounds SET params = ? WHERE round = ? AND initiator = ?",
                (*row, round_id.initiator),
            )
        )

    def delete_rounds(self, round_ids: Iterable[RoundId]) -> None:
        rows = [(round_number(rid), rid.initiator) for rid in round_ids]
        self._write(
            lambda db: db.executemany("DELETE FROM rounds WHERE round = ? AND initiator = ?", rows)
        )

    def drop_contribution(self, round_id: RoundId, peer: str, reason: str) -> None:
        row = (round_number(round_id), round_id.initiator, peer, reason)
        self._write(
            lambda db: db.execute(
                "INSERT OR REPLACE INTO dropped (round, initiator, peer, reason)"
                " VALUES (?, ?, ?, ?)",
                row,
            )
        )

    def load(self) -> list[tuple[RoundInfo, list[Contribution]]]:
        """Every round with its contributions in acceptance order."""
        with self.journal.transaction() as tx:  # one consistent view of the three tables
            rounds = tx.query(
                "SELECT round, initiator, expected, quorum, timeout_s, strategy, params,"
                " spec_layout, layout, status, result_cid, reason, created_at, deadline"
                " FROM rounds ORDER BY round, initiator"
            )
            contributions = tx.query(
                "SELECT round, initiator, peer, update_cid, num_samples, nbytes,"
                " submitted_at, scale, seq FROM contributions"
                " ORDER BY round, initiator, seq, rowid"
            )
            _close_gaps(tx, contributions)
            dropped_rows = tx.query(
                "SELECT round, initiator, peer, reason FROM dropped"
                " ORDER BY round, initiator, rowid"
            )
        by_round: dict[RoundId, list[Contribution]] = {}
        for number, initiator, peer, cid, samples, nbytes, at, scale, _ in contributions:
            try:
                rid = RoundId(number, initiator)
                contribution = Contribution(rid, peer, cid, samples, nbytes, at, scale)
            except (TypeError, ValueError) as exc:
                raise JournalDamaged(
                    self.path, f"a contribution to round {number}-{initiator} does not parse: {exc}"
                ) from exc
            by_round.setdefault(rid, []).append(contribution)
        dropped: dict[RoundId, list[tuple[str, str]]] = {}
        for number, initiator, peer, why in dropped_rows:
            dropped.setdefault(RoundId(number, initiator), []).append((peer, why))
        loaded = [self._parse_round(row, by_round, dropped) for row in rounds]
        log.info(
            "round journal %s: restored %d round(s) and %d contribution(s)",
            self.path,
            len(loaded),
            len(contributions),
        )
        return loaded

    def _parse_round(
        self,
        row: Any,
        by_round: dict[RoundId, list[Contribution]],
        dropped: dict[RoundId, list[tuple[str, str]]],
    ) -> tuple[RoundInfo, list[Contribution]]:
        (number, initiator, expected, quorum, timeout_s, strategy, params) = row[:7]
        (spec_layout, layout, status, result_cid, reason, created_at, deadline) = row[7:]
        try:
            rid = RoundId(number, initiator)
            spec = RoundSpec(
                expected,
                quorum,
                timeout_s,
                strategy,
                json.loads(params),
                parse_layout(spec_layout),
            )
            items = by_round.get(rid, [])
            info = RoundInfo(
                rid,
                spec,
                parse_status(status, result_cid, reason, len(items), expected),
                tuple(c.peer for c in items),
                sum(c.nbytes for c in items),
                created_at,
                deadline,
                parse_layout(layout),
                tuple(dropped.get(rid, ())),
            )
        except (RoundsError, TypeError, ValueError, KeyError, IndexError) as exc:
            raise JournalDamaged(
                self.path, f"round {number}-{initiator} does not parse: {exc}"
            ) from exc
        return info, items

    # ── lifecycle ────────────────────────────────────────────────────────────
    def close(self) -> None:
        """Close the connection (checkpointing the WAL); idempotent."""
        self.journal.close()

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
    def _update_status(db: Tx, rid: RoundId, status: RoundStatus) -> None:
        name, cid, reason = status_columns(status)
        db.execute(
            "UPDATE rounds SET status = ?, result_cid = ?, reason = ?"
            " WHERE round = ? AND initiator = ?",
            (name, cid, reason, round_number(rid), rid.initiator),
        )


def open_journal(
    data_dir: str | os.PathLike[str],
    store: BlockStore,
    *,
    durable: bool = True,
    reset: bool = False,
    group_commit: bool = True,
    before_commit: Callable[[], None] | None = None,
) -> RoundDatabase:
    """The journal ``<data_dir>/rounds.sqlite3`` of a coordinator whose blocks are ``store``.

    Refuses to start rather than lose rounds silently: a missing or empty database while
    ``store`` holds blocks is JournalMissing, a database SQLite finds damaged is
    JournalDamaged; nothing is created or changed then. With ``reset``, an existing journal
    (healthy or not) is moved aside, with its ``-wal`` and ``-shm`` files, to
    ``rounds.sqlite3.reset-<UTC time>`` (a WARNING names it) and a fresh one is started.
    """
    path = Path(data_dir) / DB_FILENAME
    if reset:
        aside = _set_aside(path)
        where = f"the old one is kept as {aside}" if aside else "there was none"
        log.warning("starting a fresh round journal %s on request (reset): %s", path, where)
        return RoundDatabase(
            path, durable=durable, group_commit=group_commit, before_commit=before_commit
        )
    holds_blocks = next(iter(store), None) is not None
    name = str(getattr(store, "root", store))
    return RoundDatabase(
        path,
        durable=durable,
        store_with_blocks=name if holds_blocks else None,
        group_commit=group_commit,
        before_commit=before_commit,
    )


def _set_aside(path: Path) -> Path | None:
    """Rename the database and its WAL and shared-memory files to one unused ``.reset-`` name
    (they stay a consistent database there); None when there is no database or WAL."""
    parts = [Path(f"{path}{suffix}") for suffix in ("", "-wal", "-shm")]
    if not any(p.exists() for p in parts[:2]):
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    aside = path.with_name(f"{path.name}.reset-{stamp}")
    n = 1
    while any(Path(f"{aside}{suffix}").exists() for suffix in ("", "-wal", "-shm")):
        n += 1
        aside = path.with_name(f"{path.name}.reset-{stamp}-{n}")
    try:
        for part, suffix in zip(parts, ("", "-wal", "-shm"), strict=True):
            if part.exists():
                part.rename(f"{aside}{suffix}")
    except OSError as exc:
        raise RoundsError(f"cannot move the round journal {path} aside: {exc}") from exc
    return aside


def _close_gaps(tx: Tx, rows: list[Any]) -> None:
    """Renumber each round's places 0, 1, ... in fold order (rows sorted by round, initiator,
    seq, row id; ``seq`` last), in the loading transaction. A journal write that failed
    gives its places back and leaves a gap; a tracker rebuilt from the journal numbers its
    places by rank and hands out new ones after them, so the stored numbers must be those
    ranks: otherwise a place taken after this restart could sort before an older one at the
    next, and the round would be refolded in another order."""
    rank: dict[tuple[int, str], int] = {}
    moved = []
    for row in rows:
        key = (row[0], row[1])
        want = rank.get(key, 0)
        rank[key] = want + 1
        if row[-1] != want:
            moved.append((want, row[0], row[1], row[2]))
    if moved:
        tx.executemany(
            "UPDATE contributions SET seq = ? WHERE round = ? AND initiator = ? AND peer = ?",
            moved,
        )
