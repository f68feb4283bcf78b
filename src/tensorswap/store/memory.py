"""MemoryStore: blocks held in process memory, for tests, caches and the embedded demo."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator

from tensorswap._alloc import POOL_MIN_BYTES
from tensorswap._pool import receive_buffers
from tensorswap.cid import Cid
from tensorswap.errors import BlockNotFound, CorruptBlock
from tensorswap.store.base import BlockStore, StoreSize

__all__ = ["MemoryStore"]


class MemoryStore(BlockStore):
    """Blocks in a dict keyed by CID.

    Bytes are hashed once, when they are put; ``get`` hands out read-only views of the held
    buffer without copying and without re-hashing (the memory cannot change behind our back
    unless a caller broke its ``adopt=True`` promise). ``put`` copies the data into an
    immutable buffer (a large block into a slab of the process's pool, whose pages are
    already faulted in) unless ``adopt=True``, in which case the caller's buffer itself is kept.
    """

    def __init__(self) -> None:
        self._blocks: dict[Cid, memoryview] = {}
        self._stored: dict[Cid, float] = {}  # time.monotonic() of the last put or touch
        self._nbytes = 0
        self._lock = threading.Lock()

    def _store(self, cid: Cid, data: memoryview, adopt: bool) -> None:
        with self._lock:
            if cid in self._blocks:
                self._stored[cid] = time.monotonic()
                return
        held = data.toreadonly() if adopt else _copy(data)
        with self._lock:
            self._stored[cid] = time.monotonic()
            if cid not in self._blocks:
                self._blocks[cid] = held
                self._nbytes += held.nbytes

    def get(self, cid: Cid, *, verify: bool | None = None) -> memoryview:
        """A fresh read-only view of the held bytes; re-hashed only when ``verify=True``."""
        with self._lock:
            held = self._blocks.get(cid)
        if held is None:
            raise BlockNotFound(cid)
        view = held[:]  # a view of its own: a caller's release() must not break the store's
        if verify and not cid.matches(view):
            raise CorruptBlock(cid, None, "held bytes changed after put (adopted buffer written)")
        return view

    def has(self, cid: Cid) -> bool:
        with self._lock:
            return cid in self._blocks

    def size_of(self, cid: Cid) -> int:
        with self._lock:
            held = self._blocks.get(cid)
        if held is None:
            raise BlockNotFound(cid)
        return held.nbytes

    def age_of(self, cid: Cid) -> float:
        with self._lock:
            stored = self._stored.get(cid)
        if stored is None:
            raise BlockNotFound(cid)
        return max(0.0, time.monotonic() - stored)

    def touch(self, cids: Iterable[Cid]) -> None:
        now = time.monotonic()
        with self._lock:
            for cid in cids:
                if cid in self._blocks:
                    self._stored[cid] = now

    def backdate(self, cid: Cid, seconds: float) -> None:
        """Move the block's last put or touch ``seconds`` into the past, as setting a file's
        modification time back does for a ``DirectoryStore``: for tests and simulations of
        age-based collection (``delete_if_older``) without waiting. BlockNotFound if absent."""
        with self._lock:
            if cid not in self._stored:
                raise BlockNotFound(cid)
            self._stored[cid] -= seconds

    def delete_if_older(self, cid: Cid, min_age: float) -> bool | None:
        with self._lock:
            stored = self._stored.get(cid)
            if stored is None:
                return False
            if time.monotonic() - stored < min_age:
                return None
            return self._delete_locked(cid)

    def delete(self, cid: Cid) -> bool:
        with self._lock:
            return self._delete_locked(cid)

    def _delete_locked(self, cid: Cid) -> bool:
        view = self._blocks.pop(cid, None)
        if view is None:
            return False
        self._stored.pop(cid, None)
        self._nbytes -= view.nbytes
        return True

    def __iter__(self) -> Iterator[Cid]:
        with self._lock:
            return iter(list(self._blocks))

    def size(self) -> StoreSize:
        with self._lock:
            return StoreSize(len(self._blocks), self._nbytes)

    def __repr__(self) -> str:
        size = self.size()
        return f"MemoryStore(blocks={size.blocks}, nbytes={size.nbytes})"


def _copy(data: memoryview) -> memoryview:
    """A read-only copy of ``data``: pooled memory for a large block, else ``bytes``."""
    if data.nbytes < POOL_MIN_BYTES:
        return memoryview(bytes(data))
    copy = receive_buffers().take(data.nbytes)
    copy[:] = data if data.format == "B" and data.ndim == 1 else data.cast("B")
    return copy.toreadonly()
