"""SecAggSession: the coordinator's side of one round's SecAgg+ by peer name, with phase
deadlines; SecAggSessions: a coordinator's sessions, their phases closed on time by a timer.

A session wraps a ``SecAggServer``. Peers are named (the run's sampled peers, sorted; peer
``i`` of the config is ``names[i]``). Each peer message is posted as it arrives; a phase
closes as soon as every peer it expects has answered, or at its deadline with whoever did:
the first (advertise) phase at the deadline the caller gives (the round's; None: it waits for
every sampled peer), each later one ``phase_timeout_s`` after it opened; the masked-input
phase, which peers train in, not before the first deadline (with none, it waits for all).
What a peer receives next is ``message_for(peer, after)``: its ``after``-th server message
(0: the setup), None while the phase is still open, so a peer long-polls for it. Nothing
here is persisted: the peers' shares and the server's partial state live in memory only.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from tensorswap.privacy.secagg.errors import (
    BelowSurvivorFloor,
    OutOfPhase,
    PeerDropped,
    SecAggError,
    SecureRoundFailed,
    UnknownParticipant,
)
from tensorswap.privacy.secagg.protocol import Message, SecAggConfig, encode
from tensorswap.privacy.secagg.server import SecAggServer, ServerPhase
from tensorswap.rounds.core import Clock, DeadlineTimer

__all__ = ["PHASES", "SecAggOutcome", "SecAggSession", "SecAggSessions"]

log = logging.getLogger(__name__)

PHASES = ("setup", "advertise", "share", "masked input", "unmask")
"""A session's phases by the index of the server message that opens them."""


@dataclass(frozen=True)
class SecAggOutcome:
    """A finished session: who survived (their sum is in ``mean``), who dropped, the FedAvg
    weighted mean (float32), the survivors' total weight, and the peers dropped because
    neighbours could not open their shares (``implicated``: peer -> its accusers)."""

    survivors: tuple[str, ...]
    dropped: tuple[str, ...]
    mean: np.ndarray
    weight_sum: int
    implicated: dict[str, tuple[str, ...]] = field(default_factory=dict)


class SecAggSession:
    """One round's secure aggregation, thread-safe. ``on_change(session)`` is called (outside
    the session's lock) after every phase closes, the session finishes or fails."""

    def __init__(
        self,
        key: str,
        config: SecAggConfig,
        names: Sequence[str],
        *,
        clock: Clock,
        quorum: int,
        phase_timeout_s: float,
        first_deadline: float | None,
        on_change: Callable[[SecAggSession], None] | None = None,
    ) -> None:
        if len(names) != len(config.peers) or len(set(names)) != len(names):
            raise ValueError("one distinct name per peer of the config")
        self.key = key
        self.server = SecAggServer(config)
        self.names = tuple(names)
        self._ids = {name: peer for peer, name in zip(config.peers, names, strict=True)}
        self._clock = clock
        self._quorum = quorum
        self._phase_timeout = phase_timeout_s
        self.deadline = first_deadline
        self._round_deadline = first_deadline
        self._on_change = on_change
        self._lock = threading.Lock()
        self._outboxes = [{p: encode(m) for p, m in self.server.setup_messages().items()}]
        self._expected = set(config.peers)
        self._answered: set[int] = set()
        self.joined: set[str] = set()
        self.failure: str | None = None
        self.outcome: SecAggOutcome | None = None

    @property
    def phase(self) -> str:
        """The phase collecting now (``done`` / ``failed`` at the end)."""
        if self.failure is not None:
            return "failed"
        if self.outcome is not None:
            return "done"
        return PHASES[len(self._outboxes)]

    @property
    def waiting(self) -> set[str]:
        """The names of the peers whose message the open phase expects and has not had."""
        return {self.names[i] for i in self._expected - self._answered}

    @property
    def finished(self) -> bool:
        return self.failure is not None or self.outcome is not None

    def _id(self, peer: str) -> int:
        found = self._ids.get(peer)
        if found is None:
            raise UnknownParticipant(-1, f"peer {peer!r} is not in secure round {self.key}")
        return found

    def _check_open(self, what: str) -> None:
        if self.failure is not None:
            raise SecureRoundFailed(self.key, self.failure)
        if self.outcome is not None:
            raise OutOfPhase("server", "done", what)

    def setup(self, peer: str) -> tuple[int, bytes]:
        """The peer's participant number and its ``Setup`` message (it joins the round).
        PeerDropped once the advertise phase closed without it."""
        with self._lock:
            self._check_open("setup")
            i = self._id(peer)
            if len(self._outboxes) > 1 and i not in self._outboxes[1]:
                raise PeerDropped(peer, PHASES[1])
            self.joined.add(peer)
            return i, self._outboxes[0][i]

    def post(self, peer: str, message: Message) -> None:
        """Take ``peer``'s message for the current phase (typed refusals leave the session
        as it was: OutOfPhase, ReplayedMessage, ForeignRound, UnknownParticipant, ...)."""
        with self._lock:
            self._check_open(type(message).__name__)
            i = self._id(peer)
            sender = getattr(message, "sender", None)
            if sender != i:
                raise UnknownParticipant(
                    -1 if not isinstance(sender, int) else sender,
                    f"peer {peer!r} is participant {i}: it speaks for no one else",
                )
            self.server.receive(message)
            self._answered.add(i)
            # an accused peer is dropped whatever it sends: the phase need not wait for it
            waiting = self._expected - self._answered - set(self.server.implicated)
            closed = not waiting and self._close()
        if closed:
            self._changed()

    def message_for(self, peer: str, after: int) -> bytes | None:
        """The peer's ``after``-th server message (encoded), None while its phase is open.
        SecureRoundFailed once the session failed; PeerDropped if the peer was left out.
        Takes no lock (the outboxes only grow), so an event loop may call it while another
        thread closes a phase."""
        failure = self.failure
        if failure is not None:
            raise SecureRoundFailed(self.key, failure)
        i = self._id(peer)
        if not 0 <= after <= len(PHASES) - 2:
            raise OutOfPhase("server", self.phase, f"server message {after}")
        outboxes = self._outboxes
        if after < len(outboxes):
            box = outboxes[after]
            if i not in box:
                raise PeerDropped(peer, PHASES[after])
            return box[i]
        return None

    def close_due(self, now: float) -> bool:
        """Close the current phase if its deadline passed; whether it did."""
        with self._lock:
            due = not self.finished and self.deadline is not None and self.deadline <= now
            closed = due and self._close()
        if closed:
            self._changed()
        return closed

    def fail(self, reason: str) -> bool:
        """Fail the session from outside (its round failed, the coordinator stops)."""
        with self._lock:
            if self.finished:
                return False
            self._fail(reason)
        self._changed()
        return True

    def _fail(self, reason: str) -> None:
        log.warning("secure round %s failed in phase %s: %s", self.key, self.phase, reason)
        self.failure = reason
        self.deadline = None

    def _close(self) -> bool:
        """Close the phase collecting now (the caller holds the lock); True: it changed."""
        server = self.server
        if server.phase is ServerPhase.MASK and server.usable_inputs() < self._quorum:
            self._fail(
                f"{server.usable_inputs()} of {len(self.names)} peers sent a usable masked "
                f"input (quorum {self._quorum}){self._blame(server.implicated)}"
            )
            return True
        try:
            out = server.close_phase()
        except SecAggError as exc:
            blame = "" if isinstance(exc, BelowSurvivorFloor) else self._blame(server.implicated)
            self._fail(f"{type(exc).__name__}: {exc}{blame}")
            return True
        if server.phase is ServerPhase.DONE:
            result = server.result
            assert result is not None  # DONE comes with a result
            self.outcome = SecAggOutcome(
                tuple(self.names[p] for p in result.survivors),
                tuple(self.names[p] for p in result.dropped),
                result.mean,
                result.weight_sum,
                {
                    self.names[p]: tuple(self.names[a] for a in by)
                    for p, by in result.implicated.items()
                },
            )
            self.deadline = None
            return True
        self._outboxes.append({p: encode(m) for p, m in out.items()})
        self._expected, self._answered = set(out), set()
        self.deadline = self._clock.now() + self._phase_timeout
        if server.phase is ServerPhase.MASK:
            # peers train in this phase (they ran the key phases as they took their tasks):
            # it lasts until the round's deadline at least, and with none it waits for every
            # peer, as the first phase does
            first = self._round_deadline
            self.deadline = None if first is None else max(self.deadline, first)
        return True

    def _blame(self, implicated: dict[int, tuple[int, ...]]) -> str:
        return "".join(
            f"; {self.names[p]!r} dropped: {[self.names[a] for a in by]} could not open its shares"
            for p, by in implicated.items()
        )

    def _changed(self) -> None:
        if self._on_change is not None:
            try:
                self._on_change(self)
            except Exception:
                log.exception("secure round %s: change listener failed", self.key)


