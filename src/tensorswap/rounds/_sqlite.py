"""One serialized SQLite writer: a transaction that commits before it returns, or rolls back."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["transaction"]


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
