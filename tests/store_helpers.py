"""Helpers shared by the store tests."""

from __future__ import annotations

import os

from tensorswap.cid import Cid
from tensorswap.store import BlockStore, DirectoryStore, MemoryStore


def make_older(store: BlockStore, cid: Cid, seconds: float) -> None:
    """Move the block's last put/touch ``seconds`` into the past (no sleeping)."""
    if isinstance(store, DirectoryStore):
        path = store.path_of(cid)
        stat = os.stat(path)
        os.utime(path, (stat.st_atime - seconds, stat.st_mtime - seconds))
    else:
        assert isinstance(store, MemoryStore)
        store._stored[cid] -= seconds
