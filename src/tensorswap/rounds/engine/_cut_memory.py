"""What a coordinator's cut-through state forgets, and when: rounds beyond ``ROUNDS_KEPT``
(ended ones first), and ended rounds whose announcements no longer fit the cap on announced
manifest bytes (``CutThrough.max_announced_bytes``)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

from tensorswap.rounds.core.state import RoundId
from tensorswap.rounds.engine._cut_round import RoundCut

if TYPE_CHECKING:
    from tensorswap.cid import Cid
    from tensorswap.rounds.engine._cut_round import Piece

__all__ = ["ROUNDS_KEPT", "CutMemory"]

ROUNDS_KEPT = 32  # rounds whose cut-through state is remembered (ended ones go first)


class CutMemory:
    """The forgetting half of ``CutThrough`` (a mixin over its state)."""

    _rounds: OrderedDict[RoundId, RoundCut]
    _index: dict[Cid, list[tuple[RoundId, str, Piece]]]
    _lock: threading.Lock
    _held_bytes: int
    announced_bytes: int
    max_announced_bytes: int

    if TYPE_CHECKING:  # CutThrough's own

        def _abandon_locked(self, rid: RoundId, rc: RoundCut, reason: str) -> None: ...

        def _unindex_locked(self, rid: RoundId, rc: RoundCut) -> None: ...

    def _make_room(self, nbytes: int, keep: RoundId, forgotten: list[RoundId]) -> bool:
        """Whether ``nbytes`` more announced bytes fit, forgetting ended rounds (oldest first,
        never ``keep``) to make room; the caller holds ``self._lock``."""
        while self.announced_bytes + nbytes > self.max_announced_bytes:
            victim = next((r for r, c in self._rounds.items() if c.ended and r != keep), None)
            if victim is None:
                return False
            self._forget_locked(victim, self._rounds.pop(victim))
            forgotten.append(victim)
        return True

    def _evict(self) -> list[RoundId]:
        """Forget the oldest rounds beyond ``ROUNDS_KEPT`` (ended ones first), their held
        values and index entries; the caller holds ``self._lock`` (and tells their streams)."""
        gone = []
        while len(self._rounds) > ROUNDS_KEPT:
            victim = next((r for r, rc in self._rounds.items() if rc.ended), None)
            if victim is None:
                victim = next(iter(self._rounds))
            self._forget_locked(victim, self._rounds.pop(victim))
            gone.append(victim)
        return gone

    def _forget_locked(self, rid: RoundId, rc: RoundCut) -> None:
        """A round popped from ``_rounds``: abandoned, its held values, index entries and
        announced bytes let go; the caller holds ``self._lock``."""
        with rc.lock:
            self._abandon_locked(rid, rc, "forgotten (too many rounds at once)")
            held, rc.held = rc.held, {}
            announced = sum(got.nbytes for got in rc.announced.values())
        self._held_bytes -= sum(v.nbytes for v in held.values())
        self.announced_bytes -= announced
        self._unindex_locked(rid, rc)
