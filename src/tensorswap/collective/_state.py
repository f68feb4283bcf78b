"""One group's state at the rendezvous: its roster and its calls (pure, no I/O)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tensorswap.collective._progress import STALL_FACTOR, STALL_FLOOR
from tensorswap.collective.messages import (
    CallView,
    CommitInfo,
    Member,
    ReducedInfo,
)

__all__ = ["CallState", "GroupState", "PeerState", "commit_due", "publish_due", "reducer_after"]

KEEP_CALLS = 4
"""Calls a group remembers (the open one and a few sealed ones, for late pollers)."""


@dataclass(slots=True)
class PeerState:
    member: Member
    seen: float
    polling: int = 0
    max_gap: float = 0.0
    addresses: list[str] = field(default_factory=list)
    """A relayed member's last client addresses (its connections to the rendezvous)."""


@dataclass(slots=True)
class CallState:
    """A call: participants fixed when it opens; commitments, drops, reduced slices."""

    number: int
    participants: list[Member]
    size: int
    opened: float = 0.0
    """When its first commit came (on the rendezvous's clock)."""
    lag: float | None = None
    """The longest a participant's commit came after the first (None before any)."""
    changed: float = 0.0
    """When its live participants last changed (a drop; its opening before any)."""
    delivered: dict[tuple[int, str], dict[str, float]] = field(default_factory=dict)
    """(slice, reducer) -> per sender, when it said that reducer had taken its push."""
    committed: dict[str, float] = field(default_factory=dict)
    """Per participant, when its commit came."""
    version: int = 1
    commits: dict[str, CommitInfo] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)
    liars: list[str] = field(default_factory=list)
    assign: list[str] = field(default_factory=list)
    reduced: dict[int, ReducedInfo] = field(default_factory=dict)
    final: list[str] | None = None
    roots: dict[str, bytes] = field(default_factory=dict)
    relayed: dict[str, list[int]] = field(default_factory=dict)
    """Per participant, the slices whose committed chunks the relay holds."""

    def __post_init__(self) -> None:
        self.assign = [m.peer for m in self.participants]
        self.changed = self.opened

    @property
    def names(self) -> list[str]:
        return [m.peer for m in self.participants]

    @property
    def live(self) -> list[str]:
        return [m.peer for m in self.participants if m.peer not in self.dropped]

    def view(self) -> CallView:
        return CallView(
            call=self.number,
            version=self.version,
            participants=list(self.participants),
            size=self.size,
            commits=dict(self.commits),
            dropped=dict(self.dropped),
            liars=list(self.liars),
            assign=list(self.assign),
            reduced=dict(self.reduced),
            final=None if self.final is None else list(self.final),
            roots=dict(self.roots),
            relayed={p: list(s) for p, s in self.relayed.items()},
        )

    def drop(self, peer: str, reason: str) -> bool:
        """Drop ``peer`` from this call (before it is sealed); whether anything changed.
        Its slices go to the next live participant; slices reduced over a set that still
        held it are forgotten (their reducers fold again without it)."""
        if self.final is not None or peer in self.dropped or peer not in self.names:
            return False
        self.dropped[peer] = reason
        live = self.live
        if live:
            self.assign = [
                a if a not in self.dropped else reducer_after(self.names, i, self.dropped)
                for i, a in enumerate(self.assign)
            ]
        self.reduced = {
            j: r
            for j, r in self.reduced.items()
            if r.contributors == live and r.reducer not in self.dropped
        }
        self.version += 1
        self.seal()
        return True

    def seal(self) -> None:
        """Seal the call once every slice is reduced over the live participants."""
        live = self.live
        if self.final is not None or not live:
            return
        if any(p not in self.commits for p in live):
            return
        slices = range(len(self.participants))
        if all(j in self.reduced and self.reduced[j].contributors == live for j in slices):
            self.final = live
            self.version += 1


def commit_due(call: CallState, pace: float | None) -> float | None:
    """When (on the rendezvous's clock) a live participant that has not committed to
    ``call`` is overdue: ``STALL_FLOOR + STALL_FACTOR x pace`` after the call opened (its
    first commit), ``pace`` being the longest lag measured in the group's earlier calls
    (``GroupState.pace``). None while nothing is measured (the group's first call): the
    rule never fires on a guess."""
    if pace is None or not call.commits:
        return None
    return call.opened + STALL_FLOOR + STALL_FACTOR * pace


def publish_due(call: CallState, j: int) -> float | None:
    """When (on the rendezvous's clock) slice ``j``'s reducer is overdue with its reduced
    slice: every other live participant said the reducer took its push (``Delivered``) and
    it published nothing over them since. ``STALL_FLOOR + STALL_FACTOR x D`` after the last
    of those (or after the last drop, if later), ``D`` being how long the pushes took from
    the call's opening: folding the slice and pushing it on moves as many bytes as they
    did; or after the reducer's own commit, if later. None while a push is not said to be
    in or the reducer has not committed, and for a relayed reducer (its inputs come
    through the relay)."""
    live = call.live
    reducer = call.assign[j]
    if reducer not in call.committed:
        return None
    held = call.reduced.get(j)
    if held is not None and held.contributors == live and held.reducer == reducer:
        return None
    if any(m.peer == reducer and m.relayed for m in call.participants):
        return None
    senders = [p for p in live if p != reducer]
    got = call.delivered.get((j, reducer), {})
    if not senders or any(p not in got for p in senders):
        return None
    last = max(got[p] for p in senders)
    since = max(last, call.changed, call.committed[reducer])
    return since + STALL_FLOOR + STALL_FACTOR * max(0.0, last - call.opened)


def reducer_after(names: list[str], index: int, dropped: dict[str, str]) -> str:
    """The first participant at or after ``index`` (in ring order) not dropped."""
    n = len(names)
    for step in range(n):
        candidate = names[(index + step) % n]
        if candidate not in dropped:
            return candidate
    return names[index]


@dataclass(slots=True)
class GroupState:
    """A group: its size, its roster (joined, not dropped) and its recent calls."""

    name: str
    size: int
    roster: dict[str, PeerState] = field(default_factory=dict)
    formed: bool = False
    next_call: int = 0
    calls: dict[int, CallState] = field(default_factory=dict)
    active: float = 0.0

    pace: float | None = None
    """The longest lag (``CallState.lag``) of the calls before the open one: how far apart
    the members' commits come when nobody stalls (None before any call)."""

    def open_call(self, number: int, now: float = 0.0) -> CallState | None:
        """Call ``number``, opened ``now`` with the roster when it is the next one."""
        call = self.calls.get(number)
        if call is not None or number != self.next_call or not self.formed:
            return call
        lags = [c.lag for c in self.calls.values() if c.lag is not None]
        if lags:
            self.pace = max(self.pace or 0.0, *lags)
        members = [p.member for p in self.roster.values()]
        call = self.calls[number] = CallState(number, members, self.size, now)
        self.next_call += 1
        for old in sorted(self.calls)[:-KEEP_CALLS]:
            del self.calls[old]
        return call

    def unsealed(self) -> list[CallState]:
        return [c for c in self.calls.values() if c.final is None]
