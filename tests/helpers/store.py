"""Helpers shared by the store tests."""

from __future__ import annotations

import os
from pathlib import Path

from tensorswap.cid import Cid
from tensorswap.store import BlockStore, DirectoryStore, MemoryStore

STORE_KINDS = ("memory", "directory")


def make_store(kind: str, directory: Path) -> BlockStore:
    """A fresh store of ``kind``: "memory", "directory" or "directory-fsync" (in ``directory``)."""
    if kind == "memory":
        return MemoryStore()
    if kind in ("directory", "directory-fsync"):
        return DirectoryStore(directory, fsync=kind == "directory-fsync")
    raise ValueError(f"unknown store kind {kind!r}")


def make_older(store: BlockStore, cid: Cid, seconds: float) -> None:
    """Move the block's last put/touch ``seconds`` into the past (no sleeping)."""
    if isinstance(store, DirectoryStore):
        path = store.path_of(cid)
        stat = os.stat(path)
        os.utime(path, (stat.st_atime - seconds, stat.st_mtime - seconds))
    else:
        assert isinstance(store, MemoryStore)
        store.backdate(cid, seconds)
