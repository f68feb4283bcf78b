"""A reducer's part in a call, pipelined: each chunk of its slice is folded as soon as every
live participant's committed chunk of it is here, and pushed on to the others at once."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from tensorswap._alloc import empty
from tensorswap.cid import Cid
from tensorswap.collective._assemble import Assembly
from tensorswap.collective._call_relay import put_to_relay
from tensorswap.collective._compress import ChunkCodec
from tensorswap.collective.messages import (
    PEER_APP,
    CallView,
    CommitInfo,
    Fault,
    Member,
    Reduced,
    SliceSent,
    encode,
)
from tensorswap.errors import TensorSwapError
from tensorswap.store import MemoryStore

__all__ = ["CallRun", "SliceWork", "WatchedStore", "fold_chunks", "reduce_slice"]


class WatchedStore(MemoryStore):
    """A MemoryStore that calls ``on_put`` after each block it stores (from whichever thread
    stored it: a connection's sink thread, a fold's worker): how a reducer learns that a
    pushed chunk is here before the pusher's notice of the whole slice."""

    def __init__(self) -> None:
        super().__init__()
        self.on_put: Callable[[], None] | None = None

    def _store(self, cid: Cid, data: memoryview, adopt: bool) -> None:
        super()._store(cid, data, adopt)
        if self.on_put is not None:
            self.on_put()


def waker(loop: asyncio.AbstractEventLoop, wake: asyncio.Event) -> Callable[[], None]:
    """``wake.set`` made safe to call from any thread (``WatchedStore.on_put``)."""
    owner = threading.get_ident()

    def on_put() -> None:
        if threading.get_ident() == owner:
            wake.set()
        elif not loop.is_closed():
            loop.call_soon_threadsafe(wake.set)

    return on_put


class CallRun(Protocol):
    """What the pipelined reducer needs of a call in progress (``_call.CallRun``; a
    protocol, so that module and this one do not import each other)."""

    owner: Any  # the Collective
    number: int
    codec: ChunkCodec
    stats: Any  # its CallStats
    bounds: list[tuple[int, int]]
    works: dict[int, SliceWork]
    assembly: Assembly
    folded: list[Cid]
    accused: set[str]
    tasks: dict[tuple[Any, ...], asyncio.Task[None]]
    next_check: float | None

    def start_task(
        self, key: tuple[Any, ...], work: Callable[..., Coroutine[Any, Any, None]], *args: Any
    ) -> None: ...

    async def forget_later(self, key: tuple[Any, ...]) -> None: ...

    async def accuse(self, suspect: str, reason: str, kind: Fault = Fault.DEAD) -> None: ...

    def watch_pushes(self, view: CallView, j: int, chunks: range, live: list[str]) -> None: ...

    def push_patience(self, values: int) -> float: ...


@dataclass(slots=True, eq=False)
class SliceWork:
    """Slice ``j`` reduced over ``live`` (a new one when the live set changes): the chunks
    folded so far, whether a fold runs, and the pushes of the folded chunks to the others."""

    j: int
    chunks: range
    live: tuple[str, ...]
    folded: dict[int, Cid] = field(default_factory=dict)
    folding: bool = False
    stale: bool = False
    """Superseded (a drop changed the live set, or the call ended): its pushes stop."""
    finished: float = 0.0
    """When (on the call's clock) the last chunk was folded."""
    more: asyncio.Event = field(default_factory=asyncio.Event)
    pushes: list[asyncio.Task[None]] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.folded) == len(self.chunks)

    def ready(self, store: MemoryStore, commits: Mapping[str, CommitInfo]) -> list[int]:
        """The chunks not folded yet whose every live input is here (each hash-checked when
        it was stored, under the CID its sender committed to), in order."""
        return [
            k
            for k in self.chunks
            if k not in self.folded
            and all(store.has(Cid.parse(commits[p].chunks[k])) for p in self.live)
        ]

    def advance(self) -> None:
        """Wake every push waiting for a newly folded chunk (or for the end)."""
        event, self.more = self.more, asyncio.Event()
        event.set()

    def stop(self) -> None:
        self.stale = True
        self.advance()


def reduce_slice(run: CallRun, view: CallView, j: int, chunks: range) -> None:
    """As slice j's reducer: fold its chunks over the live participants as their inputs
    arrive, push each folded chunk on, publish the slice once all are folded (and pushed)."""
    owner = run.owner
    me = owner.peer
    live = [m.peer for m in view.participants if m.peer not in view.dropped]
    held = view.reduced.get(j)
    if held is not None and held.contributors == live and held.reducer == me:
        return
    run.watch_pushes(view, j, chunks, live)
    if any(p not in view.commits for p in live) or not _notices_match(run, view, j, chunks, live):
        return
    work = run.works.get(j)
    if work is None or work.live != tuple(live):
        if work is not None:
            work.stop()
        work = run.works[j] = SliceWork(j, chunks, tuple(live))
        members = {m.peer: m for m in view.participants}
        for peer in live:
            if peer != me and len(chunks) and not owner.relayed and not members[peer].relayed:
                key = ("push-reduced", j, work.live, peer)
                run.start_task(key, push_reduced, run, work, members[peer])
                work.pushes.append(run.tasks[key])
    if not work.folding and (ready := work.ready(owner.store, view.commits)):
        work.folding = True
        run.start_task(("fold", j, work.live, ready[0]), _fold, run, view, work, ready)
    if work.done and _pushed_or_due(run, work):
        run.start_task(("publish", j, work.live), _publish, run, work)


