"""SwarmSchedule: one fetch's chunks spread over several sources, each block checked on arrival."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from tensorswap.cid import Cid
from tensorswap.errors import TensorSwapError
from tensorswap.store.base import BlockStore

__all__ = ["ChunkSource", "HaveNews", "SourceReport", "SwarmSchedule"]

log = logging.getLogger("tensorswap.swarm")


@dataclass(frozen=True, slots=True)
class HaveNews:
    """A peer's answer to a have query: chunks held beyond those told (``version`` told in
    all), and every chunk it is fetching from the coordinator now (``claims_version``)."""

    version: int
    chunks: list[Cid]
    claimed: frozenset[Cid] = frozenset()
    claims_version: int = 0


class ChunkSource(Protocol):
    """Where chunks come from: the coordinator (``complete``: holds them all) or a peer."""

    name: str
    complete: bool

    async def have(self, since: int, claims_seen: int, wait: float) -> HaveNews | None:
        """What the source holds beyond the first ``since`` chunks told, and its claims,
        waiting up to ``wait`` s for news; None if the source does not serve the root."""
        ...

    async def get(self, cids: list[Cid], into: BlockStore) -> list[Cid]:
        """Fetch ``cids`` into ``into`` (each CID-checked before it is stored); the ones the
        source lacks. Raises on a broken connection or a block that fails its check."""
        ...

    async def aclose(self) -> None: ...


@dataclass(slots=True)
class SourceReport:
    """What one source delivered in one fetch, and why it was dropped (if it was)."""

    name: str
    blocks: int = 0
    nbytes: int = 0
    failed: str | None = None
    lacked: int = 0


@dataclass(slots=True, eq=False)  # identity: `in` over lists of states
class _State:
    source: ChunkSource
    report: SourceReport
    known: set[Cid] = field(default_factory=set)
    claimed: frozenset[Cid] = frozenset()
    since: int = 0
    claims_seen: int = 0
    flying: frozenset[Cid] = frozenset()  # this source's Get in flight
    busy_since: float | None = None


class SwarmSchedule:
    """Fetch ``chunks`` into ``store`` from several sources at once.

    Each source has one worker with at most ``batch`` chunks in flight (one Get; the
    coordinator ``coordinator_batch``: what it has in flight for one fetcher is what the
    others may ask it for too, before they learn of the claim). A peer's
    worker takes the chunks it is known to hold (rarest among the peers first), learning
    what it holds by have queries that wait up to ``have_wait`` s for news. The complete
    source (the coordinator) takes only chunks no peer is known to hold or to be fetching
    from the coordinator (a peer's claims, told by its have answers; ``on_claim`` tells
    this fetcher's own): every chunk a peer can give is one less copy on the coordinator's
    link. Among equals, each fetcher
    takes chunks in an order of its own (shuffled by ``seed``): fetchers that start
    together, or that run out of chunks only they lack, rarely ask the coordinator for the
    same chunk at once (walking one order, two of them would collide chunk after chunk).

    A peer whose Get has run for ``straggler`` s is slow: its chunks in flight may be asked
    of one more source, and the coordinator may give chunks that only slow peers hold (a
    peer on a slow link, or one that stalls, costs the fetch that long, not its pace).

    A block is stored only after its CID check (the sources' ``get``); a chunk counts as
    fetched when the store holds it. A source that fails (connection lost, a corrupt block,
    a have answer it cannot back) is dropped and its chunks go back to the others; one that
    says it lacks a chunk it announced is just no longer asked for it. ``on_stored`` is
    called with each batch of chunks stored (the peer's seeder then serves them).
    """

    def __init__(
        self,
        chunks: Sequence[Cid],
        store: BlockStore,
        *,
        seed: int | str = 0,
        batch: int = 2,
        coordinator_batch: int = 1,
        have_wait: float = 0.25,
        on_stored: Callable[[list[Cid]], None] | None = None,
        on_claim: Callable[[list[Cid], bool], None] | None = None,
        patience: float = 30.0,
        claim_patience: float = 5.0,
        straggler: float = 2.0,
    ) -> None:
        if batch < 1 or coordinator_batch < 1:
            raise ValueError(f"batch must be at least 1, got {batch}, {coordinator_batch}")
        self.order = list(dict.fromkeys(chunks))
        random.Random(str(seed)).shuffle(self.order)
        self.store = store
        self.batch = batch
        self.coordinator_batch = coordinator_batch
        self.have_wait = have_wait
        self.on_stored = on_stored
        self.on_claim = on_claim
        self.patience = patience
        self.claim_patience = claim_patience
        self.straggler = straggler
        self._claimed_at: dict[Cid, float] = {}  # when a chunk's claims went from 0 to more
        self.needed: set[Cid] = set(store.missing(self.order))
        self.inflight: dict[Cid, int] = {}  # sources fetching it now (2: a straggler's twin)
        self.count: dict[Cid, int] = dict.fromkeys(self.order, 0)  # peers known to hold it
        self.claims: dict[Cid, int] = dict.fromkeys(self.order, 0)  # peers fetching it
        self.reports: list[SourceReport] = []
        self._states: list[_State] = []
        self._changed = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._running = False
        self._pending: list[ChunkSource] = []
        self._finished = False

    # ── running ──────────────────────────────────────────────────────────────
    async def run(self, sources: Sequence[ChunkSource]) -> list[SourceReport]:
        """Fetch until the store holds every chunk, or no source is left; the reports.

        The peers' first have queries are answered before any worker starts, so the
        coordinator is never asked for a chunk a known peer already holds. Once no complete
        source is left (the coordinator failed), the fetch ends when ``patience`` seconds
        pass without a chunk stored. Workers still running at the end (a have query
        waiting) are cancelled; sources are not closed.
        """
        states = [self._state(s) for s in [*sources, *self._pending]]
        self._pending.clear()
        self._running = True
        try:
            first = [self._first_have(st) for st in states if not st.source.complete]
            await asyncio.gather(*first)
            for state in states:
                if state.report.failed is None:
                    self._spawn(state)
            while self.needed and self._tasks:
                changed, before = self._changed, len(self.needed)
                if any(st.source.complete and st.report.failed is None for st in self._states):
                    await changed.wait()
                    continue
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.patience):
                        while len(self.needed) == before and self._tasks:
                            changed = self._changed
                            await changed.wait()
                if len(self.needed) == before:
                    break  # no coordinator, and the peers gave nothing for `patience` s
        finally:
            self._running = False
            self._finished = True
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
        return self.reports

    async def add(self, source: ChunkSource) -> None:
        """A source found while running (a peer that announced later); before ``run``, one
        more for it to start with; after it, nothing."""
        if self._finished or not self.needed:
            return
        if not self._running:
            self._pending.append(source)
            return
        state = self._state(source)
        await self._first_have(state)
        if state.report.failed is None and self._running:
            self._spawn(state)

    @property
    def lacking(self) -> list[Cid]:
        return [cid for cid in self.order if cid in self.needed]

    # ── workers ──────────────────────────────────────────────────────────────
    def _state(self, source: ChunkSource) -> _State:
        state = _State(source, SourceReport(source.name))
        self.reports.append(state.report)
        self._states.append(state)
        return state

    def _spawn(self, state: _State) -> None:
        task = asyncio.ensure_future(self._work(state))
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._signal()

    def _signal(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _first_have(self, state: _State) -> None:
        try:
            await self._learn(state, 0.0)
        except (TensorSwapError, OSError) as exc:
            self._drop(state, exc)

    async def _work(self, state: _State) -> None:
        try:
            while self.needed and state.report.failed is None:
                pick = self._pick(state)
                if pick:
                    await self._fetch(state, pick)
                elif state.source.complete:
                    changed = self._changed
                    # woken by news, when the oldest claim runs out of patience, or when a
                    # peer's Get turns into a straggler's
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(self._next_deadline()):
                            await changed.wait()
                elif not await self._learn(state, self.have_wait):
                    return
        except (TensorSwapError, OSError) as exc:
            self._drop(state, exc)

    def _pick(self, state: _State) -> list[Cid]:
        free = [c for c in self.order if c in self.needed and c not in self.inflight]
        if state.source.complete:
            count, expired = self.count, self._expired()
            unclaimed = [c for c in free if count[c] == 0 and (c in expired or not self.claims[c])]
            if not unclaimed:
                unclaimed = self._stranded(free) or self._twins(state)
            return unclaimed[: self.coordinator_batch]
        held = [c for c in free if c in state.known]
        held.sort(key=self.count.__getitem__)  # stable: rarest first, then this order
        return held[: self.batch] or self._twins(state)[:1]

    def _slow(self) -> list[_State]:
        """Peers whose Get in flight has run for ``straggler`` s or more."""
        late = asyncio.get_running_loop().time() - self.straggler
        return [
            st
            for st in self._states
            if not st.source.complete and st.busy_since is not None and st.busy_since <= late
        ]

    def _stranded(self, free: list[Cid]) -> list[Cid]:
        """Free chunks that only slow peers are known to hold (the coordinator may give them)."""
        slow = self._slow()
        if not slow:
            return []
        fast = [st for st in self._states if st not in slow and st.report.failed is None]
        peers = [st for st in fast if not st.source.complete]
        return [c for c in free if self.count[c] and not any(c in st.known for st in peers)]

    def _twins(self, state: _State) -> list[Cid]:
        """Chunks in flight at a slow peer only, that ``state``'s source can give too (the
        coordinator: only those no other peer, not slow, holds)."""
        slow = self._slow()
        fast = [
            st
            for st in self._states
            if st not in slow and not st.source.complete and st.report.failed is None
        ]
        return [
            c
            for st in slow
            for c in st.flying
            if self.inflight.get(c) == 1
            and c in self.needed
            and (
                c in state.known
                if not state.source.complete
                else not any(c in other.known for other in fast)
            )
        ]

    async def _learn(self, state: _State, wait: float) -> bool:
        """One have query; False if the source does not serve the root (it is dropped)."""
        if state.source.complete:
            return True
        news = await state.source.have(state.since, state.claims_seen, wait)
        if news is None:
            self._drop(state, None, "does not serve the root")
            return False
        state.since = news.version
        fresh = [c for c in news.chunks if c in self.count and c not in state.known]
        for cid in fresh:
            state.known.add(cid)
            self.count[cid] += 1
        changed = bool(fresh)
        if news.claims_version != state.claims_seen:
            self._claims(state, frozenset(c for c in news.claimed if c in self.claims))
            state.claims_seen = news.claims_version
            changed = True
        if changed:
            self._signal()
        return True

    def _claims(self, state: _State, claimed: frozenset[Cid]) -> None:
        now = asyncio.get_running_loop().time()
        for cid in state.claimed - claimed:
            self.claims[cid] -= 1
            if not self.claims[cid]:
                self._claimed_at.pop(cid, None)
        for cid in claimed - state.claimed:
            self.claims[cid] += 1
            self._claimed_at.setdefault(cid, now)
        state.claimed = claimed

    def _expired(self) -> set[Cid]:
        """Chunks claimed for longer than ``claim_patience``: a claimer whose coordinator
        fetch hangs, or a peer that claims what it never fetches, does not hold them back."""
        if not self._claimed_at:
            return set()
        old = asyncio.get_running_loop().time() - self.claim_patience
        return {cid for cid, since in self._claimed_at.items() if since <= old}

    def _next_deadline(self) -> float | None:
        """Seconds until the oldest claim expires or a peer's Get turns slow (None: neither)."""
        times = [t + self.claim_patience for t in self._claimed_at.values()]
        times += [
            st.busy_since + self.straggler
            for st in self._states
            if st.busy_since is not None and not st.source.complete
        ]
        if not times:
            return None
        return max(0.0, min(times) - asyncio.get_running_loop().time())

    async def _fetch(self, state: _State, pick: list[Cid]) -> None:
        for cid in pick:
            self.inflight[cid] = self.inflight.get(cid, 0) + 1
        state.flying, state.busy_since = frozenset(pick), asyncio.get_running_loop().time()
        if not state.source.complete:
            self._signal()  # a waiting coordinator worker re-arms its straggler deadline
        claim = self.on_claim if state.source.complete else None
        if claim is not None:
            claim(pick, True)
        failure: BaseException | None = None
        try:
            await state.source.get(pick, self.store)
        except (TensorSwapError, OSError) as exc:
            failure = exc
        finally:
            for cid in pick:
                left = self.inflight[cid] - 1
                if left:
                    self.inflight[cid] = left
                else:
                    del self.inflight[cid]
            state.flying, state.busy_since = frozenset(), None
            if claim is not None:
                claim(pick, False)
        absent = set(self.store.missing(pick))  # what the checks let through is held
        stored = [c for c in pick if c not in absent and c in self.needed]
        self.needed.difference_update(stored)
        state.report.blocks += len(stored)
        with contextlib.suppress(TensorSwapError):
            state.report.nbytes += sum(self.store.size_of(c) for c in stored)
        for cid in absent:
            if cid in state.known:
                state.known.discard(cid)
                self.count[cid] -= 1
        if absent and failure is None:
            state.report.lacked += len(absent)
        if stored and self.on_stored is not None:
            self.on_stored(stored)
        self._signal()
        if failure is not None:
            raise failure
        if absent and state.source.complete:
            self._drop(state, None, f"lacks {len(absent)} chunks, first {next(iter(absent))}")

    def _drop(self, state: _State, exc: BaseException | None, why: str = "") -> None:
        if state.report.failed is not None:
            return
        reason = why or f"{type(exc).__name__}: {exc}"
        state.report.failed = reason
        log.info("swarm source %s dropped: %s", state.source.name, reason)
        for cid in state.known:
            self.count[cid] -= 1
        state.known.clear()
        self._claims(state, frozenset())
        self._signal()
