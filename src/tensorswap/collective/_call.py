"""One all-reduce call of a peer: commit, reduce-scatter, all-gather, result check."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from tensorswap._alloc import empty
from tensorswap.cid import Cid
from tensorswap.collective._assemble import Assembly
from tensorswap.collective._call_relay import put_to_relay, start_pulls
from tensorswap.collective._compress import Compression, codec_for
from tensorswap.collective._layout import chunk_bounds, fill, inputs_of, slice_range, unflatten
from tensorswap.collective._progress import STALL_FACTOR, STALL_FLOOR, Progress
from tensorswap.collective._reduce import SliceWork, WatchedStore, reduce_slice
from tensorswap.collective.errors import (
    CollectiveError,
    GroupMismatch,
    PeerExcluded,
    ResultMismatch,
    TooFewPeers,
)
from tensorswap.collective.messages import (
    PEER_APP,
    Accuse,
    CallView,
    Commit,
    Delivered,
    Done,
    Fault,
    Member,
    ReducedInfo,
    ResultRoot,
    SliceSent,
    encode,
)
from tensorswap.errors import TensorSwapError
from tensorswap.wire import BlockClient

__all__ = ["CallOwner", "CallRun", "CallStats", "Compression"]

_RETRY = 0.5
"""Seconds before a failed push or fetch is tried again (the rendezvous judges meanwhile)."""
_MAX_FETCH_ROUNDS = 40
"""Rounds of fetching a sealed call's reduced slices from every member before giving up."""


@dataclass(slots=True)
class CallStats:
    """What the last call cost this peer: bytes on the wire, seconds, compression error
    (the relative L2 norm of what the lossy codec left out of this peer's input)."""

    call: int = -1
    seconds: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    dropped: dict[str, str] = field(default_factory=dict)
    compression_error: float = 0.0


class CallOwner(Protocol):
    """What a call uses of its peer (``Collective``)."""

    group: str
    peer: str
    size: int
    relayed: bool
    quorum: int
    compression: Compression
    store: WatchedStore
    errors: dict[str, Any]
    received: dict[tuple[int, str, int], list[bytes]]
    pushed_in: dict[int, list[Cid]]
    arrivals: dict[tuple[int, str, int], float]
    rates: dict[str, float]
    forged: dict[str, str]
    wake: asyncio.Event
    tamper: Callable[[list[Cid]], list[Cid]] | None
    clock: Callable[[], float]

    def view(self, call: int) -> CallView | None: ...
    def note_view(self, view: CallView) -> None: ...
    async def ask(self, message: Any) -> Any: ...
    async def client_of(self, member: Member) -> BlockClient: ...
    async def forget_client(self, name: str) -> None: ...
    async def relay_client(self) -> BlockClient: ...
    async def forget_relay(self) -> None: ...


