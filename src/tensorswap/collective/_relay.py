"""The rendezvous as a relay: the blocks of relayed members' calls, admitted and released."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from tensorswap.cid import Cid
from tensorswap.collective._layout import slice_range
from tensorswap.collective._state import CallState
from tensorswap.collective.messages import RelayPut
from tensorswap.errors import TensorSwapError
from tensorswap.errors.collective import RelayRefused
from tensorswap.store import BlockStore

__all__ = ["MAX_RELAY_BYTES", "Relay", "RelayRefused"]

MAX_RELAY_BYTES = 1 << 30
"""Bytes the relay holds at most over every call of every group (a put beyond waits)."""


@dataclass(slots=True)
class _Held:
    """One call's relay blocks: those the relay added to the store, with their sizes."""

    blocks: dict[Cid, int] = field(default_factory=dict)
    reduced: dict[str, int] = field(default_factory=dict)
    """Per relayed reducer, the reduced blocks it put in this call."""


class Relay:
    """Blocks pushed to (and by) relayed members, held in the rendezvous server's store.

    Admitted: a participant's chunk of slice j, named in its commitment, while slice j's
    reducer is relayed; a relayed reducer's reduced chunk of a slice assigned to it, at
    most twice the call's chunk count per reducer. Every block is hash-checked against its
    CID, and the relay holds ``max_bytes`` at most. A call's blocks are deleted when every
    final member reported its result root, or when the call (or its group) is forgotten;
    a block the store already held is never deleted (it is not counted as the relay's)."""

    def __init__(self, store: BlockStore, max_bytes: int = MAX_RELAY_BYTES) -> None:
        self.store = store
        self.max_bytes = max_bytes
        self.held: dict[tuple[str, int], _Held] = {}
        self.bytes = 0

    def admit(self, state: CallState, relayed: set[str], put: RelayPut) -> Cid:
        """The CID ``put`` may be stored under; RelayRefused otherwise."""
        try:
            cid = Cid.parse(put.cid)
        except (TensorSwapError, ValueError) as exc:
            raise RelayRefused(f"a bad CID: {exc}", liar=True) from exc
        if put.peer not in state.live or state.final is not None:
            raise RelayRefused(f"{put.peer!r} is not live in an open call {state.number}")
        if not put.slice < len(state.assign):
            raise RelayRefused(f"no slice {put.slice}", liar=True)
        reducer = state.assign[put.slice]
        if put.reduced:
            if reducer != put.peer or put.peer not in relayed:
                raise RelayRefused(f"slice {put.slice} is not {put.peer!r}'s to reduce (relayed)")
            info = state.commits.get(put.peer)
            have = self.held.get((put.group, put.call), _Held()).reduced.get(put.peer, 0)
            if info is None or have >= 2 * len(info.chunks):
                raise RelayRefused("over the relay's share of reduced chunks")
            return cid
        if reducer not in relayed:
            raise RelayRefused(f"slice {put.slice}'s reducer {reducer!r} is not relayed")
        info = state.commits.get(put.peer)
        if info is None:
            raise RelayRefused(f"{put.peer!r} has not committed", liar=True)
        mine = slice_range(len(info.chunks), len(state.participants), put.slice)
        if put.cid not in [info.chunks[k] for k in mine]:
            raise RelayRefused(f"a chunk of slice {put.slice} it did not commit to", liar=True)
        return cid

    async def put(self, put: RelayPut, cid: Cid) -> None:
        """Store ``put``'s bytes under ``cid`` (hash-checked off the loop)."""
        key = (put.group, put.call)
        if self.store.has(cid):
            if any(cid in h.blocks for h in self.held.values()):  # another call's: shared
                self.held.setdefault(key, _Held()).blocks.setdefault(cid, 0)
            return
        size = len(put.data)
        if self.bytes + size > self.max_bytes:
            raise RelayRefused(f"the relay is full ({self.bytes} bytes held)")
        try:
            await asyncio.to_thread(self.store.put_verified, cid, put.data, adopt=True)
        except TensorSwapError as exc:
            raise RelayRefused(f"a block that does not hash to its CID ({exc})", liar=True) from exc
        held = self.held.setdefault(key, _Held())
        held.blocks[cid] = size
        self.bytes += size
        if put.reduced:
            held.reduced[put.peer] = held.reduced.get(put.peer, 0) + 1

    def holds(self, cids: list[bytes]) -> bool:
        return all(self.store.has(Cid.parse(raw)) for raw in cids)

    def release(self, group: str, call: int) -> None:
        """Delete call ``call``'s relay blocks from the store."""
        held = self.held.pop((group, call), None)
        if held is None:
            return
        for cid, size in held.blocks.items():
            other = next((h for h in self.held.values() if cid in h.blocks), None)
            if other is not None:  # still another call's block: its bytes move there
                other.blocks[cid] += size
                continue
            self.store.delete(cid)
            self.bytes -= size

    def release_gone(self, group: str, kept: set[int] | None) -> None:
        """Release every call of ``group`` not in ``kept`` (None: the group is gone)."""
        for key in [k for k in self.held if k[0] == group]:
            if kept is None or key[1] not in kept:
                self.release(*key)

    def release_if_done(self, state: CallState, group: str) -> None:
        """Release a sealed call once every final member reported its result root."""
        if state.final is not None and all(p in state.roots for p in state.final):
            self.release(group, state.number)
