"""A block store view for the intake: blocks just checked against their CIDs, over the store.

An inline submit's blocks arrive with the submit; the intake's worker thread hashes each
against its CID and writes it to the coordinator's store (``inline.put_blocks``), then screens
the update, which reads those very blocks back: two manifests and the chunks it folds. Read
from a directory store, each read opens, reads and closes a file and re-hashes the bytes. The
intake screens through ``FreshBlocks`` instead: the blocks it has just verified are answered
from the bytes it holds (hashed moments ago, on this thread, so they count as checked on this
read too), everything else from the store below, as before.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

from tensorswap.cid import Cid
from tensorswap.store import BlockStore, StoreSize

__all__ = ["FreshBlocks"]


class FreshBlocks(BlockStore):
    """``store`` with ``fresh`` (CID -> bytes that hash to it) answered from memory.

    Reads of a fresh block return its bytes, not re-hashed whatever ``verify`` says (the
    caller checked them against the CID before building this). Writes, deletes, listing and
    every block not in ``fresh`` go to ``store``. Meant to live for one intake batch: it holds
    the fresh bytes until it is dropped.
    """

    def __init__(self, store: BlockStore, fresh: Mapping[Cid, bytes | memoryview]) -> None:
        self.store = store
        self.fresh = fresh

    def _store(self, cid: Cid, data: memoryview, adopt: bool) -> None:
        self.store.put_verified(cid, data, adopt=adopt)

    def get(self, cid: Cid, *, verify: bool | None = None) -> memoryview:
        data = self.fresh.get(cid)
        if data is None:
            return self.store.get(cid, verify=verify)
        return memoryview(data).toreadonly()

    def has(self, cid: Cid) -> bool:
        return cid in self.fresh or self.store.has(cid)

    def missing(self, cids: Iterable[Cid]) -> list[Cid]:
        fresh = self.fresh
        return self.store.missing(cid for cid in cids if cid not in fresh)

    def size_of(self, cid: Cid) -> int:
        data = self.fresh.get(cid)
        return self.store.size_of(cid) if data is None else memoryview(data).nbytes

    def delete(self, cid: Cid) -> bool:
        return self.store.delete(cid)

    def __iter__(self) -> Iterator[Cid]:
        return iter(self.store)

    def inventory(self, *, rescan: bool = False) -> list[Cid]:
        return self.store.inventory(rescan=rescan)

    def size(self) -> StoreSize:
        return self.store.size()

    def touch(self, cids: Iterable[Cid]) -> None:
        self.store.touch(cids)
