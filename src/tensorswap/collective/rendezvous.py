"""Rendezvous: the ``"collective"`` app on a serve port (membership, commitments, liveness)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from tensorswap.collective._layout import slice_range
from tensorswap.collective._progress import STALL_FACTOR, STALL_FLOOR
from tensorswap.collective._relay import Relay, RelayRefused
from tensorswap.collective._state import (
    CallState,
    GroupState,
    PeerState,
    commit_due,
    publish_due,
)
from tensorswap.collective.errors import BadCollectiveMessage
from tensorswap.collective.messages import (
    APP,
    MAX_MEMBERS,
    Accuse,
    Answer,
    CallView,
    Commit,
    CommitInfo,
    Delivered,
    Done,
    Fault,
    Join,
    JoinAnswer,
    Member,
    Poll,
    Reduced,
    ReducedInfo,
    RelayPut,
    decode_call,
    encode,
)
from tensorswap.store import MemoryStore
from tensorswap.wire import AppRequest, BlockServer, TransportError, connect_tcp

__all__ = ["PROBE_AFTER", "Rendezvous"]

logger = logging.getLogger("tensorswap.collective")

PROBE_AFTER = 0.5
"""A participant not heard from for this long (beyond its own longest gap so far) has its
listening port probed: a refused or unreachable port drops it at once."""
SILENT_AFTER = 10.0
"""A participant not heard from for this long, and for 8 times its longest gap so far, is
dropped even when its port still accepts connections (a stopped process)."""


class Rendezvous:
    """Membership, commitments and liveness for collective groups; tensor bytes only as
    the relay of members that open no port.

    Answers the ``"collective"`` app on a BlockServer (``attach``): ``join`` (the group is
    formed once ``size`` peers joined; later joiners take part from the next call),
    ``commit`` (a peer's weight, layout digest and chunk CIDs for a call: the call opens at
    the first commit, with the roster of that moment), ``poll`` (the call's view once it
    changes; also the peer's sign of life), ``reduced`` (a reducer's slice, accepted only
    from the slice's current reducer over the current live participants), ``accuse`` (a
    peer that looks dead is probed; one that broke its commitment is excluded; one that
    committed but whose push stalled is dropped), ``done`` (result roots compared) and
    ``relay`` (a block for, or from, a relayed member: ``Relay``, held in the attached
    server's store until the call ends). Bounded: ``max_groups`` groups (the longest
    inactive one is forgotten), MAX_MEMBERS peers per group, a few calls per group, the
    relay's bytes.
    """

    def __init__(
        self, *, max_groups: int = 1024, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_groups = max_groups
        self.clock = clock
        self.groups: dict[str, GroupState] = {}
        self._changed: dict[str, asyncio.Event] = {}
        self._probes: dict[tuple[str, str], asyncio.Task[None]] = {}
        self.requests = 0
        self.drops = 0
        self.relay = Relay(MemoryStore())
        """Blocks for relayed members, in the attached server's store (``attach``)."""
        self.server: BlockServer | None = None

    def attach(self, server: BlockServer) -> Rendezvous:
        """Answer the ``"collective"`` app on ``server`` (a RoundServer's ``blocks``), whose
        store also holds the relay's blocks (fetched from it with a Get)."""
        server.handlers[APP] = self.handle
        self.server = server
        self.relay = Relay(server.store, self.relay.max_bytes)
        return self

    async def aclose(self) -> None:
        for task in list(self._probes.values()):
            task.cancel()
        for task in list(self._probes.values()):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for _ in range(2):  # a cancelled probe's transport closes on the loop's next turns
            await asyncio.sleep(0)

    async def handle(self, request: AppRequest) -> bytes:
        """A request's reply body (refusals inside it; BadCollectiveMessage if undecodable)."""
        call = decode_call(request.body, request.peer)
        self.requests += 1
        if isinstance(call, Join):
            return encode(await self._join(call, request.peer))
        group = self.groups.get(call.group)
        if group is None:
            return encode(Answer(error=f"no group {call.group!r}"))
        group.active = self.clock()
        self._seen(group, call.peer, request.peer)
        if isinstance(call, Poll):
            return encode(await self._poll(group, call))
        now = self.clock()
        state = group.open_call(call.call, now) if isinstance(call, Commit) else None
        state = state or group.calls.get(call.call)
        self.relay.release_gone(group.name, set(group.calls))
        if state is None:
            return encode(Answer(error=f"call {call.call} is not open"))
        if isinstance(call, RelayPut):
            return encode(Answer(error=await self._relay_put(group, state, call)))
        fresh = isinstance(call, Commit) and call.peer not in state.commits
        error = self._apply(group, state, call)
        if fresh and error is None:  # the lag between commits, for the commit rule
            state.lag = max(state.lag or 0.0, now - state.opened)
            state.committed[call.peer] = now
        self.relay.release_if_done(state, group.name)
        self._bump(group)
        return encode(Answer(error=error, view=state.view()))

    async def _relay_put(self, group: GroupState, state: CallState, put: RelayPut) -> str | None:
        """Hold one block for a relayed member (``Relay``); a block its sender did not
        commit to, or that does not hash to its CID, drops the sender as a liar. Once the
        relay holds all of a sender's chunks of a slice, the view says so (``relayed``)."""
        relayed = {m.peer for m in state.participants if m.relayed}
        try:
            cid = self.relay.admit(state, relayed, put)
            await self.relay.put(put, cid)
        except RelayRefused as exc:
            if exc.liar and put.peer in state.live:
                if put.peer not in state.liars:
                    state.liars.append(put.peer)
                self._drop(group, put.peer, f"broke its commitment: relayed {exc}")
            return str(exc)
        info = state.commits[put.peer]
        if not put.reduced and put.slice not in state.relayed.get(put.peer, []):
            mine = slice_range(len(info.chunks), len(state.participants), put.slice)
            if self.relay.holds([info.chunks[k] for k in mine]):
                state.relayed.setdefault(put.peer, []).append(put.slice)
                state.version += 1
                self._bump(group)
        return None

    # ── the operations ──────────────────────────────────────────────────────
    async def _join(self, call: Join, address: str) -> JoinAnswer:
        group = self.groups.get(call.group)
        if group is None:
            self._make_room()
            group = self.groups[call.group] = GroupState(call.group, call.size)
        if group.size != call.size:
            return JoinAnswer(error=f"the group's size is {group.size}, not {call.size}")
        if call.peer not in group.roster and len(group.roster) >= MAX_MEMBERS:
            return JoinAnswer(error=f"the group has {MAX_MEMBERS} members")
        member = Member(call.peer, call.host or _host_of(address), call.port, call.relayed)
        group.roster[call.peer] = PeerState(member, self.clock())
        group.active = self.clock()
        if len(group.roster) >= group.size and not group.formed:
            group.formed = True
            self._bump(group)
        changed = self._changed.setdefault(group.name, asyncio.Event())
        if not group.formed and call.wait > 0:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(call.wait):
                    await changed.wait()
        if not group.formed or call.peer not in group.roster:
            return JoinAnswer(have=len(group.roster))
        members = [p.member for p in group.roster.values()]
        return JoinAnswer(True, members, group.next_call, len(members))

    async def _poll(self, group: GroupState, call: Poll) -> CallView:
        peer = group.roster.get(call.peer)
        if peer is not None:
            peer.polling += 1
        try:
            deadline = self.clock() + call.wait
            while True:
                self._check_liveness(group)
                view = self._view_of(group, call.call)
                left = deadline - self.clock()
                if view.version > call.version or left <= 0:
                    return view
                changed = self._changed.setdefault(group.name, asyncio.Event())
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(left, PROBE_AFTER / 2)):
                        await changed.wait()
        finally:
            if peer is not None:
                peer.polling -= 1
                peer.seen = self.clock()

    def _view_of(self, group: GroupState, number: int) -> CallView:
        state = group.calls.get(number)
        if state is not None:
            return state.view()
        error = None if number >= group.next_call else f"call {number} is forgotten"
        return CallView(call=number, version=0, participants=[], size=group.size, error=error)

    def _apply(self, group: GroupState, state: CallState, call: object) -> str | None:
        """Apply a commit / reduced / accuse / done to ``state``; a refusal's reason."""
        if isinstance(call, Commit):
            return _commit(state, call)
        if isinstance(call, Reduced):
            relayed = any(m.peer == call.peer and m.relayed for m in state.participants)
            if relayed and not self.relay.holds(call.chunks):
                return "the relay lacks the reduced chunks of a relayed reducer"
            return _reduced(state, call)
        if isinstance(call, Accuse):
            return self._accuse(group, state, call)
        if isinstance(call, Done):
            return _done(state, call)
        if isinstance(call, Delivered):
            return _delivered(state, call, self.clock())
        raise BadCollectiveMessage(f"unexpected {type(call).__name__}")

    def _accuse(self, group: GroupState, state: CallState, call: Accuse) -> str | None:
        """A live participant's accusation: a mismatch or a stall is believed (the suspect
        of a stall must have committed), a death is checked by a probe."""
        if call.peer not in state.live:
            return f"{call.peer!r} is not a live participant of call {state.number}"
        if call.kind is Fault.MISMATCH:
            if call.suspect not in state.liars:
                state.liars.append(call.suspect)
            self._drop(group, call.suspect, f"broke its commitment: {call.reason}")
            return None
        if call.kind is Fault.STALLED:
            if call.suspect not in state.commits:
                return f"{call.suspect!r} has not committed to call {state.number}"
            self._drop(group, call.suspect, f"made no progress: {call.reason}")
            return None
        member = group.roster.get(call.suspect)
        if member is not None:
            self._probe(group, member.member, f"accused by {call.peer}: {call.reason}")
        return None

    # ── liveness ────────────────────────────────────────────────────────────
    def _seen(self, group: GroupState, name: str, address: str = "") -> None:
        peer = group.roster.get(name)
        if peer is not None:
            if peer.member.relayed and address and address not in peer.addresses:
                peer.addresses = [*peer.addresses[-3:], address]
            now = self.clock()
            if peer.polling == 0:
                peer.max_gap = max(peer.max_gap, now - peer.seen)
            peer.seen = now

    def _check_liveness(self, group: GroupState) -> None:
        now = self.clock()
        watched = {p for call in group.unsealed() for p in call.live}
        for name in watched:
            peer = group.roster.get(name)
            if peer is None:
                self._drop(group, name, "left the group")
                continue
            if peer.polling:
                continue
            gap = now - peer.seen
            if gap > max(SILENT_AFTER, 8 * peer.max_gap):
                self._drop(group, name, f"silent for {gap:.1f} s")
            elif gap > PROBE_AFTER + peer.max_gap:
                self._probe(group, peer.member, f"silent for {gap:.1f} s")
        self._check_commits(group, now)
        self._check_reducers(group, now)

    def _check_commits(self, group: GroupState, now: float) -> None:
        """Drop a live participant that polls but has not committed to a call the others
        committed to, once overdue against the lags measured here (``commit_due``)."""
        for call in group.unsealed():
            due = commit_due(call, group.pace)
            if due is None or now < due:
                continue
            for name in [p for p in call.live if p not in call.commits]:
                self._drop(
                    group,
                    name,
                    f"made no progress: no commit to call {call.number} "
                    f"{now - call.opened:.1f} s after the first (allowed: {STALL_FLOOR:g} s "
                    f"+ {STALL_FACTOR:g}x the longest lag between commits measured in the "
                    f"calls before, {group.pace or 0.0:.3f} s)",
                )

    def _check_reducers(self, group: GroupState, now: float) -> None:
        """Drop a reducer that took every live participant's push of its slice and has
        published nothing over them, once overdue (``publish_due``)."""
        for call in group.unsealed():
            for j in range(len(call.assign)):
                due = publish_due(call, j)
                if due is None or now < due:
                    continue
                got = call.delivered[(j, call.assign[j])].values()
                took = max(got) - call.opened
                self._drop(
                    group,
                    call.assign[j],
                    f"made no progress: took every push of slice {j} and published nothing "
                    f"{now - max(got):.1f} s after the last (allowed: {STALL_FLOOR:g} s + "
                    f"{STALL_FACTOR:g}x the {took:.3f} s the pushes took)",
                )

    def _probe(self, group: GroupState, member: Member, why: str) -> None:
        if member.relayed:  # no port to probe: are its connections to us still open?
            peer, server = group.roster.get(member.peer), self.server
            addresses = [] if peer is None else peer.addresses
            if server is not None and not any(server.serving(a) for a in addresses):
                self._drop(group, member.peer, f"{why}; its connections here are closed")
            return
        key = (group.name, member.peer)
        if key in self._probes:
            return
        task = asyncio.ensure_future(self._run_probe(group, member, why))
        self._probes[key] = task
        task.add_done_callback(lambda _: self._probes.pop(key, None))

    async def _run_probe(self, group: GroupState, member: Member, why: str) -> None:
        """Connect to ``member``'s listening port; a refusal or a timeout drops it."""
        try:
            transport = await connect_tcp(member.host, member.port, timeout=PROBE_AFTER * 2)
        except (TransportError, OSError) as exc:  # refused, unreachable, timed out
            self._drop(group, member.peer, f"{why}; its port does not answer ({exc})")
        else:
            transport.abort()

    def _drop(self, group: GroupState, name: str, reason: str) -> None:
        changed = False
        for state in group.unsealed():
            if state.drop(name, reason):
                state.changed = self.clock()
                changed = True
        if group.roster.pop(name, None) is not None or changed:
            self.drops += 1
            logger.info("group %s: dropped %s (%s)", group.name, name, reason)
            self._bump(group)

    def _bump(self, group: GroupState) -> None:
        """Wake every waiter on ``group``."""
        event = self._changed.pop(group.name, None)
        if event is not None:
            event.set()

    def _make_room(self) -> None:
        while len(self.groups) >= self.max_groups:
            oldest = min(self.groups.values(), key=lambda g: g.active)
            del self.groups[oldest.name]
            self.relay.release_gone(oldest.name, None)
            self._bump(oldest)


