"""Rounds storage: the coordinator's block store tiers (SQLite and volatile), retention and
garbage collection, and the locks on a data directory."""

from tensorswap.rounds.storage._dirlock import LOCK_FILENAME, DataDirLock
from tensorswap.rounds.storage._tiered import CoordinatorStore

__all__ = ["LOCK_FILENAME", "CoordinatorStore", "DataDirLock"]