class SecAggSessions:
    """The sessions of one coordinator by key, with a timer thread (``DeadlineTimer`` on the
    coordinator's clock) closing each phase at its deadline even when no peer is asking."""

    def __init__(self, clock: Clock, *, run_timer: bool = True) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._sessions: dict[str, SecAggSession] = {}
        self._timer: DeadlineTimer | None = None
        if run_timer:
            self._timer = DeadlineTimer(
                clock, self._next_due, self.check_deadlines, name="tensorswap-secagg"
            )
            subscribe = getattr(clock, "subscribe", None)
            if callable(subscribe):
                subscribe(self._timer.poke)
            self._timer.start()

    def add(self, session: SecAggSession) -> None:
        with self._lock:
            old = self._sessions.get(session.key)
            self._sessions[session.key] = session
        if old is not None:
            old._on_change = None  # its round is the new session's: only it may end the round
            old.fail("replaced by a new session for the same round")
        self.poke()

    def get(self, key: str) -> SecAggSession | None:
        with self._lock:
            return self._sessions.get(key)

    def pop(self, key: str) -> SecAggSession | None:
        with self._lock:
            return self._sessions.pop(key, None)

    def poke(self) -> None:
        """Re-read the deadlines (a phase opened)."""
        if self._timer is not None:
            self._timer.poke()

    def check_deadlines(self) -> int:
        """Close every phase whose deadline passed; how many closed."""
        with self._lock:
            sessions = list(self._sessions.values())
        now = self.clock.now()
        return sum(s.close_due(now) for s in sessions)

    def _next_due(self) -> float | None:
        with self._lock:
            due = [s.deadline for s in self._sessions.values() if s.deadline is not None]
        return min(due, default=None)

    def close(self) -> None:
        """Stop the timer and fail every unfinished session (their state is memory only)."""
        if self._timer is not None:
            unsubscribe = getattr(self.clock, "unsubscribe", None)
            if callable(unsubscribe):
                unsubscribe(self._timer.poke)
            self._timer.stop()
        with self._lock:
            sessions = list(self._sessions.values())
            self._sessions.clear()
        for session in sessions:
            session.fail("the coordinator stopped")

    def all(self) -> list[SecAggSession]:
        """The sessions held now (a copy)."""
        with self._lock:
            return list(self._sessions.values())