class CallRun:
    """A peer's part in call ``number``: driven by the rendezvous's views of the call (and
    woken by each block its store takes).

    Each view starts what it makes possible, once: pushes of this peer's chunks of slice j
    to slice j's reducer; as a reducer, the fold of each chunk of its slice once every live
    participant's committed chunk of it is here, the push of each folded chunk to the
    others and the slice's publication (``_reduce``); once the call is sealed, the fetch of
    every reduced chunk its reducer did not push here. As a reducer it accuses a peer whose
    blocks failed their CIDs (a mismatch) and one whose push is overdue (``Progress``)."""

    def __init__(
        self, owner: CallOwner, number: int, tensors: Mapping[str, Any], weight: float
    ) -> None:
        self.owner = owner
        self.number = number
        self.tensors = tensors
        self.weight = float(weight)
        self.codec = codec_for(owner.compression)
        self.stats: CallStats = CallStats(call=number)
        self.tasks: dict[tuple[Any, ...], asyncio.Task[None]] = {}
        self.mine: list[Cid] = []
        self.folded: list[Cid] = []
        self.works: dict[int, SliceWork] = {}
        """Per slice this peer reduces, its pipelined fold over the current live set."""
        self.gathered: set[int] = set()
        self.final: list[str] = []
        self.accused: set[str] = set()
        self.fetch_failures = 0
        self.progress = Progress(owner.clock, owner.rates)
        self.next_check: float | None = None
        """When (on ``owner.clock``) a push this peer waits for falls due, if one will."""

    def blocks(self) -> list[Cid]:
        """Every block this call put in the peer's store (for the next call to forget)."""
        view = self.owner.view(self.number)
        held = [*self.mine, *self.folded, *self.owner.pushed_in.get(self.number, [])]
        if view is not None:
            for info in view.commits.values():
                held.extend(Cid.parse(raw) for raw in info.chunks)
            for reduced in view.reduced.values():
                held.extend(Cid.parse(raw) for raw in reduced.chunks)
        return held

    # ── the call ────────────────────────────────────────────────────────────
    async def run(self) -> dict[str, Any]:
        start = time.perf_counter()
        owner = self.owner
        layout, arrays = inputs_of(self.tensors, owner.group)
        self.layout = layout
        self.bounds = chunk_bounds(layout.total, owner.size)
        self.assembly = Assembly(owner.store, self.codec, self.bounds, layout.total)
        self.mine = await asyncio.to_thread(self._put_inputs, arrays)
        commit = Commit(
            owner.group,
            self.number,
            owner.peer,
            self.weight,
            layout.digest(),
            [c.to_bytes() for c in self.mine],
        )
        answer = await owner.ask(commit)
        if answer.error is not None:
            if answer.view is not None and owner.peer in answer.view.dropped:
                raise PeerExcluded(owner.peer, self.number, answer.view.dropped[owner.peer])
            raise GroupMismatch(owner.group, answer.error)
        if owner.tamper is not None:  # a fault injected by a test: send other chunks
            self.mine = owner.tamper(self.mine)
        if answer.view is not None:
            owner.note_view(answer.view)
        try:
            view = await self._drive()
            for key, task in list(self.tasks.items()):
                if key[0] == "place":  # a copy in a worker thread: let it end, not cancel
                    await asyncio.wait([task])
            out = await asyncio.to_thread(self.assembly.finish, self._published(view))
        finally:
            for work in self.works.values():
                work.stop()
            await self._cancel_tasks()
        self.stats.bytes_received += sum(
            owner.store.size_of(c) for c in owner.pushed_in.get(self.number, [])
        )
        await self._check_root(view)
        self.stats.seconds = time.perf_counter() - start
        self.stats.dropped = dict(view.dropped)
        return unflatten(layout, out)

    def _put_inputs(self, arrays: list[np.ndarray]) -> list[Cid]:
        """Flatten, encode (with error feedback when lossy) and store this peer's chunks,
        one chunk at a time: each is hashed while its copy is still in the cache."""
        owner = self.owner
        key = f"{owner.compression}:{self.layout.digest().hex()}"
        lossy = owner.compression != "none"
        error = owner.errors.get(key) if lossy else None
        flat = empty(self.layout.total, np.float32)
        cids = []
        sent = empty(flat.size, np.float32) if lossy else flat
        for start, stop in self.bounds:
            fill(arrays, flat, start, stop)
            if error is not None:
                flat[start:stop] += error[start:stop]
            data = self.codec.encode(flat[start:stop])
            cid = owner.store.put(data.data, adopt=True)
            cids.append(cid)
            if lossy:
                sent[start:stop] = self.codec.decode(owner.store.get(cid), stop - start)
        if lossy:
            residual = np.subtract(flat, sent, out=sent)
            owner.errors[key] = residual
            norm = float(np.linalg.norm(flat))
            self.stats.compression_error = float(np.linalg.norm(residual)) / max(norm, 1e-30)
        return cids

    async def _drive(self) -> CallView:
        """Act on each new view until the call is sealed and every slice is here."""
        owner = self.owner
        while True:
            owner.wake.clear()
            self.next_check = None
            view = owner.view(self.number)
            if view is not None and view.version > 0:
                self._check_view(view)
                self._act(view)
                if view.final is not None and self._gathered_all(view):
                    return view
            for task in [t for t in self.tasks.values() if t.done() and not t.cancelled()]:
                if (exc := task.exception()) is not None:
                    raise exc
            await self._wait()

    async def _wait(self) -> None:
        """Until something wakes the call (a view, a notice, a task's end) or a push that
        this peer waits for falls due."""
        wake = self.owner.wake
        if self.next_check is None:
            await wake.wait()
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, self.next_check - self.owner.clock())):
                await wake.wait()

    def _check_view(self, view: CallView) -> None:
        me = self.owner.peer
        if view.error is not None:
            raise CollectiveError(f"call {self.number}: {view.error}")
        if me in view.dropped:
            raise PeerExcluded(me, self.number, view.dropped[me])
        if me not in [m.peer for m in view.participants]:
            raise PeerExcluded(me, self.number, "not a participant (joined after it opened)")
        live = [m.peer for m in view.participants if m.peer not in view.dropped]
        if len(live) < self.owner.quorum:
            raise TooFewPeers(self.number, len(live), self.owner.quorum, view.dropped)

    def _act(self, view: CallView) -> None:
        me = self.owner.peer
        members = {m.peer: m for m in view.participants}
        n = len(view.participants)
        self._accuse_forgers(view)
        for j, reducer in enumerate(view.assign):
            chunks = slice_range(len(self.bounds), n, j)
            if reducer != me and len(chunks) and (j, reducer) not in self.pushed:
                self.start_task(("push", j, reducer), self._push, j, chunks, members[reducer])
            if reducer == me:
                if self.owner.relayed:
                    start_pulls(self, view, j, chunks)
                reduce_slice(self, view, j, chunks)
        if view.final is not None:
            store = self.owner.store
            for j, info in view.reduced.items():
                if j in self.gathered:
                    continue
                if info.reducer == me or all(store.has(Cid.parse(c)) for c in info.chunks):
                    self.gathered.add(j)  # its reducer pushed it here as it was folded
                else:
                    self.start_task(("gather", j), self._gather, j, info, view.final, members)
        self._place_published(view)

    def _place_published(self, view: CallView) -> None:
        """Copy each published reduced slice that is here into the result now, off the
        loop, while the others are still in flight (``Assembly``; the seal's live set
        decides, at the end, which copies count)."""
        n, store = len(view.participants), self.owner.store
        for j, info in view.reduced.items():
            key = ("place", j, tuple(info.chunks))
            ks = slice_range(len(self.bounds), n, j)
            if key in self.tasks or len(info.chunks) != len(ks):
                continue
            pairs = list(zip(ks, map(Cid.parse, info.chunks), strict=True))
            if all(store.has(cid) for _, cid in pairs):
                lacking = self.assembly.lacking(pairs)
                if lacking:
                    self.start_task(key, asyncio.to_thread, self.assembly.place, lacking)

    def _accuse_forgers(self, view: CallView) -> None:
        """Accuse (of a mismatch) each live participant whose push this peer's server
        refused for a block that does not hash to its CID (``Collective.forged``)."""
        live = [m.peer for m in view.participants if m.peer not in view.dropped]
        for suspect, why in list(self.owner.forged.items()):
            del self.owner.forged[suspect]
            if suspect in live and suspect != self.owner.peer and suspect not in self.accused:
                self.accused.add(suspect)
                reason = f"pushed a block that does not hash to its CID ({why})"
                self.start_task(("accuse", suspect), self.accuse, suspect, reason, Fault.MISMATCH)

    @property
    def pushed(self) -> set[tuple[int, str]]:
        return {(k[1], k[2]) for k in self.tasks if k[0] == "push"}

    def start_task(
        self, key: tuple[Any, ...], work: Callable[..., Coroutine[Any, Any, None]], *args: Any
    ) -> None:
        if key in self.tasks:
            return
        task = asyncio.ensure_future(work(*args))
        task.add_done_callback(lambda _: self.owner.wake.set())
        self.tasks[key] = task

    async def _cancel_tasks(self) -> None:
        for task in self.tasks.values():
            task.cancel()
        for task in self.tasks.values():
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def forget_later(self, key: tuple[Any, ...]) -> None:
        """Let ``key``'s work (the caller) be started again after a pause (the view may
        change first); the caller ends right after."""
        await asyncio.sleep(_RETRY)
        self.tasks.pop(key, None)
        self.owner.wake.set()

    # ── reduce-scatter ──────────────────────────────────────────────────────
    async def _push(self, j: int, chunks: range, member: Member) -> None:
        """Send this peer's chunks of slice j to its reducer, then say what they are."""
        owner = self.owner
        cids = [self.mine[k] for k in chunks]
        if member.relayed:  # through the rendezvous, which tells the reducer (its view)
            start = owner.clock()
            if not await put_to_relay(self, j, cids, reduced=False):
                await self.forget_later(("push", j, member.peer))
                return
            values = sum(self.bounds[k][1] - self.bounds[k][0] for k in chunks)
            self.progress.pushed(values, owner.clock() - start)
            return
        try:
            start = owner.clock()
            client = await owner.client_of(member)
            sent = await client.put_blocks(owner.store, cids)
            # Added after the await: ``stats.bytes_sent += await ...`` would read the count
            # before it, and the pushes to the other reducers, running meanwhile, be lost.
            self.stats.bytes_sent += sent
            values = sum(self.bounds[k][1] - self.bounds[k][0] for k in chunks)
            self.progress.pushed(values, owner.clock() - start)
            note = SliceSent(owner.group, self.number, owner.peer, j, [c.to_bytes() for c in cids])
            await client.request(PEER_APP, encode(note))
            await self._delivered(j, member.peer)
        except (TensorSwapError, OSError) as exc:
            await owner.forget_client(member.peer)
            await self.accuse(member.peer, f"push of slice {j} failed: {exc}")
            await self.forget_later(("push", j, member.peer))

    async def _delivered(self, j: int, reducer: str) -> None:
        """Tell the rendezvous that ``reducer`` took this peer's push of slice j (the rule
        for a reducer that never publishes counts these)."""
        owner = self.owner
        with contextlib.suppress(TensorSwapError, OSError):
            answer = await owner.ask(Delivered(owner.group, self.number, owner.peer, j, reducer))
            if answer.view is not None:
                owner.note_view(answer.view)

    async def accuse(self, suspect: str, reason: str, kind: Fault = Fault.DEAD) -> None:
        owner = self.owner
        accusation = Accuse(owner.group, self.number, owner.peer, suspect, reason, kind)
        with contextlib.suppress(TensorSwapError, OSError):
            answer = await owner.ask(accusation)
            if answer.view is not None:
                owner.note_view(answer.view)

    def watch_pushes(self, view: CallView, j: int, chunks: range, live: list[str]) -> None:
        """Measure the pushes of slice j that are here; accuse (of a stall) a committed
        participant whose push is overdue, or note when the next one falls due."""
        owner = self.owner
        values = sum(self.bounds[k][1] - self.bounds[k][0] for k in chunks)
        if not values:
            return
        for peer in live:
            if peer == owner.peer or peer not in view.commits:
                continue
            key = (self.number, peer, j)
            if key in owner.received:
                self.progress.arrived(j, peer, values, owner.arrivals.get(key, owner.clock()))
                continue
            due = self.progress.due(j, peer, values)
            if due is None or peer in self.accused:
                continue
            if owner.clock() < due:
                self.next_check = due if self.next_check is None else min(self.next_check, due)
                continue
            self.accused.add(peer)
            reason = self.progress.explain(j, peer, values)
            self.start_task(("accuse", peer), self.accuse, peer, reason, Fault.STALLED)

    def push_patience(self, values: int) -> float:
        """Seconds a reducer waits for its pushes of a folded slice of ``values`` values
        before it publishes anyway: the no-progress rule's allowance at the slowest rate
        measured in this call (its floor while none is)."""
        rate = self.progress.slowest("")
        return STALL_FLOOR + (STALL_FACTOR * values / rate if rate else 0.0)

    # ── all-gather ──────────────────────────────────────────────────────────
    async def _gather(
        self, j: int, info: ReducedInfo, final: list[str], members: dict[str, Member]
    ) -> None:
        """Fetch reduced slice j from its reducer, else from any member that holds it."""
        owner = self.owner
        cids = [Cid.parse(raw) for raw in info.chunks]
        sources = [info.reducer, *(p for p in final if p not in (info.reducer, owner.peer))]
        for name in sources:
            lacking = [c for c in cids if not owner.store.has(c)]
            member = members[name]
            if not lacking:
                break
            if member.relayed and name != info.reducer:
                continue  # no port: its slices are at the relay, asked for as its reducer's
            try:
                relay = member.relayed
                client = await (owner.relay_client() if relay else owner.client_of(member))
                await client.get_blocks(lacking, into=owner.store)
            except (TensorSwapError, OSError):
                await (owner.forget_relay() if member.relayed else owner.forget_client(name))
                continue
            self.stats.bytes_received += sum(
                owner.store.size_of(c) for c in lacking if owner.store.has(c)
            )
        if all(owner.store.has(c) for c in cids):
            self.gathered.add(j)
            return
        self.fetch_failures += 1
        if self.fetch_failures > _MAX_FETCH_ROUNDS:
            raise CollectiveError(
                f"call {self.number}: reduced slice {j} (reducer {info.reducer!r}) could not "
                f"be fetched from any member after {_MAX_FETCH_ROUNDS} rounds"
            )
        await self.forget_later(("gather", j))

    def _gathered_all(self, view: CallView) -> bool:
        return all(j in self.gathered for j in range(len(view.participants)))

    def _published(self, view: CallView) -> list[tuple[int, Cid]]:
        """Every chunk of the result with the CID its reducer published for it."""
        n = len(view.participants)
        return [
            (k, Cid.parse(raw))
            for j in range(n)
            for k, raw in zip(
                slice_range(len(self.bounds), n, j), view.reduced[j].chunks, strict=True
            )
        ]

    async def _check_root(self, view: CallView) -> None:
        """Report the result root; a member that ended with another one is an error."""
        owner = self.owner
        assert view.final is not None
        self.final = list(view.final)
        chunks = [raw for j in range(len(view.participants)) for raw in view.reduced[j].chunks]
        root = Cid.of(encode_root(self.layout.digest(), self.final, chunks))
        answer = await owner.ask(Done(owner.group, self.number, owner.peer, root.to_bytes()))
        if answer.error is not None:
            theirs = answer.view.roots if answer.view is not None else {}
            other = next((p for p, r in theirs.items() if r != root.to_bytes()), "?")
            shown = str(Cid.parse(theirs[other])) if other in theirs else "?"
            raise ResultMismatch(self.number, str(root), shown, other)
        self.root = root


def encode_root(layout: bytes, final: list[str], chunks: list[bytes]) -> bytes:
    """The bytes a call's result root names: layout digest, contributors, reduced chunks."""
    return encode(ResultRoot(layout=layout, final=final, chunks=chunks))
