"""Journal: the one public way to keep tables in a coordinator's SQLite file.

A ``Journal`` is one connection to one database file in WAL mode, serialized by one lock.
Table owners (the rounds journal, the runs journal, the privacy ledger, secure runs, a
region's journal) each ``register`` their schema and migrations once, then write in
``transaction()`` blocks and read with ``query()``. Nobody outside this package holds a
connection or its lock: a ``Tx`` is all a transaction body sees.

Schema versions live in the table ``journal_owners`` (owner, version): ``register`` brings an
owner's tables from the version recorded there to ``len(migrations)``, in one transaction,
then creates what the schema adds. An owner whose tables exist but who has no row wrote them
before the registry existed (version 0): its migrations from 0 run and must hold on tables
that already have their change (check ``Tx.columns``). A file recorded at a newer version
than this code knows is refused, not downgraded.
"""

from __future__ import annotations

import os
import re
import sqlite3
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from tensorswap.errors import RoundsError
from tensorswap.rounds.core.errors import JournalDamaged

__all__ = ["Journal", "Migration", "Tx", "transient_journal_error"]

Row = tuple[Any, ...]
Migration = str | Callable[["Tx"], None]
"""One step of an owner's schema: a single SQL statement, or a function run on the
transaction (for steps that look before they change, e.g. add a column only if missing)."""

_REGISTRY = """
CREATE TABLE IF NOT EXISTS journal_owners (
    owner    TEXT    PRIMARY KEY,
    version  INTEGER NOT NULL
);
"""
_TABLE = re.compile(r"CREATE\s+TABLE\s+(?:IF\s+NOT\s+EXISTS\s+)?(\w+)", re.IGNORECASE)
# SQLite's result codes for a damaged file (anything else, a lock or a full disk, is not).
_DAMAGED = {"SQLITE_CORRUPT", "SQLITE_NOTADB"}
_MAX_DETAIL = 400
_TRANSIENT = ("database or disk is full", "disk i/o error")


def transient_journal_error(exc: BaseException) -> bool:
    """Whether ``exc`` is an SQLite failure that may pass (a full disk, an I/O error), so a
    write is worth retrying later."""
    return isinstance(exc, sqlite3.OperationalError) and any(
        marker in str(exc).lower() for marker in _TRANSIENT
    )


def statements(script: str) -> list[str]:
    """``script`` cut into complete SQL statements (``sqlite3.complete_statement``)."""
    out: list[str] = []
    pending = ""
    for line in script.splitlines(keepends=True):
        pending += line
        if sqlite3.complete_statement(pending):
            if pending.strip():
                out.append(pending.strip())
            pending = ""
    if pending.strip():
        out.append(pending.strip())
    return out


class Tx:
    """Statements inside one of a ``Journal``'s transactions (a view, not the connection)."""

    __slots__ = ("_conn",)

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def execute(self, sql: str, args: Sequence[object] = ()) -> int:
        """Run one statement; the number of rows it changed."""
        cursor = self._conn.execute(sql, args)
        try:
            return cursor.rowcount
        finally:
            cursor.close()

    def executemany(self, sql: str, rows: Iterable[Sequence[object]]) -> int:
        cursor = self._conn.executemany(sql, rows)
        try:
            return cursor.rowcount
        finally:
            cursor.close()

    def query(self, sql: str, args: Sequence[object] = ()) -> list[Row]:
        return self._conn.execute(sql, args).fetchall()

    def columns(self, table: str) -> set[str]:
        """The column names of ``table`` (empty when it does not exist)."""
        if not table.isidentifier():
            raise ValueError(f"not a table name: {table!r}")
        return {str(row[1]) for row in self._conn.execute(f"PRAGMA table_info({table})")}

    def tables(self) -> set[str]:
        return {str(r[0]) for r in self._conn.execute("SELECT name FROM sqlite_master")}


