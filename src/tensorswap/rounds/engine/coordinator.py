"""Coordinator: the facade over the rounds rooms (tracker, screening, folding, computing the
aggregate, retries, retention), with deadlines and counters."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import asdict
from functools import partial
from types import TracebackType
from typing import Self

from tensorswap.cid import Cid
from tensorswap.rounds.core.deadline import (
    Clock,
    DeadlineTimer,
    SystemClock,
    due_rounds,
    expiry_verdict,
    next_deadline,
)
from tensorswap.rounds.core.state import (
    RoundId,
    RoundInfo,
    RoundSpec,
    RoundStatus,
    RoundTracker,
)
from tensorswap.rounds.core.stats import CoordinatorStats
from tensorswap.rounds.engine._open import STORE_DIRNAME, open_in_dir
from tensorswap.rounds.engine._views import RoundViews
from tensorswap.rounds.engine.compute import compute_aggregate
from tensorswap.rounds.engine.cut import CutThrough
from tensorswap.rounds.engine.fold import RoundWork
from tensorswap.rounds.engine.hooks import CoordinatorHooks, HookList
from tensorswap.rounds.engine.intake import IntakeContext, SampleCap, intake
from tensorswap.rounds.engine.retry import RetryPolicy, RetrySchedule
from tensorswap.rounds.engine.updates import aggregator_spec
from tensorswap.rounds.journal.persist import RoundDatabase
from tensorswap.rounds.storage._lock import SharedLock
from tensorswap.rounds.storage.retention import DEFAULT_GC_GRACE, Retention, RetentionWorker
from tensorswap.store import DEFAULT_CHUNK_BYTES, BlockStore

__all__ = ["DEFAULT_GC_GRACE", "STORE_DIRNAME", "Coordinator", "CoordinatorStats", "Retention"]

log = logging.getLogger(__name__)


class Coordinator(RoundViews):
    """Runs rounds: accepts contributions by update CID, aggregates by itself, stores results.

    Guarantees:

    - ``submit`` returns only once the contribution is durable in the journal (when one is
      given); it is refused (typed error, nothing recorded) if the round is unknown, terminal,
      closed or full, the peer already contributed, the update is not wholly in the store,
      its layers differ from the round's, or its values cannot be aggregated.
    - When a round has all expected contributions, or its deadline passes with a quorum, it
      moves to Aggregating and is aggregated on a worker thread: FedAvg and the mean are
      folded in as contributions arrive (one model of memory); other strategies read every
      contribution back (memory-mapped from a directory store) at the end. Every block is
      re-hashed on the read that feeds the aggregate: one that fails (a directory store
      quarantines it) or vanished refuses the submit, or, for a contribution already
      accepted, drops it with the reason recorded (``RoundInfo.dropped``) and the round goes
      on if its quorum still holds. The result is stored as a model update in the round's
      layout with num_samples = the samples it covers, and Complete reports its CID.
    - A transient storage failure while storing the aggregate (a full disk, EIO) keeps the
      round Aggregating, its status naming the reason, retried with backoff (``retry``) until
      the round's deadline or the retry window has passed; any other aggregation error, or
      retries run out, fails the round with the error as reason.
    - A deadline that passes below quorum fails the round: ``"timeout: 3 of 8 peers ..."``.
    - After a restart over the same journal and store, rounds go on where they were: rounds
      left Aggregating (or full) are aggregated again from their stored contributions, and
      deadlines that passed meanwhile are handled at once.
    - With ``keep_rounds`` set, each round that ends is followed by a collection on a
      background thread (``collect_garbage``), never during a submit or while an aggregate
      is stored. All methods are thread-safe.
    - Runs, regions and DP decide through ``hooks`` (``rounds.engine.hooks``: admit a submit, cap
      its samples, release the aggregate, finish the round elsewhere, keep roots), asked in
      order: ``hooks=`` given here first, then ``coordinator.hooks.add``.
    """

    def __init__(
        self,
        store: BlockStore,
        *,
        journal: RoundDatabase | None = None,
        clock: Clock | None = None,
        default_spec: RoundSpec | None = None,
        run_timer: bool = True,
        verify_reads: bool | None = None,
        owns: bool = False,
        keep_rounds: int | None = None,
        gc_grace: float = DEFAULT_GC_GRACE,
        retry: RetryPolicy | None = None,
        hooks: Sequence[CoordinatorHooks] = (),
    ) -> None:
        self.store = store
        self.journal = journal
        self.clock: Clock = clock or SystemClock()
        self._owns = owns
        spec = default_spec or RoundSpec(1)
        aggregator_spec(spec)
        self._lock = threading.Lock()
        self._counters: dict[str, float] = asdict(CoordinatorStats())
        self._gc_lock = SharedLock()
        self.tracker = RoundTracker(
            spec.expected_peers, spec.timeout_s, journal=journal, clock=self.clock.now
        )
        self.tracker.default_spec = spec
        self._retention = RetentionWorker(
            self.tracker,
            store,
            self.clock,
            self._gc_lock,
            self._count,
            keep_rounds=keep_rounds,
            grace=gc_grace,
        )
        self._retries = RetrySchedule(retry)
        self.hooks = HookList(hooks)  # given before _recover: a tier finishes recovered rounds
        self._retention.add_root_source(self.hooks.roots)
        self.samples = SampleCap()  # the num_samples a contribution may claim (engine.intake)
        self._intake = IntakeContext(
            self.tracker, store, self.hooks, self.samples, verify_reads, self.clock.now,
            self._count, self._drop, lambda: self.cut,
        )  # fmt: skip
        self.result_chunk_bytes = DEFAULT_CHUNK_BYTES
        """Chunk size of the aggregates' tensors (``serve --result-chunk``; see compute)."""
        self.cut = CutThrough(store, self.tracker, self.hooks, lambda: self.result_chunk_bytes)
        """Cut-through rounds: pieces folded as they arrive (``rounds.engine.cut``)."""
        self._work: dict[RoundId, RoundWork] = {}
        self._closed = False
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tensorswap-aggregate")
        self._timer: DeadlineTimer | None = None
        if run_timer:
            self._timer = DeadlineTimer(self.clock, self._next_due, self.check_deadlines)
            subscribe = getattr(self.clock, "subscribe", None)
            if callable(subscribe):
                subscribe(self._timer.poke)
        self._recover()
        if self._timer is not None:
            self._timer.start()

    @classmethod
    def open(
        cls,
        data_dir: str | os.PathLike[str],
        *,
        durable: bool = True,
        reset: bool = False,
        group_commit: bool = True,
        sync_blocks: bool = False,
        **kwargs: object,
    ) -> Coordinator:
        """A coordinator over ``<dir>/rounds.sqlite3`` and a store in ``<dir>/blocks`` (files;
        inline blocks as SQLite rows, ``rounds.storage._tiered``).

        Both are created if missing, reopened otherwise, and closed by ``close``. A lost or
        damaged journal is refused, and ``reset`` starts a fresh one: see ``open_journal``.
        ``sync_blocks`` flushes the store (``DirectoryStore.sync``) before each journal
        commit: with ``durable``, accepted blocks survive a power loss too.
        """
        return open_in_dir(
            cls,
            data_dir,
            durable=durable,
            reset=reset,
            group_commit=group_commit,
            sync_blocks=sync_blocks,
            **kwargs,
        )

    @property
    def keep_rounds(self) -> int | None:
        return self._retention.keep_rounds

    @property
    def gc_grace(self) -> float:
        return self._retention.grace

    # ── rounds ───────────────────────────────────────────────────────────────
    def start_round(self, round_id: RoundId, spec: RoundSpec | None = None) -> bool:
        """Start a round (default spec if None); False if it exists. InvalidRoundSpec early."""
        spec = spec or self.tracker.default_spec
        aggregator_spec(spec)
        started = self.tracker.start(round_id, spec)
        if started:
            self._count(rounds_started=1)
            log.info("round %s started: %s", round_id, spec)
            self._poke()
        return started

    def submit(
        self,
        round_id: RoundId,
        peer: str,
        update_cid: Cid | str,
        *,
        scale: float = 1.0,
        via: CoordinatorHooks | None = None,
    ) -> RoundStatus:
        """Accept ``peer``'s model update (already in the store) for the round; the new status.

        ``scale`` (in (0, 1]) multiplies the update's values in the aggregate (an
        asynchronous run's staleness factor; journaled with the contribution). ``via``: the
        hook submitting on the peer's behalf after its own checks (``Admission.via``).

        Aggregation starts by itself once the round is full. Raises RoundNotFound,
        RoundAlreadyTerminal, RoundClosed, DuplicateContribution, UnknownUpdate (also when a
        block of it fails its hash check now: push it again), UpdateMismatch or
        InvalidUpdate; a refused contribution leaves no trace.
        """
        if isinstance(scale, bool) or not (isinstance(scale, int | float) and 0 < scale <= 1):
            raise ValueError(f"scale must be a number in (0, 1], got {scale!r}")
        with self._gc_lock.shared():  # no collection between the store check and the record
            (outcome,) = self._submit_many(round_id, [(peer, update_cid, float(scale))], via=via)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def submit_many(
        self,
        round_id: RoundId,
        items: Sequence[tuple[str, Cid | str]],
        *,
        store: BlockStore | None = None,
        screened: Callable[[], None] | None = None,
    ) -> list[RoundStatus | Exception]:
        """``submit`` for each ``(peer, update_cid)`` (scale 1), screened in order and
        journaled in one transaction: per item the new status, or the error that refused it
        (a refused one leaves no trace). Each is durable when this returns. ``store`` (a view
        of this coordinator's store, ``rounds.storage._fresh``) is what the screening reads;
        ``screened()`` is called between the screening and the journal write."""
        items3 = [(p, c, 1.0) for p, c in items]
        with self._gc_lock.shared():
            return self._submit_many(round_id, items3, store, screened)

    def _submit_many(
        self,
        round_id: RoundId,
        items: Sequence[tuple[str, Cid | str, float]],
        store: BlockStore | None = None,
        screened: Callable[[], None] | None = None,
        via: CoordinatorHooks | None = None,
    ) -> list[RoundStatus | Exception]:
        work = self._work_for(round_id)
        outcomes, accepted, nbytes = intake(
            self._intake, work, round_id, items, store, screened, via
        )
        self._count(contributions=accepted, contribution_bytes=nbytes)
        if self.tracker.is_ready(round_id):
            with work.lock:
                if self.tracker.is_ready(round_id):
                    self._begin(round_id)
        return outcomes

    def check_deadlines(self) -> list[RoundId]:
        """Handle every round whose deadline has passed, and queue the retries that are due;
        the rounds acted on.

        At quorum the round starts aggregating what it has; below, it fails with a reason.
        The timer thread calls this; with ``run_timer=False`` (or a fake clock) call it yourself.
        """
        acted = []
        for info in due_rounds(self.tracker.rounds(), self.clock.now()):
            rid = info.round_id
            work = self._work_for(rid)
            # shared first, as in submit: the round's collection never runs between the
            # verdict and the status it records
            with self._gc_lock.shared(), work.lock:
                self.tracker.settle(rid)  # no contribution between its check and its record
                current = self.tracker.info(rid)
                if current is None or not due_rounds([current], self.clock.now()):
                    continue
                spec = current.spec
                verdict = expiry_verdict(current.received, spec.expected_peers, spec.min_peers)
                if verdict is None:
                    log.info("round %s: deadline passed at quorum, aggregating", rid)
                    self._begin(rid)
                else:
                    self._fail(rid, verdict)
            acted.append(rid)
        for rid in self._retries.take_due(self.clock.now()):
            self._queue(rid)
            acted.append(rid)
        return acted

    @property
    def collection_lock(self) -> SharedLock:
        """The lock submits and aggregations share and a collection takes exclusive, for
        observability (``exclusive_held``, ``waiting``); to hold collections off use
        ``no_collection``."""
        return self._gc_lock

    def no_collection(self) -> AbstractContextManager[None]:
        """Hold collections off (shared, as submits are) while a hook stores and names a root."""
        return self._gc_lock.shared()

    # ── counters ─────────────────────────────────────────────────────────────
    def stats(self) -> CoordinatorStats:
        with self._lock:
            counters = dict(self._counters)
        counters["active_rounds"] = self.tracker.active_count()
        return CoordinatorStats(**counters)  # type: ignore[arg-type]

    def _count(self, **deltas: float) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counters[name] += delta

    # ── aggregation ──────────────────────────────────────────────────────────
    def _begin(self, round_id: RoundId) -> None:
        """Move the round to Aggregating and queue its aggregation (caller holds its lock)."""
        if self.tracker.begin_aggregation(round_id):
            self._queue(round_id)

    def _queue(self, round_id: RoundId) -> None:
        with self._lock:
            if self._closed:
                return  # stays Aggregating in the journal; aggregated again on reopen
            self._pool.submit(self._aggregate, round_id)

    def _aggregate(self, round_id: RoundId) -> None:
        started = time.perf_counter()
        # no collection between storing the aggregate and Complete naming it
        with self._gc_lock.shared():
            info = self.tracker.info(round_id)
            if info is None or info.status.is_terminal:
                self._forget(round_id)
                return
            try:
                work, drop = self._work_for(round_id), partial(self._drop, round_id)
                got = self.tracker.contributions(round_id)
                cid = compute_aggregate(
                    self.store, info, got, work, drop, self.result_chunk_bytes, self.cut
                )
                cid = self.hooks.release(round_id, cid)
                seconds = time.perf_counter() - started
                with self._lock:  # counted before Complete wakes anyone who then reads them
                    self._counters["last_aggregation_seconds"] = seconds
                self._count(rounds_completed=1, aggregation_seconds=seconds)
                try:
                    if not self.hooks.finish(round_id, cid):  # else it stays Aggregating
                        self.complete_round(round_id, cid)
                except BaseException:
                    self._count(rounds_completed=-1, aggregation_seconds=-seconds)
                    raise
            except Exception as exc:
                self._forget(round_id)
                if not self._retry_later(info, exc):
                    log.warning("round %s: aggregation failed: %s", round_id, exc, exc_info=True)
                    self._fail(round_id, f"aggregation failed: {exc}")
                return
            self._forget(round_id)
            self._retries.forget(round_id)
        log.info("round %s complete in %.3f s: %s", round_id, seconds, cid)

    def complete_round(self, round_id: RoundId, cid: Cid | str) -> None:
        """Mark the round Complete(cid) (RoundAlreadyTerminal if it has ended)."""
        with self._gc_lock.shared():  # no collection between the caller's store and this
            self._retention.schedule()  # queued before Complete wakes anyone; runs after
            self._retention.mark_ended(round_id)
            self.tracker.mark_complete(round_id, str(cid))

    def fail_round(self, round_id: RoundId, reason: str) -> None:
        """Mark the round Failed(reason), unless it has ended already."""
        self._fail(round_id, reason)

    def _retry_later(self, info: RoundInfo, exc: Exception) -> bool:
        """Schedule another attempt after a transient failure; False when it is not one, or
        the retries ran out (the caller fails the round)."""
        reason = self._retries.plan(info.round_id, self.clock.now(), info.deadline, exc)
        if reason is None:
            return False
        self._count(aggregation_retries=1)
        log.warning("round %s: %s", info.round_id, reason)
        self.tracker.note_aggregating(info.round_id, reason)
        self._poke()
        return True

    def _drop(self, round_id: RoundId, peer: str, reason: str) -> None:
        if self.tracker.drop(round_id, peer, reason):
            self._count(contributions_dropped=1)

    def _fail(self, round_id: RoundId, reason: str) -> None:
        status = self.tracker.status(round_id)
        if status is not None and not status.is_terminal:
            self._retention.schedule()  # queued before Failed wakes anyone
            self._retention.mark_ended(round_id)
        self._retries.forget(round_id)
        self.cut.abandon(round_id, reason)
        if self.tracker.mark_failed(round_id, reason):
            self._count(rounds_failed=1)
            log.warning("round %s failed: %s", round_id, reason)
        self._forget(round_id)

    def _next_due(self) -> float | None:
        """The earliest round deadline or due retry (for the timer)."""
        times = [t for t in (next_deadline(self.tracker.rounds()), self._retries.next_due()) if t]
        return min(times, default=None)

    def _poke(self) -> None:
        if self._timer is not None:
            self._timer.poke()

    # ── retention ────────────────────────────────────────────────────────────
    def collect_garbage(
        self, keep_rounds: int, *, grace: float | None = None, dry_run: bool = False
    ) -> Retention:
        """Forget old terminal rounds and delete the blocks no remaining round references.

        Terminal rounds numbered below ``newest - keep_rounds + 1`` (``newest``: the highest
        round number held) are removed from the tracker and the journal, unless this
        coordinator saw them end less than ``grace`` seconds ago (their peers may still be
        fetching the result); rounds still running are always kept. Then every block not
        reachable from a remaining round's contributions or aggregate is deleted, unless it
        was stored or touched within ``grace`` seconds (default ``gc_grace``). ``dry_run``
        reports without changing anything. Waits for submits and aggregations in progress;
        they wait while it runs. If a held round's manifests cannot be read, nothing is
        deleted and the error is raised.
        """
        return self._retention.collect(keep_rounds, grace=grace, dry_run=dry_run)

    def drain_collections(self, timeout: float | None = None) -> None:
        """Wait until the collections queued so far (``keep_rounds``) have run.

        A round that has ended has queued its collection by the time ``wait`` returns it.
        Raises TimeoutError if they take longer than ``timeout`` seconds.
        """
        self._retention.drain(timeout)

    # ── internals ────────────────────────────────────────────────────────────
    def _work_for(self, round_id: RoundId) -> RoundWork:
        with self._lock:
            work = self._work.get(round_id)
            if work is None:
                work = self._work[round_id] = RoundWork()
            return work

    def _forget(self, round_id: RoundId) -> None:
        with self._lock:
            self._work.pop(round_id, None)

    def _recover(self) -> None:
        """Re-queue rounds a previous process left Aggregating or full."""
        for info in self.tracker.rounds():
            if info.status.is_terminal:
                continue
            rid = info.round_id
            if info.status.name == "Aggregating":
                log.info("round %s: resuming its aggregation after a restart", rid)
                self._queue(rid)
            elif info.received >= info.spec.expected_peers:
                self._begin(rid)

    # ── lifecycle ────────────────────────────────────────────────────────────
    def close(self) -> None:
        """Stop the timer, finish the running aggregation, drop queued ones (and retries), run
        the queued collections; idempotent.

        Rounds whose aggregation was dropped stay Aggregating in the journal and are
        aggregated again when a coordinator reopens it. Closes the store and journal it owns.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._retention.stop()
        if self._timer is not None:
            self._timer.stop()
            unsubscribe = getattr(self.clock, "unsubscribe", None)
            if callable(unsubscribe):
                unsubscribe(self._timer.poke)
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._retention.close()  # collections already queued run to the end
        if self._owns:
            if self.journal is not None:
                self.journal.close()
            self.store.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
