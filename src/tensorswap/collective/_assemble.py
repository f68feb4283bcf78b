"""A call's result, assembled as the reduced slices are published, not all after the seal."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from tensorswap._alloc import empty
from tensorswap.cid import Cid
from tensorswap.collective._compress import ChunkCodec
from tensorswap.store import MemoryStore

__all__ = ["Assembly"]


class Assembly:
    """The result vector of one call, filled chunk by chunk.

    ``place`` copies (decodes) a reduced chunk into the vector and notes under which CID
    it did; ``finish`` then copies every chunk whose noted CID is not the one finally
    published for it. So a slice published early is copied while later slices are still
    in flight (off the call's tail), and what is returned is still only the bytes of the
    published CIDs: each block was checked against its CID when the store took it (or
    hashed here, for this peer's own fold), and a chunk copied under a CID a drop made
    stale is copied again. A lock makes each chunk's copy and its note one step, so two
    copies of one chunk (a slice published twice, over two live sets) never leave the
    vector holding other bytes than the note says.
    """

    def __init__(
        self, store: MemoryStore, codec: ChunkCodec, bounds: Sequence[tuple[int, int]], total: int
    ) -> None:
        self.store = store
        self.codec = codec
        self.bounds = bounds
        self.out = empty(total, np.float32)
        self.placed: dict[int, Cid] = {}
        self._lock = threading.Lock()

    def lacking(self, chunks: Sequence[tuple[int, Cid]]) -> list[tuple[int, Cid]]:
        """Of ``(chunk index, CID)`` pairs, those not placed under that CID yet."""
        return [(k, cid) for k, cid in chunks if self.placed.get(k) != cid]

    def place(self, chunks: Sequence[tuple[int, Cid]]) -> None:
        """Copy each chunk ``k`` from the store's block ``cid`` into the vector (a worker
        thread's work: each copy is tens of milliseconds at 4 MiB on a loaded machine)."""
        for k, cid in chunks:
            start, stop = self.bounds[k]
            data = self.store.get(cid)
            with self._lock:
                if self.placed.get(k) == cid:
                    continue
                self.out[start:stop] = self.codec.decode(data, stop - start)
                self.placed[k] = cid

    def finish(self, chunks: Sequence[tuple[int, Cid]]) -> np.ndarray:
        """The result: every chunk of ``chunks`` (all of them, with their published CIDs)
        placed under its CID, those not yet copied now."""
        self.place(self.lacking(chunks))
        return self.out
