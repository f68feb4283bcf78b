"""RunManager: federated runs over a coordinator: sampling, rounds, the server optimizer."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import replace

from tensorswap.cid import Cid
from tensorswap.privacy.errors import PrivacyBudgetExhausted
from tensorswap.rounds import Admission, CoordinatorHooks
from tensorswap.rounds.core import (
    Complete,
    Contribution,
    Failed,
    RoundAlreadyTerminal,
    RoundClosed,
    RoundId,
    RoundStatus,
)
from tensorswap.rounds.engine import Coordinator, inspect_update
from tensorswap.runs.deadlines import journaled_deadline
from tensorswap.runs.dp import RunPrivacy, is_private
from tensorswap.runs.dp_params import check_dp_scale
from tensorswap.runs.errors import (
    BufferBusy,
    NonFiniteStep,
    NotSelected,
    RunExists,
    RunNotFound,
    RunsError,
)
from tensorswap.runs.finite import check_initial
from tensorswap.runs.journal import RunDatabase
from tensorswap.runs.model import (
    RunInfo,
    RunMode,
    RunSpec,
    Task,
    VersionRecord,
    check_run_name,
)
from tensorswap.runs.publish import Publisher, await_release
from tensorswap.runs.regional import RunUnits
from tensorswap.runs.registry import DEFAULT_INACTIVE_AFTER, ClientRegistry
from tensorswap.runs.round_start import round_spec, sample_next
from tensorswap.runs.secure import SECURE_ONLY, RunSecurity, is_secure, layout_size
from tensorswap.runs.step import check_policies, check_staleness

__all__ = ["RunManager", "Task"]

log = logging.getLogger(__name__)


class RunManager(CoordinatorHooks):
    """Runs federations on ``coordinator``: each run owns the rounds ``RoundId(n, run)``;
    one of its hooks (``admit``, ``sample_cap``, ``release``, ``roots``).

    Guarantees:

    - Every decision is journaled before it takes effect: the sample of each round, each
      new version's global model and optimizer state (as content-addressed updates in the
      coordinator's store). After a restart (kill -9 in any phase) the manager recomputes
      what it was doing from those CIDs: a round that completed without its version is
      stepped again from the same global model, state and aggregate, so the result is
      bit-identical.
    - A sync round samples ``spec.sample_size(active)`` registered, active peers from
      ``(seed, round)``; a peer not sampled is refused with NotSelected. It starts once
      ``min_clients`` peers are active. A failed round is followed by a new round from the
      same version.
    - An async run (FedBuff) accepts deltas from any active registered peer, each scaled by
      ``spec.scale_for(staleness)``; every ``buffer`` contributions are stepped into a new
      version. A delta staler than ``max_staleness`` is refused (StaleContribution), one
      from a version not made yet too (FutureVersion).
    - Only finite models: the initial one is checked (NonFiniteModel), each step at its
      round's release (``runs.publish``): NaN or Inf refuses it (NonFiniteStep, journaled,
      the round's failure reason) and the run goes on from its last version.
    - Listeners (``subscribe``) hear of every change (a round started, a version made), so
      peers long-polling for a task wake at once. Thread-safe.
    """

    def __init__(
        self,
        coordinator: Coordinator,
        journal: RunDatabase,
        registry: ClientRegistry,
    ) -> None:
        self.coordinator = coordinator
        self.journal = journal
        self.registry = registry
        self.store = coordinator.store
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._runs: dict[str, RunInfo] = {r.name: r for r in journal.load_runs()}
        self.privacy = RunPrivacy(journal)
        self.secure = RunSecurity(coordinator, journal, self.release, self._notify)
        self.units = RunUnits(registry)  # regions fold their sampled peers (runs.regional)
        self.publisher = Publisher(self.store, journal, self.privacy)  # steps made at release
        self._listeners: list[Callable[[str], None]] = []
        self._closed = False
        self._owns_journal = False
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tensorswap-runs")
        coordinator.hooks.add(self)
        coordinator.subscribe(self._on_round)
        registry.subscribe(self._on_registration)
        for name in list(self._runs):
            self._queue(name)  # resume whatever each run was doing

    @classmethod
    def open(
        cls,
        coordinator: Coordinator,
        *,
        inactive_after: float = DEFAULT_INACTIVE_AFTER,
        durable: bool = True,
    ) -> RunManager:
        """A manager journaling into the coordinator's own database file (``rounds.sqlite3``),
        closed by ``close``. The coordinator must have a journal (``Coordinator.open``)."""
        if coordinator.journal is None:
            raise ValueError("runs need a journaled coordinator (Coordinator.open(dir))")
        journal = RunDatabase(coordinator.journal.path, durable=durable)
        try:
            registry = ClientRegistry(journal, coordinator.clock, inactive_after=inactive_after)
            manager = cls(coordinator, journal, registry)
        except BaseException:
            journal.close()
            raise
        manager._owns_journal = True
        return manager

    # ── runs ─────────────────────────────────────────────────────────────────
    def create_run(self, name: str, spec: RunSpec, initial: Cid | str) -> RunInfo:
        """Start run ``name`` from the model update ``initial`` (in the store) at version 0.

        Idempotent: the same name, spec and initial model return the run as it is;
        RunExists for the same name with another spec or model; NonFiniteModel for a model
        holding NaN or Inf; InvalidRunSpec for DP noise too large for the model's size.
        """
        check_run_name(name)
        check_policies(spec)
        cid = initial if isinstance(initial, Cid) else Cid.parse(initial)
        facts = inspect_update(self.store, cid, name, "run", verify=True)
        check_dp_scale(spec, layout_size(facts.layout))
        check_initial(self.store, facts, name)
        with self._lock:
            known = self._runs.get(name)
            if known is not None:
                if known.spec != spec or self._initial(name) != cid:
                    raise RunExists(name, "another spec or initial model")
                return known
            info = RunInfo(name, spec, 0, cid, None, 0, (), False, time.time())
            self.journal.insert_run(info)
            self._runs[name] = info
        log.info("run %s created: %s, %d layers, %s", name, spec.mode, len(facts.layout), cid)
        self._queue(name)
        return info

    def run(self, name: str) -> RunInfo:
        with self._lock:
            info = self._runs.get(name)
        if info is None:
            raise RunNotFound(name)
        return info

    def runs(self) -> list[RunInfo]:
        with self._lock:
            return list(self._runs.values())

    def versions(self, name: str) -> list[VersionRecord]:
        self.run(name)
        return self.journal.versions(name)

    def owns(self, round_id: RoundId) -> bool:
        """Whether ``round_id`` is a round of a run (started by the run, not by peers)."""
        with self._lock:
            return round_id.initiator in self._runs

    def roots(self) -> list[Cid]:
        """The coordinator's hook: the blocks every run still needs (its global model and
        optimizer state, and the versions made but not yet recorded)."""
        with self._lock:
            runs = list(self._runs.values())
        cids = [r.global_cid for r in runs]
        cids += [r.state_cid for r in runs if r.state_cid is not None]
        return cids + self.publisher.roots()

    def subscribe(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(run_name)`` after every change of that run (from any thread)."""
        with self._lock:
            self._listeners.append(listener)

    # ── peers ────────────────────────────────────────────────────────────────
    def task(self, name: str, peer: str) -> Task | None:
        """The peer's task in the run now, or None (not sampled, already submitted, the run
        waits for peers or is finished). Counts as a heartbeat (NotRegistered if unknown)."""
        self.registry.seen(peer)
        info = self.run(name)
        if info.finished or info.round == 0:
            return None
        rid = RoundId(info.round, name)
        round_info = self.coordinator.info(rid)
        if round_info is None or round_info.status.is_terminal:
            return None
        done = self.units.unit(info, peer) in round_info.peers  # itself, or its region
        if done or round_info.status.name == "Aggregating":
            return None
        if info.spec.mode is RunMode.SYNC and peer not in info.selected:
            return None
        if (secure := is_secure(info.spec)) and not self.secure.awaits(rid, peer):
            return None
        private = is_private(info.spec)
        dp = info.spec.dp_clipping if private else ""
        clip = self.privacy.clip_for(info, info.round) if private else None
        return Task(name, rid, info.version, info.global_cid, info.spec.mode, dp, clip, secure)

    def submit(
        self,
        round_id: RoundId,
        peer: str,
        update: Cid | str,
        *,
        trained_on: int | None = None,
        clipped: bool | None = None,
    ) -> RoundStatus:
        """Submit a peer's update to a round of a run: checked against the sample (sync) or
        its staleness (async: ``trained_on`` is the version it trained from; the delta joins
        the buffer open now, whatever ``round_id`` says, or BufferBusy when none is open to
        it), then handed to the coordinator. Raises NotSelected, StaleContribution, or what
        the coordinator
        refuses. (A sync run's peers may also submit through the coordinator itself, e.g.
        ``RoundClient.submit``: the same check runs there.) A DP run takes the delta from
        version ``trained_on`` (the current one) and ``clipped``, the peer's clip bit with
        client-side clipping; see ``RunPrivacy.admit``."""
        self.registry.seen(peer)
        info = self.run(round_id.initiator)
        scale = 1.0
        if is_secure(info.spec):
            raise RunsError(SECURE_ONLY.format(info.name))
        if info.spec.mode is RunMode.ASYNC:
            return self._submit_async(info, peer, update, trained_on)
        if is_private(info.spec):
            cid = update if isinstance(update, Cid) else Cid.parse(update)
            scale = self.privacy.admit(
                self.store, info, round_id.round, peer, cid, trained_on, clipped
            )
        return self.coordinator.submit(round_id, peer, update, scale=scale, via=self)

    def _submit_async(
        self, info: RunInfo, peer: str, update: Cid | str, trained_on: int | None
    ) -> RoundStatus:
        """Into the buffer open now, whatever round the peer's task named (FedBuff: a delta
        joins the current buffer, scaled by its staleness); BufferBusy when none is open
        to this peer (the service then waits for the next one)."""
        scale = check_staleness(info, peer, trained_on)
        assert trained_on is not None  # check_staleness refuses None
        rid = RoundId(info.round, info.name)
        if not self.buffer_open(info.name, peer):
            raise BufferBusy(info.name, info.round, peer)
        self.journal.note_trained_on(info.name, rid.round, peer, trained_on)
        try:
            status = self.coordinator.submit(rid, peer, update, scale=scale, via=self)
        except (RoundClosed, RoundAlreadyTerminal):
            raise BufferBusy(info.name, info.round, peer) from None  # filled meanwhile
        return await_release(self.coordinator, self.journal, rid, status)  # its step refused?

    def sample_cap(self, round_id: RoundId, peer: str, cap: int | None) -> int | None:
        """The coordinator's hook: a run's ``max_samples_per_peer`` (times a region's peers)."""
        with self._lock:
            info = self._runs.get(round_id.initiator)
        return cap if info is None else self.units.sample_cap(info, peer, cap)

    def buffer_open(self, name: str, peer: str) -> bool:
        """Whether an asynchronous run's current buffer would take ``peer``'s delta now
        (also True when the run is finished or not asynchronous: nothing to wait for)."""
        info = self.run(name)
        if info.finished or info.spec.mode is not RunMode.ASYNC:
            return True
        current = self.coordinator.info(RoundId(info.round, name)) if info.round else None
        if current is None or current.status.is_terminal or peer in current.peers:
            return False
        return current.status.name != "Aggregating"  # Pending or Collecting

    def admit(self, admission: Admission) -> None:
        """The coordinator's hook: refuses unsampled peers; a DP or async run's delta only
        through ``submit`` (``via`` this manager, its own checks made)."""
        round_id, peer, direct = admission.round_id, admission.peer, admission.via is not self
        with self._lock:
            info = self._runs.get(round_id.initiator)
        if info is None:
            return
        if is_secure(info.spec):  # RunSecurity completes the round with the unmasked sum
            raise RunsError(SECURE_ONLY.format(info.name))
        if info.spec.mode is RunMode.SYNC:
            if round_id.round != info.round or peer not in self.units.of(info):
                raise NotSelected(info.name, round_id.round, peer, len(info.selected))
            if is_private(info.spec) and direct:
                raise RunsError(
                    f"run {info.name!r} is differentially private: contribute the delta from "
                    f"the task's model (RunClient.submit, RunManager.submit(..., trained_on=))"
                )
        elif direct:
            raise RunsError(
                f"run {info.name!r} is asynchronous: contribute with the version trained on "
                f"(RunClient.submit, RunManager.submit(..., trained_on=))"
            )

    # ── transitions (on the manager's thread) ────────────────────────────────
    def _on_round(self, round_id: RoundId, status: RoundStatus) -> None:
        if status.is_terminal and self.owns(round_id):
            self._queue(round_id.initiator)

    def _on_registration(self) -> None:
        with self._lock:
            waiting = [r.name for r in self._runs.values() if not r.finished and _waiting(r)]
        for name in waiting:
            self._queue(name)

    def _queue(self, name: str) -> None:
        with self._lock:
            if self._closed:
                return
            self._pool.submit(self._advance_logged, name)

    def _advance_logged(self, name: str) -> None:
        try:
            self._advance(name)
        except Exception:
            log.exception("run %s: could not advance", name)

    def _advance(self, name: str) -> None:
        """Bring the run forward: step a completed round into a version, start the next."""
        info = self.run(name)
        if info.finished:
            return
        if info.round > 0:
            rid = RoundId(info.round, name)
            current = self.coordinator.info(rid)
            if current is None:  # journaled as started, not yet in the coordinator: start it
                self._start_coordinator_round(info)
                return
            status = current.status
            if not status.is_terminal:
                self.secure.resume(info)  # a secure round a restart cut short fails cleanly
                return  # collecting or aggregating: the coordinator goes on by itself
            if isinstance(status, Complete) and info.version < self._version_of_round(info):
                # the new model is a root when done; a refused step (journaled) stays
                with self.coordinator.no_collection(), suppress(NonFiniteStep):
                    info = self._step(info, status)
            elif isinstance(status, Failed):
                log.warning("run %s: round %d failed (%s)", name, info.round, status.reason)
        if info.spec.rounds is not None and info.version >= info.spec.rounds:
            return
        self._start_next(info)

    def _version_of_round(self, info: RunInfo) -> int:
        """The version a Complete round ``info.round`` makes: one more than the current,
        unless a version was already recorded for that round."""
        versions = self.journal.versions(info.name)
        if versions and versions[-1].round == info.round:
            return versions[-1].version
        return info.version + 1

    def _kept(self, rid: RoundId) -> list[Contribution]:
        """The round's contributions less those dropped when it aggregated (secure: survivors)."""
        if is_secure(self.run(rid.initiator).spec):
            return self.secure.contributions(rid)
        round_info = self.coordinator.info(rid)
        left_out = round_info.dropped_peers if round_info is not None else frozenset()
        return [c for c in self.coordinator.contributions(rid) if c.peer not in left_out]

    def release(self, round_id: RoundId, aggregate: Cid) -> Cid:
        """The coordinator's (and RunSecurity's) release hook, before Complete names anything:
        a DP run's round is Complete with its noised aggregate, never the clean mean of
        clipped deltas; its step is made and checked now (``runs.publish``)."""
        with self._lock:
            info = self._runs.get(round_id.initiator)
        if info is None or round_id.round != info.round:
            return aggregate
        trained_on = self.journal.trained_on(info.name, info.round)
        return self.publisher.release(info, aggregate, self._kept(round_id), trained_on)

    def may_stream(self, round_id: RoundId) -> bool:
        """A run's round may not stream (``release`` may noise or step it); others may."""
        with self._lock:
            return round_id.initiator not in self._runs

    def _step(self, info: RunInfo, status: Complete) -> RunInfo:
        rid = RoundId(info.round, info.name)
        contributions = self._kept(rid)
        trained_on = self.journal.trained_on(info.name, info.round)
        record = self.publisher.take(info, Cid.parse(status.cid), contributions, trained_on)
        finished = info.spec.rounds is not None and record.version >= info.spec.rounds
        self.journal.add_version(info.name, record, finished)
        new = replace(
            info,
            version=record.version,
            global_cid=record.global_cid,
            state_cid=record.state_cid,
            finished=finished,
        )
        with self._lock:
            self._runs[info.name] = new
        log.info("run %s: version %d = %s", info.name, record.version, record.global_cid)
        self._notify(info.name)
        return new

    def _start_next(self, info: RunInfo) -> None:
        selected: tuple[str, ...] = ()
        if info.spec.mode is RunMode.SYNC:
            try:
                sampled = sample_next(info, self.registry.active(), self.privacy)
            except PrivacyBudgetExhausted as exc:
                log.warning("%s: the run stops", exc)
                with self._lock:
                    self._runs[info.name] = replace(info, selected=(), finished=True)
                self._notify(info.name)
                return
            if sampled is None:  # too few peers active: the round waits
                with self._lock:
                    self._runs[info.name] = replace(info, selected=())
                return
            selected = sampled
        self.journal.start_round(info.name, info.round + 1, selected)
        info = replace(info, round=info.round + 1, selected=selected)
        with self._lock:
            self._runs[info.name] = info
        self._start_coordinator_round(info)

    def _start_coordinator_round(self, info: RunInfo) -> None:
        spec = info.spec
        facts = inspect_update(self.store, info.global_cid, info.name, "run", verify=True)
        expected = len(self.units.of(info)) if spec.mode is RunMode.SYNC else spec.buffer
        timeout_s = spec.round_timeout_s if spec.mode is RunMode.SYNC else None
        if isinstance(timeout_s, str):  # "auto"
            info = self._auto_deadline(info, spec.quorum_of(expected))
            timeout_s = info.deadline_s
        built, secure = round_spec(info, expected, timeout_s, facts.layout)
        self.coordinator.start_round(RoundId(info.round, info.name), built)
        if secure:
            self.secure.open(info, facts.layout)
        log.info("run %s: round %d started, %s", info.name, info.round, info.selected or "open")
        self._notify(info.name)

    def _auto_deadline(self, info: RunInfo, quorum: int) -> RunInfo:
        """Round ``info.round``'s deadline (``journaled_deadline``), in the run's snapshot."""
        seconds, reason = journaled_deadline(self.journal, self.coordinator, info, quorum)
        log.info("run %s: round %d deadline %.3f s, %s", info.name, info.round, seconds, reason)
        info = replace(info, deadline_s=seconds, deadline_reason=reason)
        with self._lock:
            self._runs[info.name] = info
        return info

    def _initial(self, name: str) -> Cid | None:
        versions = self.journal.versions(name)
        return versions[0].global_cid if versions else None

    def wait_version(self, name: str, version: int, timeout: float | None = None) -> RunInfo:
        """Block until run ``name`` reaches ``version`` (or finishes); TimeoutError after
        ``timeout`` seconds."""
        with self._changed:
            if not self._changed.wait_for(
                lambda: self.run(name).version >= version or self.run(name).finished, timeout
            ):
                raise TimeoutError(f"run {name!r} did not reach version {version} in {timeout} s")
            return self.run(name)

    def _notify(self, name: str) -> None:
        with self._changed:
            self._changed.notify_all()
            listeners = list(self._listeners)
        for listener in listeners:
            try:
                listener(name)
            except Exception:
                log.exception("run listener %r failed on %s", listener, name)

    # ── lifecycle ────────────────────────────────────────────────────────────
    def drain(self, timeout: float | None = None) -> None:
        """Wait until the transitions queued so far have run (for tests and shutdown)."""
        self._pool.submit(lambda: None).result(timeout)

    def close(self) -> None:
        """Finish the transition in progress; queue no more. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.secure.close()
        if self._owns_journal:
            self.journal.close()


def _waiting(info: RunInfo) -> bool:
    """A sync run whose next round waits for peers (no round in flight)."""
    return info.spec.mode is RunMode.SYNC and not info.selected
