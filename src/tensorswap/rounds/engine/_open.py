"""``Coordinator.open``: a coordinator over a data directory (journal and directory store)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from tensorswap.rounds.journal.persist import open_journal
from tensorswap.rounds.storage._tiered import CoordinatorStore

_C = TypeVar("_C")

__all__ = ["STORE_DIRNAME", "open_in_dir"]

STORE_DIRNAME = "blocks"
"""``Coordinator.open(dir)`` keeps its directory store in ``<dir>/blocks``."""


def open_in_dir(
    cls: Callable[..., _C],
    data_dir: str | os.PathLike[str],
    *,
    durable: bool,
    reset: bool,
    group_commit: bool,
    sync_blocks: bool,
    **kwargs: object,
) -> _C:
    """``cls`` over ``<data_dir>/rounds.sqlite3`` and a ``CoordinatorStore`` (a directory
    store keeping inline blocks in SQLite, ``rounds.storage._tiered``) in ``<data_dir>/blocks`` (see
    ``Coordinator.open``); on failure whatever was opened is closed again."""
    root = Path(data_dir)
    store = CoordinatorStore(root / STORE_DIRNAME, trust_own_writes=True)
    try:
        journal = open_journal(
            root,
            store,
            durable=durable,
            reset=reset,
            group_commit=group_commit,
            before_commit=store.sync if sync_blocks else None,
        )
    except BaseException:
        store.close()
        raise
    try:
        return cls(store, journal=journal, owns=True, **kwargs)
    except BaseException:
        journal.close()
        store.close()
        raise
