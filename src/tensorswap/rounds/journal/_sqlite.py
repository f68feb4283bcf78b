"""One serialized SQLite writer: a transaction that commits before it returns, or rolls back."""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["open_wal", "transaction"]


@contextmanager
def transaction(
    conn: sqlite3.Connection, lock: threading.Lock, fail: Callable[[sqlite3.Error], Exception]
) -> Iterator[sqlite3.Connection]:
    """``BEGIN IMMEDIATE`` ... ``COMMIT`` under ``lock``; a body that raises rolls back. An
    SQLite error is raised as ``fail(error)`` (from it)."""
    with lock:
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            raise fail(exc) from exc


def open_wal(
    path: str | os.PathLike[str],
    *,
    durable: bool,
    schema: str,
    foreign_keys: bool = False,
) -> sqlite3.Connection:
    """A connection in autocommit mode (transactions by ``transaction``), WAL journal,
    ``synchronous=FULL`` when ``durable`` (else NORMAL), shared across threads under the
    caller's lock, with ``schema`` (CREATE ... IF NOT EXISTS) applied. Raises sqlite3.Error
    (closed again first)."""
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30.0)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
        if foreign_keys:
            conn.execute("PRAGMA foreign_keys=ON")
        conn.executescript(schema)
    except sqlite3.Error:
        conn.close()
        raise
    return conn
