"""Coordinator: rounds over a block store, with automatic aggregation, deadlines and counters."""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Sized
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

import numpy as np

from tensorswap.aggregate import AggregatorSpec, StreamingAccumulator, aggregate
from tensorswap.aggregate import Contribution as AggregateInput
from tensorswap.cid import Cid
from tensorswap.codec import DType
from tensorswap.errors import AggregationError, NonFiniteValues
from tensorswap.rounds.deadline import (
    Clock,
    DeadlineTimer,
    SystemClock,
    due_rounds,
    expiry_verdict,
    next_deadline,
)
from tensorswap.rounds.errors import InvalidUpdate, RoundFailed, RoundNotFound, UpdateMismatch
from tensorswap.rounds.fold import (
    Bounds,
    ChunkSource,
    assemble,
    chunk_sources,
    load_chunk,
    load_pieces,
    same_chunks,
)
from tensorswap.rounds.persist import RoundDatabase, open_journal
from tensorswap.rounds.result import put_pieces
from tensorswap.rounds.state import (
    Complete,
    Contribution,
    Layout,
    RoundId,
    RoundInfo,
    RoundSpec,
    RoundStatus,
    RoundTracker,
    layout_mismatch,
)
from tensorswap.rounds.updates import (
    STREAMING_KINDS,
    UpdateFacts,
    aggregator_spec,
    check_finite,
    inspect_update,
    new_accumulator,
    parse_update_cid,
)
from tensorswap.store import BlockStore, DirectoryStore, ModelUpdate, get_update, put_update
from tensorswap.store.gc import GcResult, collect_garbage

__all__ = ["DEFAULT_GC_GRACE", "STORE_DIRNAME", "Coordinator", "CoordinatorStats", "Retention"]

log = logging.getLogger(__name__)

STORE_DIRNAME = "blocks"
"""``Coordinator.open(dir)`` keeps its directory store in ``<dir>/blocks``."""

DEFAULT_GC_GRACE = 600.0
"""Seconds a block stored or touched recently is spared by a collection though unreferenced:
time for a peer to push an update and submit it (a push touches the blocks it finds held)."""


@dataclass(frozen=True, slots=True)
class CoordinatorStats:
    """Counters since this coordinator was built (they are not persisted).

    ``contribution_bytes`` sums the accepted updates' block sizes (manifests and chunks),
    whether or not their blocks crossed a wire (the server counts wire bytes).
    """

    contributions: int = 0
    rejected: int = 0
    contribution_bytes: int = 0
    rounds_started: int = 0
    rounds_completed: int = 0
    rounds_failed: int = 0
    aggregation_seconds: float = 0.0
    last_aggregation_seconds: float = 0.0
    active_rounds: int = 0
    gc_runs: int = 0
    gc_rounds_removed: int = 0
    gc_blocks_removed: int = 0
    gc_bytes_removed: int = 0
    gc_failures: int = 0

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Retention:
    """What ``Coordinator.collect_garbage`` did (or, for a dry run, would do)."""

    rounds_removed: int
    """Terminal rounds forgotten (their journal entries deleted)."""
    blocks: GcResult
    """The block store's collection: removed, kept, and spared for the grace period."""