class Journal:
    """One SQLite file in WAL mode, one serialized writer, many table owners.

    ``durable`` sets ``synchronous=FULL`` (a commit survives a power loss) rather than
    NORMAL (it survives the process being killed). ``error`` turns a message into the
    exception the owner's callers catch (a RunsError for the runs journal, ...). With
    ``check`` the file is ``PRAGMA quick_check``-ed before anything writes to it, and
    ``inspect`` (if given) looks at it then too (it may refuse by raising); a damaged file is
    JournalDamaged, and is closed again unchanged.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        durable: bool = True,
        foreign_keys: bool = True,
        error: Callable[[str], Exception] = RoundsError,
        what: str = "journal",
        check: bool = False,
        inspect: Callable[[Tx], None] | None = None,
    ) -> None:
        self.path = Path(path)
        self._error = error
        self._what = what
        self._lock = threading.Lock()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._conn = sqlite3.connect(
                self.path, isolation_level=None, check_same_thread=False, timeout=30.0
            )
        except (OSError, sqlite3.Error) as exc:
            raise error(f"cannot open the {what} {self.path}: {exc}") from exc
        try:
            if check:
                self._quick_check()
            if inspect is not None:
                inspect(Tx(self._conn))
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
            if foreign_keys:
                self._conn.execute("PRAGMA foreign_keys=ON")
            self._conn.executescript(_REGISTRY)
        except sqlite3.Error as exc:
            self._conn.close()
            if getattr(exc, "sqlite_errorname", "") in _DAMAGED:
                raise JournalDamaged(self.path, str(exc)) from exc
            raise error(f"cannot initialise the {what} {self.path}: {exc}") from exc
        except BaseException:
            self._conn.close()
            raise

    def _quick_check(self) -> None:
        findings = [row[0] for row in self._conn.execute("PRAGMA quick_check")]
        if findings != ["ok"]:
            detail = "; ".join(" ".join(str(f).split()) for f in findings)
            if len(detail) > _MAX_DETAIL:
                detail = detail[: _MAX_DETAIL - 3] + "..."
            raise JournalDamaged(self.path, f"PRAGMA quick_check says: {detail}")

    def _fail(self, exc: sqlite3.Error) -> Exception:
        return self._error(f"{self._what} {self.path}: {exc}")

    # ── schema ───────────────────────────────────────────────────────────────
    def register(self, owner: str, schema: str, migrations: Sequence[Migration] = ()) -> int:
        """Make ``owner``'s tables current: run its migrations from its recorded version to
        ``len(migrations)``, then ``schema`` (``CREATE ... IF NOT EXISTS`` statements), and
        record the version, all in one transaction. Returns that version."""
        target = len(migrations)
        owned = set(_TABLE.findall(schema))
        with self.transaction() as tx:
            rows = tx.query("SELECT version FROM journal_owners WHERE owner = ?", (owner,))
            # no row: tables written before the registry are version 0; none at all, fresh
            current = int(rows[0][0]) if rows else 0 if owned & tx.tables() else target
            if current > target:
                raise self._error(
                    f"{self._what} {self.path}: the {owner} tables are at schema version "
                    f"{current}, this tensorswap knows up to {target}"
                )
            for step in migrations[current:target]:
                if isinstance(step, str):
                    tx.execute(step)
                else:
                    step(tx)
            for statement in statements(schema):
                tx.execute(statement)
            tx.execute(
                "INSERT INTO journal_owners (owner, version) VALUES (?, ?)"
                " ON CONFLICT (owner) DO UPDATE SET version = excluded.version",
                (owner, target),
            )
        return target

    def versions(self) -> dict[str, int]:
        """Every registered owner's schema version."""
        return {str(o): int(v) for o, v in self.query("SELECT owner, version FROM journal_owners")}

    # ── reads and writes ─────────────────────────────────────────────────────
    @contextmanager
    def transaction(self) -> Iterator[Tx]:
        """``BEGIN IMMEDIATE`` ... ``COMMIT`` under the journal's lock; a body that raises
        rolls back. An SQLite error is raised as the owner's error type."""
        with self._lock:
            try:
                self._conn.execute("BEGIN IMMEDIATE")
                try:
                    yield Tx(self._conn)
                except BaseException:
                    self._conn.execute("ROLLBACK")
                    raise
                self._conn.execute("COMMIT")
            except sqlite3.Error as exc:
                raise self._fail(exc) from exc

    def query(self, sql: str, args: Sequence[object] = ()) -> list[Row]:
        """Rows of one read (autocommit: it sees every committed transaction)."""
        with self._lock:
            try:
                return self._conn.execute(sql, args).fetchall()
            except sqlite3.Error as exc:
                raise self._error(f"cannot read the {self._what} {self.path}: {exc}") from exc

    def query_one(self, sql: str, args: Sequence[object] = ()) -> Row | None:
        rows = self.query(sql, args)
        return rows[0] if rows else None

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
        return f"Journal({str(self.path)!r}, {self._what!r})"
