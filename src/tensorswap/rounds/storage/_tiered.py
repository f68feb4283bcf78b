"""The coordinator's block store: a directory store, with the blocks of inline submits in SQLite.

A directory store keeps one file per block, in a two-level fan-out of directories. On this
machine's ext4 a new block file costs ~110 us of system CPU to create and ~25 us to rename,
a new shard directory ~130 us: a tiny contribution (a chunk and two manifests, a few hundred
bytes each) cost ~0.4-1.2 ms of the coordinator's CPU in file-system calls alone, more than
all of its Python. ``CoordinatorStore`` keeps the blocks that arrive inside inline submits
(``rounds.protocol.inline``: at most 32 KiB an update) as rows of one SQLite table instead, written
for a whole intake batch in one transaction (``put_small``), next to the directory store's
files (``<store>/small.sqlite3``, WAL). Everything else (blocks pushed in BLOCK frames,
results, runs' models) is stored in files as before, but for SecAgg+ masked vectors (the
``tensorswap-masked`` codec), which are held in memory only (``rounds.storage._volatile``).

It is still one store: ``get``, ``has``, ``missing``, ``size_of``, ``delete``, listing,
ages, ``touch`` and ``delete_if_older`` (retention) see all three kinds. Guarantees match the
directory store's: a small block is in the table (committed to the WAL) before
``put_small`` returns, so it survives a kill -9; like a block file it is not fsynced unless
``sync`` is called (``--sync-blocks``: ``syncfs`` flushes the WAL file too). Reads re-hash a
small block unless verification is off (cheap at these sizes); one that no longer matches
its CID is deleted and raises CorruptBlock, so ``has`` turns False and it can be pushed again.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from tensorswap.cid import Cid
from tensorswap.errors import BlockNotFound, CorruptBlock, StoreError
from tensorswap.rounds.journal import Journal
from tensorswap.rounds.storage._volatile import (
    DEFAULT_VOLATILE_BYTES,
    VOLATILE_CODECS,
    VolatileBlocks,
)
from tensorswap.store import DirectoryStore, StoreSize

__all__ = ["SMALL_DB", "CoordinatorStore", "small_or_none"]

SMALL_DB = "small.sqlite3"
"""The small blocks' database, in the directory store's root."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS small_blocks (
    cid     BLOB PRIMARY KEY,
    data    BLOB NOT NULL,
    touched REAL NOT NULL
) WITHOUT ROWID;
"""


class CoordinatorStore(DirectoryStore):
    """A ``DirectoryStore`` whose ``put_small`` blocks live in ``<root>/small.sqlite3`` and
    whose masked vectors live in memory (up to ``volatile_bytes``, then in files)."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        volatile_bytes: int = DEFAULT_VOLATILE_BYTES,
        **kwargs: bool,
    ) -> None:
        super().__init__(root, **kwargs)
        self.volatile = VolatileBlocks(volatile_bytes)
        self._small_path = self.root / SMALL_DB
        self._db = Journal(
            self._small_path,
            durable=False,
            foreign_keys=False,
            error=StoreError,
            what="small blocks",
        )
        try:
            self._db.register("small_blocks", _SCHEMA)
        except BaseException:
            self._db.close()
            raise

    def _query(self, sql: str, args: tuple[object, ...] = ()) -> list[tuple[Any, ...]]:
        return self._db.query(sql, args)

    def _change(self, sql: str, rows: Sequence[tuple[object, ...]]) -> int:
        with self._db.transaction() as db:
            return db.executemany(sql, rows)

    # ── the small blocks ─────────────────────────────────────────────────────
    def put_small(self, blocks: Iterable[tuple[Cid, bytes | memoryview]]) -> None:
        """Store blocks the caller has checked against their CIDs, in one transaction; a
        block already held is replaced (its age restarts). Raises StoreError (none kept)."""
        now = time.time()
        rows = [(cid.to_bytes(), bytes(data), now) for cid, data in blocks]
        if rows:
            self._change("INSERT OR REPLACE INTO small_blocks VALUES (?, ?, ?)", rows)

    def _small(self, cid: Cid) -> bytes | None:
        found = self._query("SELECT data FROM small_blocks WHERE cid = ?", (cid.to_bytes(),))
        return found[0][0] if found else None

    def _small_touched(self, cid: Cid) -> float | None:
        found = self._query("SELECT touched FROM small_blocks WHERE cid = ?", (cid.to_bytes(),))
        return found[0][0] if found else None

    # ── BlockStore, over all three ───────────────────────────────────────────
    def _store(self, cid: Cid, data: memoryview, adopt: bool) -> None:
        if cid.codec in VOLATILE_CODECS and self.volatile.put(cid, data, adopt):
            return
        super()._store(cid, data, adopt)

    # Files first: most blocks (pushed updates, results, models) are files, and a file that is
    # not there costs one failed open. Asking the table first made every large read wait for
    # a lookup under the one lock all reading threads share: ~80 ms of a SecAgg+ round's
    # server time (py-spy), the plain round 0.21 s instead of 0.14 s in the same benchmark.
    def get(self, cid: Cid, *, verify: bool | None = None) -> memoryview:
        held = self.volatile.get(cid)  # verified as it was put, never written since
        if held is not None:
            return held
        try:
            return super().get(cid, verify=verify)
        except BlockNotFound:
            data = self._small(cid)
            if data is None:
                raise
        check = self.verify_reads if verify is None else verify
        if check and not cid.matches(data):
            actual = Cid.of(data, codec=cid.codec, hash=cid.hash)
            self._change("DELETE FROM small_blocks WHERE cid = ?", [(cid.to_bytes(),)])
            detail = f"content hashes to {actual} ({len(data)} bytes); deleted"
            raise CorruptBlock(cid, str(self._small_path), detail)
        return memoryview(data)

    def has(self, cid: Cid) -> bool:
        if cid in self.volatile or super().has(cid):
            return True
        return bool(self._query("SELECT 1 FROM small_blocks WHERE cid = ?", (cid.to_bytes(),)))

    def size_of(self, cid: Cid) -> int:
        held = self.volatile.get(cid)
        if held is not None:
            return held.nbytes
        try:
            return super().size_of(cid)
        except BlockNotFound:
            data = self._small(cid)
            if data is None:
                raise
            return len(data)

    def delete(self, cid: Cid) -> bool:
        if cid.codec in VOLATILE_CODECS and self.volatile.delete(cid):
            super().delete(cid)  # and a file of it, had it overflowed the budget once
            return True
        small = self._change("DELETE FROM small_blocks WHERE cid = ?", [(cid.to_bytes(),)])
        return super().delete(cid) or small > 0

    def age_of(self, cid: Cid) -> float:
        held = self.volatile.age_of(cid)
        if held is not None:
            return held
        touched = self._small_touched(cid)
        if touched is None:
            return super().age_of(cid)
        return max(0.0, time.time() - touched)

    def touch(self, cids: Iterable[Cid]) -> None:
        cids = list(cids)
        now = time.time()
        rows = [(now, cid.to_bytes()) for cid in cids]
        self._change("UPDATE small_blocks SET touched = ? WHERE cid = ?", rows)
        self.volatile.touch(cids)
        super().touch(cids)

    def delete_if_older(self, cid: Cid, min_age: float) -> bool | None:
        held = self.volatile.delete_if_older(cid, min_age)
        if held is True:
            super().delete_if_older(cid, min_age)  # and a file of it, had it overflowed once
        if held is not False:
            return held
        key = cid.to_bytes()
        with self._db.transaction() as db:  # no touch between the age check and the delete
            found = db.query("SELECT touched FROM small_blocks WHERE cid = ?", (key,))
            if found:
                if time.time() - found[0][0] < min_age:
                    return None
                db.execute("DELETE FROM small_blocks WHERE cid = ?", (key,))
                super().delete(cid)  # a copy in a file too (pushed in BLOCK frames)
                return True
        return super().delete_if_older(cid, min_age)

    def __iter__(self) -> Iterator[Cid]:
        small = [Cid.parse(bytes(row[0])) for row in self._query("SELECT cid FROM small_blocks")]
        small += self.volatile.cids()
        seen = set(small)
        yield from small
        yield from (cid for cid in super().__iter__() if cid not in seen)

    def inventory(self, *, rescan: bool = False) -> list[Cid]:
        small = [Cid.parse(bytes(row[0])) for row in self._query("SELECT cid FROM small_blocks")]
        small += self.volatile.cids()
        seen = set(small)
        return small + [cid for cid in super().inventory(rescan=rescan) if cid not in seen]

    def size(self) -> StoreSize:
        ((count, nbytes),) = self._query(
            "SELECT count(*), coalesce(sum(length(data)), 0) FROM small_blocks"
        )
        files = super().size()
        count, nbytes = int(count) + len(self.volatile), int(nbytes) + self.volatile.nbytes
        return StoreSize(files.blocks + count, files.nbytes + nbytes)

    def close(self) -> None:
        self._db.close()
        super().close()


def small_or_none(store: object) -> CoordinatorStore | None:
    """``store`` if it keeps small blocks (``put_small``), else None."""
    return store if isinstance(store, CoordinatorStore) else None
