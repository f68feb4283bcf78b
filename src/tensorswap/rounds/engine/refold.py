"""Refolding a streaming round's accepted contributions in fold order.

A FedAvg or mean round adds each contribution to float32 sums as it is accepted, and float32
addition is not associative: the aggregate's bits depend on the order of the adds. The order
is the **fold order**, the order the contributions' places were reserved, which the tracker
and the journal keep (``rounds.core._entry``). When the sums lack contributions the round
holds (a restarted coordinator has no sums; a journal write that failed after its fold
resets them), ``catch_up`` folds the missing ones back from the store in that order before
anything new is added: a restart between any two submits, or during aggregation, gives the
bits of a run that never stopped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tensorswap.aggregate import AggregatorSpec
from tensorswap.cid import Cid
from tensorswap.errors import BlockNotFound, CorruptBlock
from tensorswap.rounds.core.errors import RoundsError
from tensorswap.rounds.core.state import Contribution
from tensorswap.rounds.engine.fold import RoundWork, load_pieces
from tensorswap.rounds.engine.updates import STREAMING_KINDS, UpdateFacts, inspect_update
from tensorswap.store import BlockStore, MalformedManifest

__all__ = ["UNREADABLE", "Lose", "catch_up", "facts_of"]

UNREADABLE = (CorruptBlock, BlockNotFound, MalformedManifest, RoundsError)
"""What reading an accepted contribution back may raise when its blocks are damaged or gone
(a directory store quarantines a block that fails its hash check): the contribution is
dropped, never folded in."""

Lose = Callable[[Contribution, Exception], None]
"""``lose(contribution, error)``: an accepted contribution could not be read back."""


def facts_of(store: BlockStore, contribution: Contribution) -> UpdateFacts:
    """What the manifests of an accepted contribution say (manifests re-hashed as read)."""
    key = contribution.round_id.as_key()
    cid = Cid.parse(contribution.update_cid)
    return inspect_update(store, cid, key, contribution.peer, verify=True)


def catch_up(
    store: BlockStore,
    work: RoundWork,
    spec: AggregatorSpec,
    held: Sequence[Contribution],
    lose: Lose,
) -> None:
    """Make ``work``'s sums hold every contribution of ``held`` (the round's live ones, in fold
    order), folded in that order; the caller holds ``work.lock``.

    The sums normally hold a prefix of ``held`` and the rest is folded after it. Should they
    hold one that comes after a missing one, they are rebuilt from the start, so the order
    of the adds is always ``held``'s. Each one is re-hashed as it is read; one that cannot
    be read goes to ``lose`` and is left out. Nothing happens for kinds that do not fold
    (they read every contribution at the end, in the same order).
    """
    if spec.kind not in STREAMING_KINDS:
        return
    first = next((i for i, c in enumerate(held) if c.peer not in work.folded), None)
    if first is None:
        return
    live = {c.peer for c in held}
    if work.acc is not None and (
        any(c.peer in work.folded for c in held[first:]) or not work.folded <= live
    ):
        work.reset()  # out of order, or holding one no longer live: start again
        first = 0
    if work.acc is None:
        work.reset(spec)
        first = 0
    for c in held[first:]:
        try:
            facts = facts_of(store, c)
            loaded, cut, n = load_pieces(store, facts, work.bounds)
        except UNREADABLE as exc:
            lose(c, exc)
            continue
        work.fold(loaded, cut, n, facts, c.scale)
        work.folded.add(c.peer)
        del loaded  # unmapped before the next one is read: one contribution's chunks at a time
