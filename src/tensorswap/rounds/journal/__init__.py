"""Rounds journal: the public ``Journal`` (one SQLite file in WAL mode, table owners
registering their schema and migrations, transactions and queries) and the coordinator's
rounds kept in it (``rounds.sqlite3``), with group commit."""

from tensorswap.rounds.journal.persist import DB_FILENAME, RoundDatabase
from tensorswap.rounds.journal.wal import Journal, Migration, Tx, transient_journal_error

__all__ = [
    "DB_FILENAME",
    "Journal",
    "Migration",
    "RoundDatabase",
    "Tx",
    "transient_journal_error",
]
