"""The round state machine: the thread-safe RoundTracker over an optional durable journal."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from tensorswap.rounds.core._entry import RoundEntry, Ticket
from tensorswap.rounds.core.errors import (
    DuplicateContribution,
    RoundAlreadyTerminal,
    RoundClosed,
    RoundNotFound,
    RoundTimeout,
    UpdateMismatch,
)
from tensorswap.rounds.core.model import (
    Aggregating,
    Collecting,
    Complete,
    Contribution,
    Failed,
    LayerSpec,
    Layout,
    Pending,
    RoundId,
    RoundInfo,
    RoundSpec,
    RoundStatus,
    layout_mismatch,
    status_from_dict,
)

__all__ = [
    "Aggregating",
    "Collecting",
    "Complete",
    "Contribution",
    "Failed",
    "LayerSpec",
    "Layout",
    "Listener",
    "Pending",
    "RoundId",
    "RoundInfo",
    "RoundJournal",
    "RoundSpec",
    "RoundStatus",
    "RoundTracker",
    "Ticket",
    "layout_mismatch",
    "status_from_dict",
]

log = logging.getLogger(__name__)


class RoundJournal(Protocol):
    """Where a RoundTracker writes every change before it becomes visible (see ``persist``).

    The tracker calls these under its own lock, one at a time; each call returns only once
    the change is durable.
    """

    def load(self) -> list[tuple[RoundInfo, list[Contribution]]]: ...

    def insert_round(self, info: RoundInfo) -> None: ...

    def add_contribution(
        self,
        contribution: Contribution,
        status: RoundStatus,
        layout: Layout | None,
        seq: int | None = None,
    ) -> None: ...

    def add_contributions(
        self, items: Sequence[tuple[Contribution, RoundStatus, Layout | None, int]]
    ) -> list[BaseException | None]: ...

    def set_status(self, round_id: RoundId, status: RoundStatus) -> None: ...

    def delete_rounds(self, round_ids: Iterable[RoundId]) -> None: ...

    def drop_contribution(self, round_id: RoundId, peer: str, reason: str) -> None: ...

    def set_spec(self, round_id: RoundId, spec: RoundSpec) -> None: ...


Listener = Callable[[RoundId, RoundStatus], None]


# ── the state machine ────────────────────────────────────────────────────────
class RoundTracker:
    """Tracks rounds and their contributions (the seed's BackwardPassCoordinator, tightened).

    Guarantees:

    - Every method is atomic and safe to call from several threads at once.
    - With a journal, each change is durable in it before the method returns, and a tracker
      built over the same journal later sees exactly the rounds and contributions it held.
    - A peer contributes at most once per round; a round takes at most ``expected_peers``
      contributions and none once it is Aggregating, Complete or Failed.
    - Terminal statuses (Complete, Failed) never change again.
    - Listeners are called after each status change, outside the lock, in change order per
      thread; a listener that raises is not retried and does not undo the change.
    """

    def __init__(
        self,
        expected_peers: int = 1,
        timeout_s: float | None = None,
        *,
        journal: RoundJournal | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.default_spec = RoundSpec(expected_peers, timeout_s=timeout_s)
        self._journal = journal
        self._clock = clock
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._rounds: dict[RoundId, RoundEntry] = {}
        self._listeners: list[Listener] = []
        self.on_settle_wait: Callable[[RoundId], None] | None = None
        """Observability seam, None by default: called (under the tracker's lock) each time
        ``settle`` waits for a reserved contribution, so a test can act at that moment."""
        if journal is not None:
            for info, contributions in journal.load():
                self._rounds[info.round_id] = RoundEntry(info, contributions)

    @property
    def timeout_s(self) -> float | None:
        """The default round timeout (the seed's ``timeout_ms``, in seconds)."""
        return self.default_spec.timeout_s

    def subscribe(self, listener: Listener) -> None:
        """Call ``listener(round_id, status)`` after every status change from now on."""
        with self._lock:
            self._listeners.append(listener)

    # ── lifecycle ────────────────────────────────────────────────────────────
    def start(self, round_id: RoundId, spec: RoundSpec | None = None) -> bool:
        """Start a round in Pending; False (and nothing changes) if it already exists."""
        spec = spec or self.default_spec
        with self._lock:
            if round_id in self._rounds:
                return False
            now = self._clock()
            deadline = None if spec.timeout_s is None else now + spec.timeout_s
            info = RoundInfo(round_id, spec, Pending(), (), 0, now, deadline, spec.layout)
            if self._journal is not None:
                self._journal.insert_round(info)
            self._rounds[round_id] = RoundEntry(info)
        self._notify(round_id, info.status)
        return True

    def make_deterministic(self, round_id: RoundId) -> bool:
        """Make the round fold in canonical order (``RoundSpec.deterministic``, journaled)
        while it holds no contribution; whether it is deterministic now. A cut-through round
        folds by peer name, so a restart, or a fallback to the barrier, must fold so too."""
        with self._lock:
            entry = self._get(round_id)
            if entry.spec.deterministic:
                return True
            if entry.contributions or entry.pending or entry.status.is_terminal:
                return False
            spec = dataclasses.replace(entry.spec, deterministic=True)
            if self._journal is not None:
                self._journal.set_spec(round_id, spec)
            entry.spec = spec
            return True

    def check_submit(self, round_id: RoundId, peer: str) -> RoundInfo:
        """Raise what ``submit`` would raise for this peer now; the round's snapshot otherwise.

        Lets a caller refuse early, before validating a large update; ``submit`` checks again.
        The snapshot lists no peers (``received`` still counts them).
        """
        with self._lock:
            entry = self._get(round_id)
            self._check_open(entry, peer)
            return entry.snapshot(peers=0)  # O(1): a full round's peers are not copied

    def submit(self, contribution: Contribution, *, layout: Layout | None = None) -> RoundStatus:
        """Accept a contribution and return the new status (Collecting).

        Raises RoundNotFound, RoundAlreadyTerminal, RoundClosed, DuplicateContribution, or
        UpdateMismatch when ``layout`` (the update's layers) differs from the round's; the
        first accepted layout becomes the round's when its spec fixed none. The journal
        write happens outside the tracker's lock, so contributions submitted by several
        threads at once share one journal transaction (group commit); each is visible
        (counted, listed, notified) only once it is durable.
        """
        (outcome,) = self.submit_many([(contribution, layout)])
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def submit_many(
        self, items: Sequence[tuple[Contribution, Layout | None]]
    ) -> list[RoundStatus | BaseException]:
        """``submit`` for each ``(contribution, layout)`` in order, journaled together: per
        item the new status, or the error that refused it (nothing recorded for it)."""
        outcomes: list[RoundStatus | BaseException] = []
        tickets: list[Ticket] = []
        for contribution, layout in items:
            try:
                tickets.append(self.reserve(contribution, layout))
                outcomes.append(Pending())
            except Exception as exc:
                outcomes.append(exc)
        recorded = iter(self.record(tickets))
        return [next(recorded) if isinstance(o, Pending) else o for o in outcomes]

    def reserve(self, contribution: Contribution, layout: Layout | None = None) -> Ticket:
        """Check a contribution as ``submit`` does and hold its place in the round (it counts
        against the round's size and for duplicates, but is not yet visible); ``record`` it
        next (always: a reserved place is only given back by ``record``)."""
        with self._lock:
            entry, status, new_layout, seq = self._reserve(contribution, layout)
            return Ticket(entry, status, new_layout, contribution, seq)

    def record(self, tickets: Sequence[Ticket]) -> list[RoundStatus | BaseException]:
        """Journal the reserved contributions (one group commit), then make each visible;
        per ticket the new status, or the journal's error (that one is given back)."""
        errors: list[BaseException | None] = [None] * len(tickets)
        if self._journal is not None and tickets:
            try:
                errors = self._journal.add_contributions(
                    [(t.contribution, t.status, t.layout, t.seq) for t in tickets]
                )
            except Exception as exc:
                errors = [exc] * len(tickets)
        outcomes: list[RoundStatus | BaseException] = []
        changed: list[tuple[RoundId, RoundStatus]] = []
        with self._lock:
            for ticket, error in zip(tickets, errors, strict=True):
                entry, contribution = ticket.entry, ticket.contribution
                if error is not None:
                    entry.give_back(contribution.peer)
                    if not entry.layout_durable and not entry.contributions and not entry.pending:
                        entry.layout = entry.spec.layout
                    outcomes.append(error)
                    continue
                entry.add(contribution)
                if ticket.layout is not None:
                    entry.layout_durable = True
                if isinstance(entry.status, Pending | Collecting):
                    entry.status = Collecting(len(entry.contributions), entry.spec.expected_peers)
                outcomes.append(entry.status)
                changed.append((entry.id, entry.status))
            self._changed.notify_all()
        for rid, status in changed:
            self._notify(rid, status)
        return outcomes

    def _reserve(
        self, contribution: Contribution, layout: Layout | None
    ) -> tuple[RoundEntry, RoundStatus, Layout | None, int]:
        """Check a contribution and hold its place (``pending``); the status to journal and
        the layout to journal with it (the round's first). Caller holds the lock."""
        key = contribution.round_id
        entry = self._get(key)
        self._check_open(entry, contribution.peer)
        new_layout = None
        if layout is not None:
            layout = tuple(layout)
            if entry.layout is None:
                entry.layout = layout  # held now; undone if its write fails
            else:
                detail = layout_mismatch(entry.layout, layout)
                if detail is not None:
                    raise UpdateMismatch(key.as_key(), contribution.peer, detail)
            if not entry.layout_durable:
                new_layout = entry.layout
        received = len(entry.contributions) + len(entry.pending) + 1
        seq = entry.hold(contribution)
        return entry, Collecting(received, entry.spec.expected_peers), new_layout, seq

    def settle(self, round_id: RoundId) -> None:
        """Wait until no contribution to the round is between its check and its journal
        write (a deadline's verdict then counts every contribution that will be kept)."""
        with self._changed:
            while (entry := self._rounds.get(round_id)) is not None and entry.pending:
                if self.on_settle_wait is not None:
                    self.on_settle_wait(round_id)
                self._changed.wait()

    def begin_aggregation(self, round_id: RoundId) -> bool:
        """Move a Pending or Collecting round to Aggregating; False if it is not in one of those.

        The one caller that gets True owns the aggregation. Raises RoundNotFound.
        """
        with self._lock:
            entry = self._get(round_id)
            if not isinstance(entry.status, Pending | Collecting):
                return False
            self._set_status(entry, Aggregating())
        self._notify(round_id, Aggregating())
        return True

    def note_aggregating(self, round_id: RoundId, reason: str) -> bool:
        """Show ``reason`` in an Aggregating round's status (a transient failure, retried);
        False if the round is not Aggregating. Not journaled: a restarted coordinator
        aggregates the round again anyway."""
        with self._lock:
            entry = self._rounds.get(round_id)
            if entry is None or not isinstance(entry.status, Aggregating):
                return False
            status = entry.status = Aggregating(reason)
        self._notify(round_id, status)
        return True

    def drop(self, round_id: RoundId, peer: str, reason: str) -> bool:
        """Leave ``peer``'s accepted contribution out of the round's aggregate, for ``reason``
        (journaled; the contribution itself stays recorded). False if the round or the
        contribution is unknown, or it was dropped already."""
        with self._lock:
            entry = self._rounds.get(round_id)
            if entry is None or peer not in entry.contributions or peer in entry.dropped:
                return False
            if self._journal is not None:
                self._journal.drop_contribution(round_id, peer, reason)
            entry.dropped[peer] = reason
        return True

    def mark_complete(self, round_id: RoundId, cid: str) -> bool:
        """Set Complete(cid); False if the round does not exist. Raises RoundAlreadyTerminal."""
        return self._finish(round_id, Complete(str(cid)))

    def mark_failed(self, round_id: RoundId, reason: str) -> bool:
        """Set Failed(reason); False if the round does not exist. Raises RoundAlreadyTerminal."""
        return self._finish(round_id, Failed(str(reason)))

    def _finish(self, round_id: RoundId, status: Complete | Failed) -> bool:
        with self._lock:
            entry = self._rounds.get(round_id)
            if entry is None:
                return False
            if entry.status.is_terminal:
                raise RoundAlreadyTerminal(round_id.as_key(), entry.status.name)
            self._set_status(entry, status)
        self._notify(round_id, status)
        return True

    def gc_before_round(self, round: int) -> int:
        """Remove terminal rounds numbered below ``round``; how many were removed."""
        with self._lock:
            doomed = [rid for rid in self._rounds if rid.round < round]
        return self.forget(doomed)

    def forget(self, round_ids: Iterable[RoundId]) -> int:
        """Remove those of ``round_ids`` that are terminal (others are left alone); how many."""
        with self._lock:
            doomed = [
                rid
                for rid in dict.fromkeys(round_ids)
                if (entry := self._rounds.get(rid)) is not None and entry.status.is_terminal
            ]
            if doomed and self._journal is not None:
                self._journal.delete_rounds(doomed)
            for rid in doomed:
                del self._rounds[rid]
            return len(doomed)

    # ── queries ──────────────────────────────────────────────────────────────
    def status(self, round_id: RoundId) -> RoundStatus | None:
        """The round's status, or None if there is no such round."""
        with self._lock:
            entry = self._rounds.get(round_id)
            return None if entry is None else entry.status

    def info(self, round_id: RoundId) -> RoundInfo | None:
        """A snapshot of the round, or None if there is no such round."""
        with self._lock:
            entry = self._rounds.get(round_id)
            return None if entry is None else entry.snapshot()

    def rounds(self) -> list[RoundInfo]:
        """Snapshots of every round, ordered by round number then initiator."""
        with self._lock:
            return [self._rounds[rid].snapshot() for rid in sorted(self._rounds)]

    def page(self, start: int, limit: int, peers: int) -> tuple[list[RoundInfo], int]:
        """Rounds ``start`` to ``start + limit`` in round order, each listing at most ``peers``
        of its peers (``received`` still counts them all), and how many rounds there are."""
        with self._lock:
            ids = sorted(self._rounds)
            chosen = ids[start : start + limit]
            return [self._rounds[rid].snapshot(peers) for rid in chosen], len(ids)

    def peers_page(self, round_id: RoundId, start: int, limit: int) -> tuple[list[str], int]:
        """The round's peers ``start`` to ``start + limit`` in acceptance order, and how many
        it has; RoundNotFound for an unknown round."""
        with self._lock:
            entry = self._get(round_id)
            names = list(itertools.islice(entry.contributions, start, start + limit))
            return names, len(entry.contributions)

    def contributions(self, round_id: RoundId) -> list[Contribution]:
        """The round's accepted contributions in fold order (the order their places were
        reserved, which the journal keeps; empty if no such round)."""
        with self._lock:
            entry = self._rounds.get(round_id)
            return [] if entry is None else list(entry.contributions.values())

    def held_count(self, round_id: RoundId) -> int:
        """How many contributions the round holds, accepted or reserved (0 if no such round):
        what a streaming round's sums hold when nothing is missing from them."""
        with self._lock:
            entry = self._rounds.get(round_id)
            return 0 if entry is None else len(entry.seqs)

    def in_fold_order(self, round_id: RoundId) -> list[Contribution]:
        """The round's accepted and reserved (not yet journaled) contributions in fold order:
        what a streaming round's sums hold, in the order they were added (empty if no such
        round). A coordinator whose sums lack some (after a restart, or a rebuild) refolds
        them in this order before it folds a new one."""
        with self._lock:
            entry = self._rounds.get(round_id)
            return [] if entry is None else entry.in_fold_order()

    def is_ready(self, round_id: RoundId) -> bool:
        """True when every expected peer has submitted (False for an unknown round)."""
        with self._lock:
            entry = self._rounds.get(round_id)
            return entry is not None and len(entry.contributions) >= entry.spec.expected_peers

    def active_count(self) -> int:
        """Rounds that are neither Complete nor Failed."""
        with self._lock:
            return sum(1 for entry in self._rounds.values() if not entry.status.is_terminal)

    def wait(self, round_id: RoundId, timeout: float | None = None) -> RoundStatus:
        """Block until the round is terminal and return its status (real time, not the clock).

        Raises RoundNotFound if the round does not exist (or is collected while waiting),
        RoundTimeout when ``timeout`` seconds pass first.
        """
        limit = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while True:
                entry = self._get(round_id)
                if entry.status.is_terminal:
                    return entry.status
                left = None if limit is None else limit - time.monotonic()
                if left is not None and left <= 0:
                    raise RoundTimeout(round_id.as_key(), timeout or 0.0, entry.status.name)
                self._changed.wait(left)

    # ── internals ────────────────────────────────────────────────────────────
    def _get(self, round_id: RoundId) -> RoundEntry:
        entry = self._rounds.get(round_id)
        if entry is None:
            raise RoundNotFound(round_id.as_key())
        return entry

    def _check_open(self, entry: RoundEntry, peer: str) -> None:
        key = entry.id.as_key()
        if entry.status.is_terminal:
            raise RoundAlreadyTerminal(key, entry.status.name)
        if (held := entry.contributions.get(peer) or entry.pending.get(peer)) is not None:
            raise DuplicateContribution(key, peer, held.update_cid)
        received = len(entry.contributions) + len(entry.pending)
        expected = entry.spec.expected_peers
        if isinstance(entry.status, Aggregating) or received >= expected:
            raise RoundClosed(key, entry.status.name, received, expected)

    def _set_status(self, entry: RoundEntry, status: RoundStatus) -> None:
        if self._journal is not None:
            self._journal.set_status(entry.id, status)
        entry.status = status

    def _notify(self, round_id: RoundId, status: RoundStatus) -> None:
        with self._changed:
            self._changed.notify_all()
            listeners = list(self._listeners)
        for listener in listeners:
            try:
                listener(round_id, status)
            except Exception:
                log.exception("round listener %r failed on %s -> %s", listener, round_id, status)
