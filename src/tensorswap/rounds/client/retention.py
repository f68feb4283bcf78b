"""What a RoundClient's own store keeps: the blocks of its latest rounds, not of every round.

A client made without a store holds its updates and the results it fetched in a
MemoryStore of its own. Every submit put a model's worth of blocks there and every fetch
another, so a peer training for a thousand rounds held a thousand models. The client now
tells ``RoundBlocks`` which blocks each round uses (what it submitted, the result it
fetched with ``fetch_result`` or behind a submit's answer) and which of them the round
brought into the store; it keeps the rounds with the highest numbers (``rounds`` of them)
and deletes a block once no kept round lists it, if a round brought it in: a block that was
in the store before any round used it (put there by other code, e.g. a run's global model
fetched with ``fetch``) is never deleted, and a chunk shared across rounds (a frozen layer)
stays while any kept round lists it. A store the caller passed in is the caller's: nothing is
deleted from it. ``SwarmPeer.fetch_result`` into the client's own store counts too. Not
tracked: blocks a runs client's own calls bring in (they stay, as before).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence

from tensorswap.cid import Cid
from tensorswap.errors import TensorSwapError
from tensorswap.rounds.core import RoundId
from tensorswap.store import BlockStore, manifest_closure

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
        self._brought: set[Cid] = set()  # blocks a round brought in: the only ones deleted
        self._before: set[Cid] | None = None  # the store's blocks at ``begin``
        self.deleted = 0
        """Blocks deleted from the store so far."""

    def hold(self, round_id: RoundId, cids: Iterable[Cid], brought: Iterable[Cid] = ()) -> None:
        """Record that ``round_id`` uses ``cids``, of which it brought ``brought`` into the
        store; forget the rounds beyond the ``rounds`` with the highest numbers (the earliest
        held first among equal ones), deleting the blocks they brought that no kept round
        lists."""
        held = self._held.get(round_id)
        if held is None:
            held = self._held[round_id] = set()
        for cid in cids:
            if cid not in held:
                held.add(cid)
                self._refs[cid] += 1
        self._brought.update(brought)
        while len(self._held) > self.rounds:
            oldest = min(self._held, key=lambda r: r.round)
            for cid in self._held.pop(oldest):
                self._refs[cid] -= 1
                if self._refs[cid] <= 0:
                    del self._refs[cid]
                    if cid in self._brought:
                        self._brought.discard(cid)
                        if self.store.delete(cid):
                            self.deleted += 1

    def begin(self) -> None:
        """Note the blocks in the store now: a round's call about to run brings in the others."""
        self._before = set(self.store)

    def hold_new(self, round_id: RoundId, cids: Sequence[Cid]) -> None:
        """``hold`` ``cids``, of which the round brought in those not there at ``begin``."""
        before = self._before
        self.hold(round_id, cids, [c for c in cids if before is not None and c not in before])

    def hold_root(self, round_id: RoundId, root: Cid) -> None:
        """``hold_new`` the closure of ``root`` where the store holds it whole (a partial one,
        a push cut short, is left alone)."""
        if not self.store.has(root):
            return
        try:
            closure = manifest_closure(self.store, root)
        except TensorSwapError:
            return
        self.hold_new(round_id, closure)

    @property
    def held_rounds(self) -> list[RoundId]:
        """The rounds whose blocks are kept, oldest first."""
        return list(self._held)
