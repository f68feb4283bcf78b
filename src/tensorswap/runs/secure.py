"""RunSecurity: SecAgg+ on a run's rounds, so the coordinator learns only the sum of the
sampled peers' deltas (what the run manager calls at its few secure points: a round's start,
a restart, a round's step; the service hands it the peers' protocol messages).

A secure round is a coordinator round that admits no contribution: once its SecAgg+ session
finishes, this module stores the unmasked mean delta and completes the round with it
(``Coordinator.complete_round``; a DP run's release hook noises it first), so the round is
stepped like any other. Peers' masked
vectors arrive as raw blocks pushed into the coordinator's store (referenced by CID) and are
deleted once the session ends. Journaled (table ``run_secagg``): each round's phase, and at
the end its survivors, the dropped peers and the aggregate's CID, or why it failed; no share,
key or masked vector is persisted, so a coordinator restarted between phases fails that round
(typed reason) and the run samples a new one: nothing on disk lets anyone learn one update.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from tensorswap.cid import Cid, Multicodec
from tensorswap.rounds.core import Contribution, Layout, RoundId
from tensorswap.runs.errors import NonFiniteStep, NotSelected, RunsError
from tensorswap.store import ModelUpdate, put_update

if TYPE_CHECKING:  # the secagg package needs ``cryptography``: imported when a round opens
    from tensorswap.privacy.secagg.coordinator import SecAggSession, SecAggSessions
    from tensorswap.privacy.secagg.protocol import MaskedInput
    from tensorswap.rounds.engine import Coordinator
    from tensorswap.runs.journal import RunDatabase
    from tensorswap.runs.model import RunInfo, RunSpec

__all__ = [
    "SECURE_ONLY",
    "RunSecurity",
    "is_secure",
    "layout_size",
    "secagg_weight",
]

log = logging.getLogger(__name__)

SECURE_ONLY = (
    "run {!r} aggregates securely (SecAgg+): contribute with RunClient.submit, which masks "
    "the delta; a plain update would show it to the coordinator"
)

_MASKED_CODECS = frozenset({Multicodec.TENSORSWAP_MASKED, Multicodec.RAW})
"""A masked vector's codecs: its own (held in memory by the coordinator), or raw (earlier
peers; a file)."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS run_secagg (
    run           TEXT    NOT NULL,
    round         INTEGER NOT NULL,
    phase         TEXT    NOT NULL,
    survivors     TEXT    NOT NULL,
    dropped       TEXT    NOT NULL,
    aggregate_cid TEXT,
    reason        TEXT    NOT NULL,
    PRIMARY KEY (run, round),
    FOREIGN KEY (run) REFERENCES runs (name) ON DELETE CASCADE
);
"""


def is_secure(spec: RunSpec) -> bool:
    return bool(spec.secagg)


def secagg_weight(spec: RunSpec) -> int:
    """The largest weight a peer sends: 1 (every peer weighs the same) in a DP run or with the
    ``mean`` strategy, else ``secagg_max_weight`` (FedAvg by num_samples)."""
    return 1 if spec.dp_clip is not None or spec.strategy == "mean" else spec.secagg_max_weight


def layout_size(layout: Layout) -> int:
    """How many values a model of ``layout`` has (the length of a peer's vector)."""
    return sum(math.prod(layer.shape) for layer in layout)


def _unflatten(vector: np.ndarray, layout: Layout) -> dict[str, np.ndarray]:
    out, at = {}, 0
    for layer in layout:
        size = math.prod(layer.shape)
        part = vector[at : at + size].astype(layer.dtype, copy=False)  # a view if float32
        out[layer.name] = part.reshape(layer.shape)
        at += size
    return out


@dataclass(frozen=True, slots=True)
class _Open:
    run: str
    round: int
    layout: Layout
    dim: int


class RunSecurity:
    """The secure side of every run of a manager (runs without ``secagg`` pass through).

    ``release(round_id, aggregate)`` is the manager's release hook (the CID a round completes
    with: a DP run's noised aggregate); ``notify(run)`` wakes whoever waits on the run
    (long-polling peers). Thread-safe.
    """

    def __init__(
        self,
        coordinator: Coordinator,
        journal: RunDatabase,
        release: Callable[[RoundId, Cid], Cid],
        notify: Callable[[str], None],
    ) -> None:
        # The protocol package, now, on this one thread (where ``cryptography`` is installed):
        # first imported by two threads at once (a round opening on the manager's, a peer's
        # request on the event loop's), its circular imports can meet half-done (ImportError).
        with contextlib.suppress(ImportError):
            import tensorswap.privacy.secagg  # noqa: F401
        self.coordinator = coordinator
        self.store = coordinator.store
        self.journal = journal.journal
        self._release_hook = release
        self._notify = notify
        self._lock = threading.Lock()
        self._changes = threading.Lock()  # one session change handled at a time, in order
        self._sessions: SecAggSessions | None = None
        self._open: dict[str, _Open] = {}
        self._blocks: dict[str, list[Cid]] = {}
        self.journal.register("secagg", _SCHEMA)

    # ── a round starts ───────────────────────────────────────────────────────
    def open(self, info: RunInfo, layout: Layout) -> None:
        """Open round ``info.round``'s SecAgg+ session over its sampled peers (journaled as
        ``advertise``); a sample the parameters cannot serve fails the round at once."""
        from tensorswap.privacy.secagg.coordinator import SecAggSession, SecAggSessions
        from tensorswap.privacy.secagg.errors import SecAggError
        from tensorswap.privacy.secagg.protocol import make_config

        spec, rid = info.spec, RoundId(info.round, info.name)
        key = rid.as_key()
        dim = layout_size(layout)
        clip = spec.secagg_clip
        if clip is None:
            clip = spec.dp_clip if spec.dp_clip is not None else 1.0
        with self._lock:
            if self._sessions is None:
                self._sessions = SecAggSessions(self.coordinator.clock)
            sessions = self._sessions
            self._open[key] = _Open(info.name, info.round, layout, dim)
        self._write(info.name, info.round, "advertise")
        try:
            config = make_config(
                range(len(info.selected)),
                dim,
                threshold=spec.secagg_threshold,
                bits=spec.secagg_bits,
                clip=clip,
                max_weight=secagg_weight(spec),
                min_survivors=spec.secagg_min_survivors,
            )
        except SecAggError as exc:
            self._failed(rid, f"{type(exc).__name__}: {exc}")
            return
        timeout = spec.round_timeout_s
        first = None if not isinstance(timeout, int | float) else self.coordinator.clock.now()
        session = SecAggSession(
            key,
            config,
            info.selected,
            clock=self.coordinator.clock,
            quorum=spec.quorum_of(len(info.selected)),
            phase_timeout_s=spec.secagg_phase_timeout_s,
            first_deadline=None if first is None else first + float(timeout),  # type: ignore[arg-type]
            on_change=self._on_change,
        )
        sessions.add(session)
        log.info(
            "run %s: round %d secure: %d peers, k=%d, t=%d, %d bits, clip %g",
            info.name,
            info.round,
            len(info.selected),
            config.neighbours,
            config.threshold,
            config.bits,
            config.clip,
        )

    # ── peers ────────────────────────────────────────────────────────────────
    def session_for(self, info: RunInfo, round_id: RoundId, peer: str) -> SecAggSession:
        """The live session of ``round_id`` for a sampled ``peer``: NotSelected, or
        SecureRoundFailed when the round has none (ended, failed, lost in a restart)."""
        from tensorswap.privacy.secagg.errors import OutOfPhase, SecureRoundFailed

        if not is_secure(info.spec):
            raise RunsError(f"run {info.name!r} does not aggregate securely")
        if round_id.round != info.round or peer not in info.selected:
            reason = self.reason(info.name, round_id.round)
            if reason:  # a round that ended badly says why (a restart, too few survivors)
                raise SecureRoundFailed(round_id.as_key(), reason)
            raise NotSelected(info.name, round_id.round, peer, len(info.selected))
        session = self._session(round_id.as_key())
        if session is None or session.finished:
            row = self._row(info.name, round_id.round)
            if row is not None and row[0] == "done":
                raise OutOfPhase("server", "done", "a message after the round was unmasked")
            reason = self.reason(info.name, round_id.round) or "the round has no open session"
            raise SecureRoundFailed(round_id.as_key(), reason)
        return session

    def awaits(self, round_id: RoundId, peer: str) -> bool:
        """Whether the round's session is open and ``peer`` has not joined it yet (it has a
        task; once it joined, its task is under way)."""
        session = self._session(round_id.as_key())
        return session is not None and not session.finished and peer not in session.joined

    def masked_input(
        self, round_id: RoundId, message: MaskedInput, block: bytes | None
    ) -> MaskedInput:
        """``message`` with its masked vector read from the raw block ``block`` (pushed into
        the coordinator's store): MalformedSecAggMessage unless it is there with the length
        the round's dimension gives."""
        from tensorswap.privacy.secagg.errors import MalformedSecAggMessage

        key = round_id.as_key()
        with self._lock:
            meta = self._open.get(key)
        if block is None or message.masked:
            raise MalformedSecAggMessage("a masked vector travels as a pushed block, by CID")
        cid = Cid.parse(block)
        if cid.codec not in _MASKED_CODECS:
            raise MalformedSecAggMessage(f"the masked vector {cid} is not a raw or masked block")
        if meta is None or not self.store.has(cid):
            raise MalformedSecAggMessage(f"the masked vector {cid} is not in the store: push it")
        want = 4 * (meta.dim + 1)
        if self.store.size_of(cid) != want:
            raise MalformedSecAggMessage(f"the masked vector {cid} is not {want} bytes long")
        # a read-only view (verified as it was pushed), no copy; it stays valid after the
        # block is deleted
        data = self.store.get(cid)
        with self._lock:
            self._blocks.setdefault(key, []).append(cid)
        return msgspec.structs.replace(message, masked=data)

    def post_masked(
        self,
        rid: RoundId,
        session: SecAggSession,
        peer: str,
        message: MaskedInput,
        block: bytes | None,
    ) -> None:
        """Post ``peer``'s masked input to ``session`` (its vector read from the pushed
        ``block``, see ``masked_input``), then delete the block: the session folds a masked
        vector into its running sum as it takes it, and nothing reads one again (a restart
        fails the round), so the coordinator holds at most the vectors being folded rather
        than a round's worth. A block written and unlinked at once costs the file system a
        fraction of one kept (ext4's delayed allocation never gives it disk blocks). A
        refused input's block goes too (the refusal ends that peer's part in the round)."""
        taken = self.masked_input(rid, message, block)
        cid = Cid.parse(block or b"")
        try:
            session.post(peer, taken)
        finally:
            with self._lock:
                kept = self._blocks.get(rid.as_key())
                if kept is not None and cid in kept:
                    kept.remove(cid)
            self.store.delete(cid)

    # ── restart, step ────────────────────────────────────────────────────────
    def resume(self, info: RunInfo) -> None:
        """A secure round still collecting with no live session (the coordinator restarted
        between phases): complete it with its aggregate if that was journaled, else fail it
        cleanly."""
        if not is_secure(info.spec):
            return
        rid = RoundId(info.round, info.name)
        if self._session(rid.as_key()) is not None:
            return
        row = self._row(info.name, info.round)
        if row is not None and row[0] == "done" and row[3]:
            self._release(rid, Cid.parse(row[3]))  # the caller saw the round still open
            return
        phase = row[0] if row is not None else "setup"
        self._failed(
            rid,
            f"the coordinator restarted during phase {phase!r}; the protocol's secrets were in "
            f"memory only, so the round cannot go on",
        )

    def contributions(self, rid: RoundId) -> list[Contribution]:
        """The survivors of round ``rid`` (for the step's participants and DP's count)."""
        row = self._row(rid.initiator, rid.round)
        survivors = json.loads(row[1]) if row is not None else []
        return [Contribution(rid, str(peer), "") for peer in survivors]

    def _release(self, rid: RoundId, cid: Cid) -> None:
        """Complete the coordinator round with the unmasked aggregate (as released); a
        release the hook refuses (NonFiniteStep: its step would publish NaN or Inf) fails
        the round with the refusal as reason."""
        try:
            released = self._release_hook(rid, cid)
        except NonFiniteStep as exc:
            self._failed(rid, str(exc))
            return
        self.coordinator.complete_round(rid, released)

    def reason(self, run: str, round: int) -> str:
        row = self._row(run, round)
        return row[4] if row is not None else ""

    # ── the session's end ────────────────────────────────────────────────────
    def _on_change(self, session: SecAggSession) -> None:
        with self._changes:
            self._handle(session)

    def _handle(self, session: SecAggSession) -> None:
        """Journal the session's new phase; at its end store and release the aggregate, or
        fail the round. Each end is handled once (later calls find the round closed)."""
        with self._lock:
            meta = self._open.get(session.key)
        if meta is None:
            return
        rid = RoundId(meta.round, meta.run)
        if session.failure is not None:
            self._failed(rid, session.failure)
        elif session.outcome is not None:
            out = session.outcome
            update = ModelUpdate(
                _unflatten(out.mean, meta.layout),
                out.weight_sum,
                {"run": meta.run, "round": str(meta.round), "secagg": "unmasked mean delta"},
                name=f"{meta.run}@{meta.round}/secagg",
            )
            with self.coordinator.no_collection():  # stored, then the round names it
                try:
                    cid = put_update(self.store, update)
                    self._write(meta.run, meta.round, "done", out.survivors, out.dropped, str(cid))
                except Exception as exc:  # a full disk: the round cannot be released
                    self._failed(rid, f"storing the unmasked aggregate failed: {exc}")
                    return
                blocks = self._end(session.key, delete=False)
                for peer, accusers in out.implicated.items():
                    log.warning(
                        "run %s: round %d: peer %r dropped: %s could not open its shares",
                        meta.run,
                        meta.round,
                        peer,
                        list(accusers),
                    )
                log.info(
                    "run %s: round %d unmasked: %d survivors, %d dropped",
                    meta.run,
                    meta.round,
                    len(out.survivors),
                    len(out.dropped),
                )
                self._release(rid, cid)
            self._notify(meta.run)
            self._delete(blocks)  # after the release: the step need not wait for the unlinks
        else:
            # the peers first: the phase is journaled only for a restart's failure reason
            self._notify(meta.run)
            self._write(meta.run, meta.round, session.phase)

    def _failed(self, rid: RoundId, reason: str) -> None:
        self._write(rid.initiator, rid.round, "failed", reason=reason)
        self._end(rid.as_key())
        self.coordinator.fail_round(rid, f"secure aggregation: {reason}")
        self._notify(rid.initiator)

    def _end(self, key: str, *, delete: bool = True) -> list[Cid]:
        """Forget the session of ``key``; its masked blocks deleted, or returned to delete."""
        with self._lock:
            sessions = self._sessions
            blocks = self._blocks.pop(key, [])
            self._open.pop(key, None)
        if sessions is not None:
            sessions.pop(key)
        if delete:
            self._delete(blocks)
        return blocks

    def _delete(self, blocks: list[Cid]) -> None:
        for cid in blocks:  # uniform noise on their own; no reason to keep them
            self.store.delete(cid)

    def _session(self, key: str) -> SecAggSession | None:
        with self._lock:
            sessions = self._sessions
        return None if sessions is None else sessions.get(key)

    # ── journal ──────────────────────────────────────────────────────────────
    def _write(
        self,
        run: str,
        round: int,
        phase: str,
        survivors: tuple[str, ...] = (),
        dropped: tuple[str, ...] = (),
        cid: str | None = None,
        reason: str = "",
    ) -> None:
        with self.journal.transaction() as db:
            db.execute(
                "INSERT OR REPLACE INTO run_secagg VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    run,
                    round,
                    phase,
                    json.dumps(list(survivors)),
                    json.dumps(list(dropped)),
                    cid,
                    reason,
                ),
            )

    def _row(self, run: str, round: int) -> tuple[str, str, str, str | None, str] | None:
        rows = self.journal.query(
            "SELECT phase, survivors, dropped, aggregate_cid, reason FROM run_secagg"
            " WHERE run = ? AND round = ?",
            (run, round),
        )
        if not rows:
            return None
        phase, survivors, dropped, cid, reason = rows[0]
        return (
            str(phase),
            str(survivors),
            str(dropped),
            None if cid is None else str(cid),
            str(reason),
        )

    def close(self) -> None:
        """Stop the phase timer; unfinished sessions fail (their secrets are memory only)."""
        with self._lock:
            sessions, self._sessions = self._sessions, None
        if sessions is not None:
            sessions.close()

    # ── for tools and tests ──────────────────────────────────────────────────
    def session(self, key: str) -> SecAggSession | None:
        """The secure session of the round ``key`` (``RoundId.as_key()``), None if none."""
        return self._session(key)

    def sessions(self) -> list[SecAggSession]:
        """The secure sessions held now, open or just finished."""
        with self._lock:
            sessions = self._sessions
        return [] if sessions is None else sessions.all()

    def row(self, run: str, round: int) -> tuple[str, str, str, str | None, str] | None:
        """The journal's row of a secure round: phase, survivors and dropped (JSON lists),
        the aggregate's CID, the reason it failed; None before its session opened."""
        return self._row(run, round)
