"""What a RoundClient's own store keeps: the blocks of its latest rounds, not of every round.

A client made without a store holds its updates and the results it fetched in a
MemoryStore of its own. Every submit put a model's worth of blocks there and every fetch
another, so a peer training for a thousand rounds held a thousand models. The client now
hands the blocks each round brought in (what it submitted, the result it fetched) to
``RoundBlocks``, which keeps those of the newest ``rounds`` rounds and deletes a block once
no kept round lists it (a chunk shared across rounds, a frozen layer, stays while any does).
A store the caller passed in is the caller's: nothing is deleted from it.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable

from tensorswap.cid import Cid
from tensorswap.rounds.core import RoundId
from tensorswap.store import BlockStore

__all__ = ["ROUNDS_HELD", "RoundBlocks"]

ROUNDS_HELD = 2
"""Rounds whose blocks a client's own store keeps: the current one (its submit is what lets
``fetch_result`` skip the chunks the result shares with it, and swarm peers fetch from it)
and the one before, still being fetched by slower peers."""


class RoundBlocks:
    """The blocks each recent round brought into ``store``, deleted as rounds age out."""

    def __init__(self, store: BlockStore, rounds: int = ROUNDS_HELD) -> None:
        if rounds < 1:
            raise ValueError(f"rounds must be at least 1, got {rounds}")
        self.store = store
        self.rounds = rounds
        self._held: OrderedDict[RoundId, set[Cid]] = OrderedDict()
        self._refs: Counter[Cid] = Counter()
        self.deleted = 0
        """Blocks deleted from the store so far."""

    def hold(self, round_id: RoundId, cids: Iterable[Cid]) -> None:
        """Record that ``round_id`` uses ``cids``; forget (and delete the blocks only they
        used of) the rounds beyond the newest ``rounds`` ones, by when each was first held."""
        held = self._held.get(round_id)
        if held is None:
            held = self._held[round_id] = set()
        for cid in cids:
            if cid not in held:
                held.add(cid)
                self._refs[cid] += 1
        while len(self._held) > self.rounds:
            _, old = self._held.popitem(last=False)
            for cid in old:
                self._refs[cid] -= 1
                if self._refs[cid] <= 0:
                    del self._refs[cid]
                    if self.store.delete(cid):
                        self.deleted += 1

    @property
    def held_rounds(self) -> list[RoundId]:
        """The rounds whose blocks are kept, oldest first."""
        return list(self._held)
