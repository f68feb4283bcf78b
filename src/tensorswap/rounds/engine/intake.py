"""Intake: submitted contributions screened, reserved and journaled (group commit)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tensorswap.aggregate import AggregatorSpec
from tensorswap.cid import Cid
from tensorswap.errors import RoundsError
from tensorswap.rounds.core.errors import TooManySamples
from tensorswap.rounds.core.state import (
    Contribution,
    RoundId,
    RoundInfo,
    RoundStatus,
    RoundTracker,
    Ticket,
)
from tensorswap.rounds.engine.cut import CutThrough
from tensorswap.rounds.engine.fold import RoundWork
from tensorswap.rounds.engine.hooks import Admission, CoordinatorHooks, HookList
from tensorswap.rounds.engine.refold import catch_up
from tensorswap.rounds.engine.screen import check_layout, screen
from tensorswap.rounds.engine.updates import (
    STREAMING_KINDS,
    aggregator_spec,
    inspect_update,
    parse_update_cid,
)
from tensorswap.store import BlockStore

__all__ = ["IntakeContext", "SampleCap", "intake"]

log = logging.getLogger("tensorswap.rounds.engine.coordinator")


@dataclass(slots=True)
class SampleCap:
    """The most samples one contribution may claim (its update's num_samples: its FedAvg
    weight, the peer's word): ``limit`` per peer in every round (``serve
    --max-samples-per-peer``; None: any), refined per round by the coordinator's hooks
    (``CoordinatorHooks.sample_cap``: a run's own ``max_samples_per_peer``, times the peers
    a region's fold stands for). A claim above the cap is refused with TooManySamples
    before anything is recorded; none is clamped."""

    limit: int | None = None

    def check(self, hooks: HookList, round_id: RoundId, peer: str, claimed: int) -> None:
        cap = hooks.sample_cap(round_id, peer, self.limit)
        if cap is not None and claimed > cap:
            raise TooManySamples(round_id.as_key(), peer, claimed, cap)


@dataclass(frozen=True, slots=True)
class IntakeContext:
    """What the intake needs from its coordinator: the tracker, the store the updates are
    read from, the hooks that admit and cap a submit, the sample cap, whether manifests are
    re-verified at submit, the clock, ``count(**deltas)`` for its counters, and
    ``drop(round_id, peer, reason)`` for an accepted contribution that can no longer be read
    back when the sums are rebuilt (``refold.catch_up``)."""

    tracker: RoundTracker
    store: BlockStore
    hooks: HookList
    samples: SampleCap
    verify: bool | None
    now: Callable[[], float]
    count: Callable[..., None]
    drop: Callable[[RoundId, str, str], None]
    cut: Callable[[], CutThrough | None] = lambda: None
    """The coordinator's cut-through state: an update it folds at arrival is not folded here."""


def intake(
    ctx: IntakeContext,
    work: RoundWork,
    round_id: RoundId,
    items: Sequence[tuple[str, Cid | str, float]],
    store: BlockStore | None = None,
    screened: Callable[[], None] | None = None,
    via: CoordinatorHooks | None = None,
) -> tuple[list[RoundStatus | Exception], int, int]:
    """Screen each ``(peer, update_cid, scale)`` item, fold it (streaming kinds) and reserve
    its place under ``work.lock``, one at a time; then journal every reserved one at once,
    outside the lock, so submits from other threads share the transaction (group commit).

    Per item the round's status once durable, or the error that refused it (a refused item
    leaves no trace; sums that held it are rebuilt at the end); and how many were accepted,
    with their bytes. Each refusal is counted (``rejected``) and logged. ``store`` (default:
    ``ctx.store``) is what the updates are read from; ``screened()`` is called once every
    item is screened and reserved, before the journal write (the caller may start screening
    its next batch meanwhile). ``via`` goes to the hooks' ``Admission`` of each item.
    """
    store = ctx.store if store is None else store

    def refused(key: str, peer: str, exc: BaseException) -> None:
        ctx.count(rejected=1)
        log.info("round %s: contribution from %r refused: %s", key, peer, exc)

    key = round_id.as_key()
    outcomes: list[RoundStatus | Exception] = []
    tickets: list[tuple[int, Ticket, bool]] = []
    for peer, update_cid, scale in items:
        try:
            ticket, folded = _reserve(ctx, work, round_id, (peer, update_cid, scale), store, via)
        except Exception as exc:
            refused(key, peer, exc)
            outcomes.append(exc)
            continue
        tickets.append((len(outcomes), ticket, folded))
        outcomes.append(ticket.status)
    if screened is not None:
        screened()
    if not tickets:
        return outcomes, 0, 0
    results = ctx.tracker.record([t for _, t, _ in tickets])
    accepted = nbytes = 0
    for (index, ticket, folded), result in zip(tickets, results, strict=True):
        peer = ticket.contribution.peer
        if isinstance(result, BaseException):
            if folded:  # the sums hold an unrecorded update: rebuild them at the end
                with work.lock:
                    work.reset()
            refused(key, peer, result)
            outcomes[index] = result if isinstance(result, Exception) else RoundsError(str(result))
            continue
        outcomes[index] = result
        accepted += 1
        nbytes += ticket.contribution.nbytes
        log.debug("round %s: %s contributed -> %s", key, peer, result)
    return outcomes, accepted, nbytes


def _reserve(
    ctx: IntakeContext,
    work: RoundWork,
    round_id: RoundId,
    item: tuple[str, Cid | str, float],
    store: BlockStore,
    via: CoordinatorHooks | None,
) -> tuple[Ticket, bool]:
    """Screen one ``(peer, update_cid, scale)`` item, fold it (streaming kinds, after what the
    sums lack) and reserve its place; the ticket, and whether it was folded."""
    tracker, hooks = ctx.tracker, ctx.hooks
    peer, update_cid, scale = item
    key = round_id.as_key()
    hooks.admit(Admission(round_id, peer, scale, via))
    info = tracker.check_submit(round_id, peer)
    cid = parse_update_cid(update_cid, key, peer)
    facts = inspect_update(store, cid, key, peer, verify=ctx.verify)
    ctx.samples.check(hooks, round_id, peer, facts.num_samples)
    check_layout(info, facts.layout, peer)
    spec = aggregator_spec(info.spec)
    with work.lock:
        info = tracker.check_submit(round_id, peer)
        # else folded at the close, in canonical order, or at arrival (cut-through)
        cut = ctx.cut()
        covered = cut is not None and cut.claim(round_id, peer, cid)
        now = not info.spec.deterministic and not covered
        if now and spec.kind in STREAMING_KINDS:
            _catch_up(ctx, work, spec, info)
        counted = cut.nonfinite(round_id, peer, cid) if cut is not None and covered else None
        folded = screen(store, work, spec, facts, key, peer, scale, fold=now, counted=counted)
        contribution = Contribution(
            round_id, peer, str(facts.cid), facts.num_samples, facts.nbytes, ctx.now(), scale
        )
        try:
            ticket = tracker.reserve(contribution, facts.layout)
        except BaseException:
            if folded:  # the sums hold an unaccepted update: rebuild them
                work.reset()
            raise
        if folded:
            work.folded.add(peer)
    return ticket, folded


def _catch_up(ctx: IntakeContext, work: RoundWork, spec: AggregatorSpec, info: RoundInfo) -> None:
    """Before a new fold, refold (in fold order) what the sums lack: after a restart, or a
    rebuild; cheap when nothing is missing. The caller holds ``work.lock``."""
    rid = info.round_id
    if len(work.folded) == ctx.tracker.held_count(rid):
        return
    gone = info.dropped_peers
    held = [c for c in ctx.tracker.in_fold_order(rid) if c.peer not in gone]

    def lose(contribution: Contribution, exc: Exception) -> None:
        reason = f"unreadable: {exc}"
        log.warning("round %s: contribution from %r dropped: %s", rid, contribution.peer, reason)
        ctx.drop(rid, contribution.peer, reason)

    catch_up(ctx.store, work, spec, held, lose)
