"""What one store object knows it holds, so that a collection need not walk the store.

Retention (``rounds.storage.retention``) lists the store at every collection. A walk of a directory
store opens every shard directory, so its cost follows the shards, not the blocks; and to
keep walks cheap the store used to remove each shard a delete left empty, which costs a new
directory (``mkdir``) for most blocks written later, since CIDs spread over 65,536 shards.
On this machine's ext4 (no journal) a ``mkdir`` took 250-1,100 us, and removing and making
directories was ~15% of a simulation's coordinator. ``Inventory`` keeps the store's own
account instead: the blocks its last full walk found, plus the blocks it has put since, less
those it has deleted. A collection reads that; a full walk (``rescan``) now and then also
finds what other processes put meanwhile.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from tensorswap.cid import Cid

__all__ = ["MAX_KNOWN", "Inventory"]

MAX_KNOWN = 1 << 20
"""Blocks an account holds at most (~200 bytes each); a store with more is walked each time,
as before there was an account, rather than held in memory."""


class Inventory:
    """The CIDs one store object holds, as far as it knows. Thread-safe.

    Unknown (``snapshot`` is None) until the first ``rescan``, and again once it would hold
    more than ``limit`` blocks. A put or delete while a rescan walks is applied over the
    walk's result, so a block put during a rescan is never lost from the account whether or
    not the walk saw its file.
    """

    def __init__(self, limit: int = MAX_KNOWN) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._known: set[Cid] | None = None
        self._walks: list[tuple[set[Cid], set[Cid]]] = []  # (added, removed) per walk running

    def added(self, cid: Cid) -> None:
        with self._lock:
            if self._known is not None:
                self._known.add(cid)
                if len(self._known) > self.limit:
                    self._known = None  # too many to hold: walked each time instead
            for added, removed in self._walks:
                added.add(cid)
                removed.discard(cid)

    def removed(self, cid: Cid) -> None:
        with self._lock:
            if self._known is not None:
                self._known.discard(cid)
            for added, removed in self._walks:
                removed.add(cid)
                added.discard(cid)

    def snapshot(self) -> list[Cid] | None:
        """The CIDs known now, or None before the first rescan."""
        with self._lock:
            return None if self._known is None else list(self._known)

    def rescan(self, walk: Callable[[], Iterable[Cid]]) -> list[Cid]:
        """Replace the account with what ``walk()`` lists, corrected by the puts and deletes
        made while it ran; the new account."""
        changes: tuple[set[Cid], set[Cid]] = (set(), set())
        with self._lock:
            self._walks.append(changes)
        found: set[Cid] | None = None
        try:
            found = set(walk())
        finally:
            with self._lock:  # one step: a put after the walk is in ``added`` or in the new set
                self._walks = [w for w in self._walks if w is not changes]
                if found is not None:
                    added, removed = changes
                    found = (found - removed) | added
                    self._known = found if len(found) <= self.limit else None
        return list(found)