class _SharedLock:
    """Many holders in shared mode (submits) or one in exclusive mode (a collection).

    A waiting exclusive holder keeps new shared holders out, so a collection is never starved;
    a thread that already holds it shared may take it shared again at once (a status
    listener that submits from inside a submit or an aggregation), and may not take it
    exclusive (that would wait for itself).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False
        self._waiting = 0
        self._held: dict[int, int] = {}  # thread id -> how many times it holds it shared

    @contextmanager
    def shared(self) -> Iterator[None]:
        me = threading.get_ident()
        with self._cond:
            if not self._held.get(me):
                self._cond.wait_for(lambda: not self._exclusive and not self._waiting)
            self._held[me] = self._held.get(me, 0) + 1
            self._shared += 1
        try:
            yield
        finally:
            with self._cond:
                self._shared -= 1
                self._held[me] -= 1
                if not self._held[me]:
                    del self._held[me]
                self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            if self._held.get(threading.get_ident()):
                raise RuntimeError(
                    "collect_garbage called from inside a submit or an aggregation "
                    "(a status listener?): it would wait for itself"
                )
            self._waiting += 1
            self._cond.notify_all()  # the state changed: whoever watches it re-checks
            try:
                self._cond.wait_for(lambda: not self._exclusive and not self._shared)
            finally:
                self._waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


class _Work:
    """Per-round aggregation state; its lock serializes every change to the round."""

    __slots__ = ("acc", "bounds", "folded", "lock", "same")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.acc: StreamingAccumulator | None = None
        self.folded: set[str] = set()
        self.bounds: Bounds | None = None
        # pieces that every folded contribution stored as the very same chunk (None: no fold yet)
        self.same: dict[str, ChunkSource] | None = None

    def reset(self, spec: AggregatorSpec | None = None) -> None:
        """Empty sums (a new accumulator for ``spec``, or none at all)."""
        self.acc = None if spec is None else new_accumulator(spec)
        self.folded = set()
        self.bounds = None
        self.same = None

    def fold(
        self,
        pieces: dict[str, np.ndarray],
        bounds: Bounds,
        num_samples: int,
        facts: UpdateFacts,
    ) -> None:
        assert self.acc is not None
        self.acc.add(pieces, num_samples)
        self.bounds = bounds
        sources = chunk_sources(facts, bounds)
        self.same = sources if self.same is None else same_chunks(self.same, sources)


class Coordinator:
    """Runs rounds: accepts contributions by update CID, aggregates by itself, stores results.

    Guarantees:

    - ``submit`` returns only once the contribution is durable in the journal (when one is
      given); it is refused (typed error, nothing recorded) if the round is unknown, terminal,
      closed or full, the peer already contributed, the update is not wholly in the store,
      its layers differ from the round's, or its values cannot be aggregated.
    - When a round has all expected contributions, or its deadline passes with a quorum, it
      moves to Aggregating and is aggregated on a worker thread: FedAvg and the mean are
      folded in as contributions arrive (one model of memory); other strategies read every
      contribution back (memory-mapped from a directory store) at the end. The result is
      stored as a model update in the round's layout (names, dtypes, shapes) with
      num_samples = the samples it covers, and Complete reports its CID. An aggregation
      error fails the round with the error as reason.
    - A deadline that passes below quorum fails the round: ``"timeout: 3 of 8 peers ..."``.
    - After a restart over the same journal and store, rounds go on where they were: rounds
      left Aggregating (or full) are aggregated again from their stored contributions, and
      deadlines that passed meanwhile are handled at once.
    - With ``keep_rounds`` set, each round that ends is followed by a collection on a
      background thread (``collect_garbage``): terminal rounds numbered below the newest
      ``keep_rounds`` round numbers are forgotten, then every block that no remaining round
      references (its contributions and its aggregate) is deleted, except blocks stored or
      touched within ``gc_grace`` seconds (pushed for a submit still to come). A collection
      never runs during a submit or while an aggregate is being stored, so nothing a round
      holds is deleted.
    - All methods are thread-safe.
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
    ) -> None:
        if keep_rounds is not None and keep_rounds < 1:
            raise ValueError(f"keep_rounds must be at least 1 (or None), got {keep_rounds}")
        if gc_grace < 0:
            raise ValueError(f"gc_grace must not be negative, got {gc_grace}")
        self.keep_rounds = keep_rounds
        self.gc_grace = gc_grace
        self._gc_lock = _SharedLock()
        self._gc_pool: ThreadPoolExecutor | None = None
        self._gc_queued = False
        self._gc_future: Future[None] | None = None
        self._ended: dict[RoundId, float] = {}  # self.clock.now() when a round turned terminal
        self.store = store
        self.journal = journal
        self.clock: Clock = clock or SystemClock()
        self._verify = verify_reads
        self._owns = owns
        spec = default_spec or RoundSpec(1)
        aggregator_spec(spec)
        self.tracker = RoundTracker(
            spec.expected_peers, spec.timeout_s, journal=journal, clock=self.clock.now
        )
        self.tracker.default_spec = spec
        self._lock = threading.Lock()
        self._work: dict[RoundId, _Work] = {}
        self._counters: dict[str, float] = asdict(CoordinatorStats())
        self._closed = False
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tensorswap-aggregate")
        self._timer: DeadlineTimer | None = None
        if run_timer:
            self._timer = DeadlineTimer(
                self.clock,
                lambda: next_deadline(self.tracker.rounds()),
                self.check_deadlines,
            )
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
        **kwargs: object,
    ) -> Coordinator:
        """A coordinator over ``<dir>/rounds.sqlite3`` and a directory store in ``<dir>/blocks``.

        Both are created if missing, reopened otherwise, and closed by ``close``. A lost or
        damaged journal is refused, and ``reset`` starts a fresh one: see ``open_journal``.
        """
        root = Path(data_dir)
        store = DirectoryStore(root / STORE_DIRNAME, trust_own_writes=True)
        try:
            journal = open_journal(root, store, durable=durable, reset=reset)
        except BaseException:
            store.close()
            raise
        try:
            return cls(store, journal=journal, owns=True, **kwargs)  # type: ignore[arg-type]
        except BaseException:
            journal.close()
            store.close()
            raise

    # ── rounds ───────────────────────────────────────────────────────────────
    def start_round(self, round_id: RoundId, spec: RoundSpec | None = None) -> bool:
        """Start a round (default spec if None); False if it exists. InvalidRoundSpec early."""
        spec = spec or self.tracker.default_spec
        aggregator_spec(spec)
        started = self.tracker.start(round_id, spec)
        if started:
            self._count(rounds_started=1)
            log.info("round %s started: %s", round_id, spec)
            if self._timer is not None:
                self._timer.poke()
        return started

    def submit(self, round_id: RoundId, peer: str, update_cid: Cid | str) -> RoundStatus:
        """Accept ``peer``'s model update (already in the store) for the round; the new status.

        Aggregation starts by itself once the round is full. Raises RoundNotFound,
        RoundAlreadyTerminal, RoundClosed, DuplicateContribution, UnknownUpdate,
        UpdateMismatch or InvalidUpdate; a refused contribution leaves no trace.
        """
        with self._gc_lock.shared():  # no collection between the store check and the record
            return self._submit(round_id, peer, update_cid)

    def _submit(self, round_id: RoundId, peer: str, update_cid: Cid | str) -> RoundStatus:
        key = round_id.as_key()
        try:
            info = self.tracker.check_submit(round_id, peer)
            facts = inspect_update(
                self.store, parse_update_cid(update_cid, key, peer), key, peer, verify=self._verify
            )
            self._check_layout(info, facts.layout, peer)
            spec = aggregator_spec(info.spec)
            work = self._work_for(round_id)
            with work.lock:
                self.tracker.check_submit(round_id, peer)
                folded = self._screen(work, spec, facts, key, peer)
                now = self.clock.now()
                contribution = Contribution(
                    round_id, peer, str(facts.cid), facts.num_samples, facts.nbytes, now
                )
                try:
                    status = self.tracker.submit(contribution, layout=facts.layout)
                except BaseException:
                    if folded:  # the sums hold an unaccepted update: rebuild them at the end
                        work.reset()
                    raise
                if folded:
                    work.folded.add(peer)
                if self.tracker.is_ready(round_id):
                    self._begin(round_id)
        except Exception as exc:
            self._count(rejected=1)
            log.info("round %s: contribution from %r refused: %s", key, peer, exc)
            raise
        self._count(contributions=1, contribution_bytes=facts.nbytes)
        log.debug("round %s: %s contributed %d bytes -> %s", key, peer, facts.nbytes, status)
        return status

    def check_deadlines(self) -> list[RoundId]:
        """Handle every round whose deadline has passed; the rounds acted on.

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
        return acted

    def wait(self, round_id: RoundId, timeout: float | None = None) -> RoundStatus:
        """Block until the round is Complete or Failed (RoundTimeout, RoundNotFound)."""
        return self.tracker.wait(round_id, timeout)

    def result(self, round_id: RoundId, timeout: float | None = None) -> Cid:
        """Wait for the round and return its aggregate's CID; RoundFailed if it failed."""
        status = self.wait(round_id, timeout)
        if isinstance(status, Complete):
            return Cid.parse(status.cid)
        raise RoundFailed(round_id.as_key(), getattr(status, "reason", status.name))

    def status(self, round_id: RoundId) -> RoundStatus | None:
        return self.tracker.status(round_id)

    def info(self, round_id: RoundId) -> RoundInfo | None:
        return self.tracker.info(round_id)

    def rounds(self) -> list[RoundInfo]:
        return self.tracker.rounds()

    def contributions(self, round_id: RoundId) -> list[Contribution]:
        return self.tracker.contributions(round_id)

    def gc_before_round(self, round: int) -> int:
        """Forget terminal rounds numbered below ``round`` (their blocks stay in the store)."""
        return self.tracker.gc_before_round(round)

    def subscribe(self, listener: Callable[[RoundId, RoundStatus], None]) -> None:
        """Call ``listener(round_id, status)`` on every status change (from any thread)."""
        self.tracker.subscribe(listener)

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
    def _check_layout(self, info: RoundInfo, layout: Layout, peer: str) -> None:
        if info.layout is not None:
            detail = layout_mismatch(info.layout, layout)
            if detail is not None:
                raise UpdateMismatch(info.round_id.as_key(), peer, detail)

    def _screen(
        self, work: _Work, spec: AggregatorSpec, facts: UpdateFacts, key: str, peer: str
    ) -> bool:
        """Fold the update into the round's sums (streaming) or check it; True if folded."""
        cid = facts.cid
        if spec.kind in STREAMING_KINDS:
            if work.acc is None:
                work.reset(spec)
            pieces, bounds, n = load_pieces(self.store, facts, work.bounds, verify=self._verify)
            try:
                work.fold(pieces, bounds, n, facts)
            except NonFiniteValues as exc:
                raise InvalidUpdate(key, peer, f"{exc.count} non-finite values") from exc
            except AggregationError as exc:
                raise InvalidUpdate(key, peer, str(exc)) from exc
            return True
        if spec.non_finite.value == "raise":
            check_finite(dict(get_update(self.store, cid, verify=self._verify).tensors), key, peer)
        return False

    def _begin(self, round_id: RoundId) -> None:
        """Move the round to Aggregating and queue its aggregation (caller holds its lock)."""
        if self.tracker.begin_aggregation(round_id):
            with self._lock:
                if self._closed:
                    return  # stays Aggregating in the journal; aggregated again on reopen
                self._pool.submit(self._aggregate, round_id)

    def _aggregate(self, round_id: RoundId) -> None:
        started = time.perf_counter()
        # no collection between storing the aggregate and Complete naming it
        with self._gc_lock.shared():
            try:
                cid = self._compute(round_id)
            except Exception as exc:
                log.warning("round %s: aggregation failed: %s", round_id, exc, exc_info=True)
                self._fail(round_id, f"aggregation failed: {exc}")
                return
            finally:
                self._forget(round_id)
            seconds = time.perf_counter() - started
            with self._lock:  # counted before Complete wakes anyone who then reads them
                self._counters["last_aggregation_seconds"] = seconds
            self._count(rounds_completed=1, aggregation_seconds=seconds)
            self._schedule_gc()  # queued before Complete wakes anyone; it runs after this lock
            self._mark_ended(round_id)
            self.tracker.mark_complete(round_id, str(cid))
        log.info("round %s complete in %.3f s: %s", round_id, seconds, cid)

    def _compute(self, round_id: RoundId) -> Cid:
        info = self.tracker.info(round_id)
        if info is None:
            raise RoundNotFound(round_id.as_key())
        spec = aggregator_spec(info.spec)
        contributions = self.tracker.contributions(round_id)
        work = self._work_for(round_id)
        with work.lock:
            if spec.kind in STREAMING_KINDS:
                if work.acc is None:
                    work.reset(spec)
                for c in contributions:  # after a restart, or a rebuild: fold what is missing
                    if c.peer not in work.folded:
                        facts = self._facts(c)
                        loaded, cut, n = load_pieces(
                            self.store, facts, work.bounds, verify=self._verify
                        )
                        work.fold(loaded, cut, n, facts)
                        work.folded.add(c.peer)
                assert work.acc is not None and work.bounds is not None
                result, bounds, same = work.acc.result(), work.bounds, work.same or {}
                work.reset()  # free the sums before building and storing the result
                layout = info.layout or self._layout_of(contributions[0])
                pieces: dict[str, np.ndarray] = result.values  # type: ignore[assignment]
                if spec.max_norm is None:
                    # A piece every contribution stored as the same chunk averages to that
                    # chunk: take its values as they are, bit for bit, so a frozen layer's
                    # aggregate is the block every peer already holds (float32 sums are off
                    # by an ulp or two); clipping would scale it, so not then.
                    for key, source in same.items():
                        if key in pieces:
                            pieces[key] = load_chunk(self.store, source, verify=self._verify)
                # chunk by chunk from the pieces when they are cut as put_update cuts
                cid = put_pieces(
                    self.store,
                    pieces,
                    bounds,
                    layout,
                    num_samples=result.total_samples,
                    metadata=_result_metadata(info, result.used, result.dropped),
                    name=info.round_id.as_key(),
                )
                if cid is not None:
                    return cid
                values = assemble(pieces, bounds, layout)
            else:
                inputs = [
                    AggregateInput(dict(self._load(c).tensors), c.num_samples)
                    for c in contributions
                ]
                result = aggregate(inputs, spec)
                del inputs
                values = result.values  # type: ignore[assignment]
                assert isinstance(values, dict)  # inputs were dicts, so the aggregate is one too
                for layer in info.layout or ():
                    want = DType.parse(layer.dtype).numpy
                    if values[layer.name].dtype != want:
                        values[layer.name] = values[layer.name].astype(want)
        metadata = _result_metadata(info, result.used, result.dropped)
        update = ModelUpdate(values, result.total_samples, metadata, name=info.round_id.as_key())
        return put_update(self.store, update)

    def _facts(self, contribution: Contribution) -> UpdateFacts:
        """What the manifests of an accepted contribution say."""
        cid = Cid.parse(contribution.update_cid)
        key = contribution.round_id.as_key()
        return inspect_update(self.store, cid, key, contribution.peer, verify=self._verify)

    def _layout_of(self, contribution: Contribution) -> Layout:
        """The layout of a stored contribution (for rounds journaled without one)."""
        return self._facts(contribution).layout

    def _load(self, contribution: Contribution) -> ModelUpdate:
        return get_update(self.store, Cid.parse(contribution.update_cid), verify=self._verify)

    def _fail(self, round_id: RoundId, reason: str) -> None:
        status = self.tracker.status(round_id)
        if status is not None and not status.is_terminal:
            self._schedule_gc()  # queued before Failed wakes anyone
            self._mark_ended(round_id)
        if self.tracker.mark_failed(round_id, reason):
            self._count(rounds_failed=1)
            log.warning("round %s failed: %s", round_id, reason)
        self._forget(round_id)

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
        if keep_rounds < 1:
            raise ValueError(f"keep_rounds must be at least 1, got {keep_rounds}")
        grace = self.gc_grace if grace is None else grace
        with self._gc_lock.exclusive():
            rounds = self.tracker.rounds()
            cutoff = max((info.round_id.round for info in rounds), default=0) - keep_rounds + 1
            now = self.clock.now()
            with self._lock:
                ended = dict(self._ended)
            doomed = [
                info.round_id
                for info in rounds
                if info.status.is_terminal
                and info.round_id.round < cutoff
                and now - ended.get(info.round_id, -math.inf) >= grace
            ]
            if dry_run:
                removed = len(doomed)
            else:
                removed = self.tracker.forget(doomed)
                with self._lock:
                    for rid in doomed:
                        self._ended.pop(rid, None)
            gone = set(doomed)
            roots: list[Cid] = []
            for info in rounds:
                if info.round_id in gone:
                    continue
                roots.extend(Cid.parse(c.update_cid) for c in self.contributions(info.round_id))
                if isinstance(info.status, Complete):
                    roots.append(Cid.parse(info.status.cid))
            blocks = collect_garbage(self.store, roots, dry_run=dry_run, min_age=grace)
        if not dry_run:
            self._count(
                gc_runs=1,
                gc_rounds_removed=removed,
                gc_blocks_removed=blocks.removed,
                gc_bytes_removed=blocks.removed_bytes,
            )
        log.info(
            "collection%s: %d round(s) and %d block(s) (%d bytes) removed, %d spared as recent",
            " (dry run)" if dry_run else "",
            removed,
            blocks.removed,
            blocks.removed_bytes,
            blocks.spared,
        )
        return Retention(removed, blocks)

    def _mark_ended(self, round_id: RoundId) -> None:
        with self._lock:
            self._ended[round_id] = self.clock.now()

    def _schedule_gc(self) -> None:
        """Queue a collection (``keep_rounds`` set) unless one is already queued.

        Never raises: a collection that cannot be queued must not keep a round from ending.
        """
        if self.keep_rounds is None:
            return
        with self._lock:
            if self._closed or self._gc_queued:
                return
            try:
                if self._gc_pool is None:
                    self._gc_pool = ThreadPoolExecutor(1, thread_name_prefix="tensorswap-gc")
                self._gc_future = self._gc_pool.submit(self._run_gc)
            except Exception as exc:
                log.warning("cannot queue a collection: %s", exc)
                return
            self._gc_queued = True  # _run_gc clears it under this lock, held here

    def drain_collections(self, timeout: float | None = None) -> None:
        """Wait until the collections queued so far (``keep_rounds``) have run.

        A round that has ended has queued its collection by the time ``wait`` returns it.
        Raises TimeoutError if they take longer than ``timeout`` seconds.
        """
        with self._lock:
            future = self._gc_future
        if future is not None:
            future.result(timeout)

    def _run_gc(self) -> None:
        with self._lock:
            self._gc_queued = False
        keep = self.keep_rounds
        if keep is None:  # pragma: no cover - only queued when set
            return
        try:
            self.collect_garbage(keep)
        except Exception as exc:  # a failed collection deletes nothing more; the next retries
            self._count(gc_failures=1)
            log.warning("collection failed: %s", exc, exc_info=True)

    def _work_for(self, round_id: RoundId) -> _Work:
        with self._lock:
            work = self._work.get(round_id)
            if work is None:
                work = self._work[round_id] = _Work()
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
                self._pool.submit(self._aggregate, rid)
            elif info.received >= info.spec.expected_peers:
                self._begin(rid)

    # ── lifecycle ────────────────────────────────────────────────────────────
    def close(self) -> None:
        """Stop the timer, finish the running aggregation, drop queued ones, run the queued
        collections; idempotent.

        Rounds whose aggregation was dropped stay Aggregating in the journal and are
        aggregated again when a coordinator reopens it. Closes the store and journal it owns.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._timer is not None:
            self._timer.stop()
            unsubscribe = getattr(self.clock, "unsubscribe", None)
            if callable(unsubscribe):
                unsubscribe(self._timer.poke)
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._gc_pool is not None:  # collections already queued run to the end
            self._gc_pool.shutdown(wait=True)
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


def _result_metadata(info: RoundInfo, used: Sized, dropped: Sized) -> dict[str, str]:
    """The metadata stored with a round's aggregate."""
    return {
        "round": info.round_id.as_key(),
        "strategy": info.spec.strategy,
        "contributors": str(len(used)),
        "dropped": str(len(dropped)),
    }