def _commit(state: CallState, call: Commit) -> str | None:
    if call.peer not in state.names:
        return f"{call.peer!r} is not a participant of call {state.number} (a later one?)"
    if call.peer in state.dropped:
        return f"{call.peer!r} was dropped from call {state.number}: {state.dropped[call.peer]}"
    held = state.commits.get(call.peer)
    info = CommitInfo(call.weight, call.layout, list(call.chunks))
    if held is not None:
        return None if held == info else f"{call.peer!r} committed differently before"
    for other, theirs in state.commits.items():
        if theirs.layout != info.layout or len(theirs.chunks) != len(info.chunks):
            return f"tensor names, shapes or sizes differ from {other!r}'s"
        break
    state.commits[call.peer] = info
    state.version += 1
    state.seal()
    return None


def _reduced(state: CallState, call: Reduced) -> str | None:
    if not call.slice < len(state.assign) or state.assign[call.slice] != call.peer:
        return f"stale: slice {call.slice} is not {call.peer!r}'s to reduce"
    if call.contributors != state.live or state.final is not None:
        return "stale: the live participants changed"
    state.reduced[call.slice] = ReducedInfo(call.peer, list(call.contributors), call.chunks)
    state.version += 1
    state.seal()
    return None


def _delivered(state: CallState, call: Delivered, now: float) -> str | None:
    live = state.live
    if call.peer not in live or call.reducer not in live or call.peer == call.reducer:
        return f"{call.peer!r} or {call.reducer!r} is not a live participant"
    if not call.slice < len(state.assign) or state.assign[call.slice] != call.reducer:
        return f"stale: slice {call.slice} is not {call.reducer!r}'s to reduce"
    state.delivered.setdefault((call.slice, call.reducer), {}).setdefault(call.peer, now)
    return None


def _done(state: CallState, call: Done) -> str | None:
    if state.final is None:
        return f"call {state.number} is not sealed"
    state.roots[call.peer] = call.root
    for other, root in state.roots.items():
        if root != call.root:
            return f"root mismatch with {other!r}"
    return None


def _host_of(peer: str) -> str:
    host = peer.rpartition(":")[0] or peer
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host
