"""Blocks a coordinator holds in memory only: SecAgg+ masked vectors.

A secure round's peers push their masked vectors as blocks of the ``tensorswap-masked``
codec. The session folds each into its running sum as it takes it and never reads one
again, and a coordinator restarted between phases fails the round (no masked vector or key
is persisted, by design), so a file per vector bought nothing: on this machine's ext4 it
cost ~40% of the coordinator's CPU in a round of 8 x 4 MiB vectors (inode allocation among
recently deleted inodes, the copy into fresh page-cache pages), ~46 ms a round. These blocks
live in ``VolatileBlocks`` instead, the received buffer adopted as it is (no copy), up to a
byte budget (``DEFAULT_VOLATILE_BYTES``); beyond it a block goes to a file like any other,
so memory stays bounded whoever pushes. They have ages (``touch``, grace periods) like
files, and a collection sees them, so one pushed and never posted is collected like an
orphaned file. A restart forgets them, which a secure round tolerates and nothing else
stores this codec.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

from tensorswap.cid import Cid, Multicodec

__all__ = ["DEFAULT_VOLATILE_BYTES", "VOLATILE_CODECS", "VolatileBlocks"]

DEFAULT_VOLATILE_BYTES = 512 << 20
"""Bytes of masked vectors a coordinator holds in memory at most (then files)."""

VOLATILE_CODECS = frozenset({Multicodec.TENSORSWAP_MASKED})
"""The codecs whose blocks may be held in memory only."""


class VolatileBlocks:
    """CID -> read-only bytes, in memory, at most ``limit_bytes`` in all. Thread-safe."""

    def __init__(self, limit_bytes: int = DEFAULT_VOLATILE_BYTES) -> None:
        if limit_bytes < 0:
            raise ValueError(f"limit_bytes must not be negative, got {limit_bytes}")
        self.limit_bytes = limit_bytes
        self._blocks: dict[Cid, tuple[memoryview, float]] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, cid: Cid, data: memoryview, adopt: bool) -> bool:
        """Hold ``data`` (verified against ``cid`` by the caller) if it fits in the budget,
        adopted or copied; False (nothing held) if it does not. A block already held has its
        age restarted, as a file's put does."""
        with self._lock:
            held = self._blocks.get(cid)
            if held is not None:
                self._blocks[cid] = (held[0], time.time())
                return True
            if self._bytes + data.nbytes > self.limit_bytes:
                return False
            self._bytes += data.nbytes
        kept = (data if adopt else memoryview(bytes(data))).toreadonly()
        with self._lock:
            if cid in self._blocks:  # another thread put it meanwhile
                self._bytes -= data.nbytes
            else:
                self._blocks[cid] = (kept, time.time())
        return True

    def get(self, cid: Cid) -> memoryview | None:
        with self._lock:
            held = self._blocks.get(cid)
        return None if held is None else held[0]

    def __contains__(self, cid: object) -> bool:
        return cid in self._blocks

    def age_of(self, cid: Cid) -> float | None:
        with self._lock:
            held = self._blocks.get(cid)
        return None if held is None else max(0.0, time.time() - held[1])

    def touch(self, cids: Iterable[Cid]) -> None:
        now = time.time()
        with self._lock:
            for cid in cids:
                held = self._blocks.get(cid)
                if held is not None:
                    self._blocks[cid] = (held[0], now)

    def delete(self, cid: Cid) -> bool:
        with self._lock:
            held = self._blocks.pop(cid, None)
            if held is not None:
                self._bytes -= held[0].nbytes
        return held is not None

    def delete_if_older(self, cid: Cid, min_age: float) -> bool | None:
        """True: deleted; None: held but younger than ``min_age``; False: not held."""
        with self._lock:
            held = self._blocks.get(cid)
            if held is None:
                return False
            if time.time() - held[1] < min_age:
                return None
            del self._blocks[cid]
            self._bytes -= held[0].nbytes
        return True

    def cids(self) -> list[Cid]:
        with self._lock:
            return list(self._blocks)

    @property
    def nbytes(self) -> int:
        """Bytes held now."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._blocks)
