"""The BlockStore interface: immutable blocks addressed by their CID."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Self

from tensorswap.cid import Cid, HashFunction, Multicodec, byte_view, hash_digest
from tensorswap.errors import BlockNotFound, HashMismatch

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["BlockStore", "StoreSize"]


@dataclass(frozen=True, slots=True)
class StoreSize:
    """How much a store holds: number of blocks and their total length in bytes."""

    blocks: int
    nbytes: int


class BlockStore(ABC):
    """A set of immutable blocks keyed by CID; every implementation passes one conformance suite.

    Guarantees common to all stores:

    - ``put`` is idempotent: storing the same bytes twice keeps one block and returns one CID.
    - A block is either fully visible or absent; readers never see a partial block.
    - ``get`` returns a read-only, flat memoryview of the block's bytes without copying them,
      and never returns bytes that do not hash to the CID asked for (see each store for how).
    - All methods are safe to call from several threads at once.
    """

    def put(
        self,
        data: Buffer,
        *,
        codec: Multicodec = Multicodec.RAW,
        hash: HashFunction = HashFunction.BLAKE3,
        adopt: bool = False,
        threads: int | None = None,
    ) -> Cid:
        """Store ``data`` (any C-contiguous buffer) and return its CID.

        ``adopt=True`` promises that the caller will never write to ``data`` again, so a store
        may keep a reference to it instead of copying (the memory store does). ``threads``
        caps the hashing threads (see ``Cid.of``).
        """
        view = byte_view(data)
        cid = Cid.of(view, codec=codec, hash=hash, threads=threads)
        self._store(cid, view, adopt)
        return cid

    def put_verified(
        self, cid: Cid, data: Buffer, *, adopt: bool = False, threads: int | None = None
    ) -> Cid:
        """Store ``data`` under ``cid`` after checking that it hashes to it.

        Raises HashMismatch (and stores nothing) when it does not. Use this for blocks that
        arrive from a peer together with the CID they claim. ``threads`` caps the hashing
        threads (see ``hash_digest``; 1 suits callers that already work in parallel).
        """
        view = byte_view(data)
        actual = hash_digest(view, cid.hash, threads=threads)
        if actual != cid.digest:
            raise HashMismatch(cid, Cid(cid.codec, cid.hash, actual), "put_verified")
        self._store(cid, view, adopt)
        return cid

    @abstractmethod
    def _store(self, cid: Cid, data: memoryview, adopt: bool) -> None:
        """Store ``data`` under ``cid``; the caller has already checked that they match."""

    @abstractmethod
    def get(self, cid: Cid, *, verify: bool | None = None) -> memoryview:
        """The block's bytes as a read-only, 1-D, unsigned-byte memoryview (zero-copy).

        Raises BlockNotFound (also a KeyError) when the store lacks the block. ``verify``
        overrides the store's default re-hashing of the bytes on read where a store does it.
        """

    @abstractmethod
    def has(self, cid: Cid) -> bool:
        """Whether the store holds the block."""

    @abstractmethod
    def size_of(self, cid: Cid) -> int:
        """The block's length in bytes, without reading it; BlockNotFound if absent."""

    @abstractmethod
    def delete(self, cid: Cid) -> bool:
        """Remove the block; True if it was there, False if it already was not.

        Views returned earlier by ``get`` stay valid: deleting never invalidates memory in use.
        """

    @abstractmethod
    def __iter__(self) -> Iterator[Cid]:
        """The CIDs of all blocks held (no particular order; a snapshot or a live scan)."""

    @abstractmethod
    def size(self) -> StoreSize:
        """Number of blocks and their total length in bytes."""

    def iterate(self) -> Iterator[Cid]:
        """Same as ``iter(store)``."""
        return iter(self)

    def inventory(self, *, rescan: bool = False) -> list[Cid]:
        """The blocks held, for a garbage collection's candidates: ``list(store)`` here. A
        store may answer from its own account instead of a listing (``DirectoryStore``:
        without walking its shards, blind to other processes' puts until ``rescan=True``), so
        a block it leaves out is only collected later, never one wrongly."""
        return list(self)

    def missing(self, cids: Iterable[Cid]) -> list[Cid]:
        """The CIDs of ``cids`` that this store lacks, each once, in first-seen order."""
        seen: set[Cid] = set()
        lacking: list[Cid] = []
        for cid in cids:
            if cid in seen:
                continue
            seen.add(cid)
            if not self.has(cid):
                lacking.append(cid)
        return lacking

    def age_of(self, cid: Cid) -> float | None:
        """Seconds since the block was last stored or touched; None where the store cannot
        tell. Raises BlockNotFound when the block is absent."""
        if not self.has(cid):
            raise BlockNotFound(cid)
        return None

    def delete_if_older(self, cid: Cid, min_age: float) -> bool | None:
        """Delete the block unless it was put or touched less than ``min_age`` seconds ago.

        True: deleted; False: it was not there; None: spared (young, or the store keeps no
        ages). Stores that keep ages check and delete in one step, so a concurrent ``touch``
        or ``put`` of the block either comes first (and spares it) or finds it gone.
        """
        try:
            age = self.age_of(cid)
        except BlockNotFound:
            return False
        if age is None or age < min_age:
            return None
        return self.delete(cid)

    def touch(self, cids: Iterable[Cid]) -> None:  # noqa: B027 (optional hook)
        """Mark the blocks held among ``cids`` as just used (their age restarts at 0), so that a
        collection with a grace period spares them; absent ones are skipped. A put of a block
        already held touches it too. Stores that keep no ages ignore it."""

    def __contains__(self, cid: object) -> bool:
        return isinstance(cid, Cid) and self.has(cid)

    def close(self) -> None:  # noqa: B027 (optional hook: stores without resources keep it)
        """Release what the store holds open; views returned by ``get`` stay valid."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
