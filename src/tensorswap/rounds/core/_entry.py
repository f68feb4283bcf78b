"""One round's state inside the RoundTracker, and a held place in it (a Ticket).

Contributions are kept in **fold order**: the order their places were reserved, which is the
order a streaming round folds them (under the round's lock) and the order the journal lists
them (``seq``, then row id). A tracker rebuilt from the journal therefore lists, and a
restarted coordinator refolds, every accepted contribution in the very order the first
process folded it: float32 sums come out bit for bit the same.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import NamedTuple

from tensorswap.rounds.core.model import Contribution, Layout, RoundInfo, RoundStatus

__all__ = ["RoundEntry", "Ticket"]


class RoundEntry:
    """A round in the tracker: its status, its accepted contributions (in fold order) and those
    reserved but not yet journaled (``pending``)."""

    __slots__ = (
        "contributions",
        "created_at",
        "deadline",
        "dropped",
        "id",
        "layout",
        "layout_durable",
        "nbytes",
        "next_seq",
        "pending",
        "seqs",
        "spec",
        "status",
    )

    def __init__(self, info: RoundInfo, contributions: Iterable[Contribution] = ()) -> None:
        self.id = info.round_id
        self.spec = info.spec
        self.status: RoundStatus = info.status
        self.created_at = info.created_at
        self.deadline = info.deadline
        self.layout = info.layout
        self.contributions: dict[str, Contribution] = {c.peer: c for c in contributions}
        self.nbytes = sum(c.nbytes for c in self.contributions.values())
        self.dropped: dict[str, str] = dict(info.dropped)
        # contributions accepted but not yet journaled: counted against the round's size
        # and for duplicates, not yet visible (received, peers, contributions)
        self.pending: dict[str, Contribution] = {}
        self.layout_durable = info.layout is not None
        # fold order: each reserved or accepted peer's place; loaded ones keep their rank (the
        # journal's order) and new places come after every one of them, never reused
        self.seqs: dict[str, int] = {peer: i for i, peer in enumerate(self.contributions)}
        self.next_seq = len(self.seqs)

    def hold(self, contribution: Contribution) -> int:
        """Reserve ``contribution``'s place (pending); its sequence number in fold order."""
        seq = self.next_seq
        self.next_seq += 1
        self.pending[contribution.peer] = contribution
        self.seqs[contribution.peer] = seq
        return seq

    def give_back(self, peer: str) -> None:
        """Forget a reserved place whose journal write failed."""
        del self.pending[peer]
        self.seqs.pop(peer, None)

    def add(self, contribution: Contribution) -> None:
        """Make a reserved (or, while loading, journaled) contribution visible, in fold order."""
        peer = contribution.peer
        self.pending.pop(peer, None)
        seq = self.seqs.setdefault(peer, self.next_seq)
        self.next_seq = max(self.next_seq, seq + 1)
        last = next(reversed(self.contributions), None)
        self.contributions[peer] = contribution
        self.nbytes += contribution.nbytes
        if last is not None and self.seqs[last] > seq:  # journaled out of order: re-sort
            ordered = sorted(self.contributions.values(), key=lambda c: self.seqs[c.peer])
            self.contributions = {c.peer: c for c in ordered}

    def in_fold_order(self) -> list[Contribution]:
        """Accepted and reserved contributions, in the order they are folded."""
        held = [*self.contributions.values(), *self.pending.values()]
        return sorted(held, key=lambda c: self.seqs[c.peer])

    def snapshot(self, peers: int | None = None) -> RoundInfo:
        """The round as a RoundInfo; with ``peers``, only that many of its peers listed."""
        names = self.contributions if peers is None else itertools.islice(self.contributions, peers)
        return RoundInfo(
            self.id,
            self.spec,
            self.status,
            tuple(names),
            self.nbytes,
            self.created_at,
            self.deadline,
            self.layout,
            tuple(self.dropped.items()),
            None if peers is None else len(self.contributions),
        )


class Ticket(NamedTuple):
    """A contribution whose place in its round is held (``RoundTracker.reserve``); ``seq`` is
    that place in fold order (journaled with it)."""

    entry: RoundEntry
    status: RoundStatus
    layout: Layout | None
    contribution: Contribution
    seq: int
