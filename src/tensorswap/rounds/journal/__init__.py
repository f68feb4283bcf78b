"""Rounds journal: the coordinator's rounds persisted in SQLite (``rounds.sqlite3``), group
commit."""

from tensorswap.rounds.journal._sqlite import open_wal, transaction
from tensorswap.rounds.journal.persist import DB_FILENAME, RoundDatabase

__all__ = ["DB_FILENAME", "RoundDatabase", "open_wal", "transaction"]