def _pushed_or_due(run: CallRun, work: SliceWork) -> bool:
    """Whether ``work``'s slice may be published: every push of it ended, or they have
    had the no-progress rule's patience for the slice since the last fold (on the call's
    clock; until then the call wakes when it runs out). A member that takes the pushes
    slowly then fetches what it lacks after the seal, and does not hold the seal up."""
    if all(t.done() for t in work.pushes):
        return True
    values = sum(run.bounds[k][1] - run.bounds[k][0] for k in work.chunks)
    due = work.finished + run.push_patience(values)
    if run.owner.clock() >= due:
        return True
    run.next_check = due if run.next_check is None else min(run.next_check, due)
    return False


def _notices_match(run: CallRun, view: CallView, j: int, chunks: range, live: list[str]) -> bool:
    """Whether every notice of a push of slice j that came names the chunks its sender
    committed to, all here; accuses (of a mismatch) a sender whose notice does not."""
    owner = run.owner
    for peer in live:
        sent = owner.received.get((run.number, peer, j))
        if peer == owner.peer or not len(chunks) or sent is None:
            continue
        committed = [view.commits[peer].chunks[k] for k in chunks]
        missing = [raw for raw in committed if not owner.store.has(Cid.parse(raw))]
        if sent != committed or missing:
            if peer not in run.accused:
                run.accused.add(peer)
                why = "sent other chunks than it committed to" if sent != committed else ""
                detail = why or f"named {len(missing)} committed chunks it never sent"
                run.start_task(("accuse", peer), run.accuse, peer, detail, Fault.MISMATCH)
            return False
    return True


async def _fold(run: CallRun, view: CallView, work: SliceWork, ks: list[int]) -> None:
    """Fold chunks ``ks`` of ``work``'s slice off the loop; the drive loop wakes after."""
    owner = run.owner
    assembly = run.assembly

    def fold_and_place() -> list[Cid]:
        cids = fold_chunks(owner.store, run.codec, run.bounds, view.commits, work.live, ks)
        # into the result too, while the sums are in the cache (a stale live set's are
        # copied again at the seal: the result takes only published CIDs)
        assembly.place(list(zip(ks, cids, strict=True)))
        return cids

    try:
        cids = await asyncio.to_thread(fold_and_place)
    finally:
        work.folding = False
    run.folded.extend(cids)
    if not work.stale:
        work.folded.update(zip(ks, cids, strict=True))
        if work.done:
            work.finished = owner.clock()
        work.advance()


def fold_chunks(
    store: MemoryStore,
    codec: ChunkCodec,
    bounds: Sequence[tuple[int, int]],
    commits: Mapping[str, CommitInfo],
    live: Sequence[str],
    ks: Sequence[int],
) -> list[Cid]:
    """sum(w_i x_i) / sum(w_i) over ``live`` in their order, float32, for each chunk of
    ``ks``: the same operations in the same order whatever chunks are folded together, so
    the bits do not depend on how the inputs' arrival split the fold.

    Each sum is pooled memory (the store adopts it); one scratch chunk serves them all."""
    weights = [np.float32(commits[p].weight) for p in live]
    total = np.float32(sum(float(w) for w in weights))
    out = []
    scratch = empty(max((bounds[k][1] - bounds[k][0] for k in ks), default=0), np.float32)
    for k in ks:
        start, stop = bounds[k]
        acc = empty(stop - start, np.float32)
        tmp = scratch[: stop - start]
        for i, (peer, w) in enumerate(zip(live, weights, strict=True)):
            data = store.get(Cid.parse(commits[peer].chunks[k]))
            x = codec.decode(data, stop - start)
            np.multiply(x, w, out=acc if i == 0 else tmp)
            if i:
                np.add(acc, tmp, out=acc)
        np.divide(acc, total, out=acc)
        out.append(store.put(codec.encode(acc).data, adopt=True))
    return out


async def push_reduced(run: CallRun, work: SliceWork, member: Member) -> None:
    """Push ``work``'s folded chunks to ``member`` as they come, in order, then say which
    they are (a notice answered once they are stored there). Stops when ``work`` is stale
    (the notice then names the chunks pushed so far, for the member to forget them).
    A failed push accuses ``member`` of being dead (its probe decides) and ends: it fetches
    what it lacks once the call is sealed, as a member pushed nothing does."""
    owner = run.owner
    sent = 0
    try:
        client = await owner.client_of(member)
        while not work.stale and sent < len(work.chunks):
            ready = []
            for k in work.chunks[sent:]:
                if k not in work.folded:
                    break
                ready.append(work.folded[k])
            if not ready:
                await work.more.wait()
                continue
            await client.put_blocks(owner.store, ready)
            sent += len(ready)
        if not sent:
            return
        # all of them, or (stale) those pushed so far: the member deletes them with the call
        cids = [work.folded[k].to_bytes() for k in work.chunks[:sent]]
        note = SliceSent(owner.group, run.number, owner.peer, work.j, cids, reduced=True)
        await client.request(PEER_APP, encode(note))
    except (TensorSwapError, OSError) as exc:
        await owner.forget_client(member.peer)
        await run.accuse(member.peer, f"push of reduced slice {work.j} failed: {exc}")


async def _publish(run: CallRun, work: SliceWork) -> None:
    """Publish ``work``'s slice (through the relay first when this peer is relayed)."""
    owner = run.owner
    cids = [work.folded[k] for k in work.chunks]
    if owner.relayed and not await put_to_relay(run, work.j, cids, reduced=True):
        await run.forget_later(("publish", work.j, work.live))
        return
    contributors = list(work.live)
    message = Reduced(
        owner.group, run.number, owner.peer, work.j, contributors, [c.to_bytes() for c in cids]
    )
    answer = await owner.ask(message)
    if answer.view is not None:
        owner.note_view(answer.view)
