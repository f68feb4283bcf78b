"""SwarmPeer: a peer's side of swarm distribution (its seeder, and fetches from the swarm)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl as ssl_module
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Self

import numpy as np

from tensorswap.cid import Cid, Multicodec
from tensorswap.errors import TensorSwapError
from tensorswap.store import BlockStore, get_update, read_manifest
from tensorswap.swarm.errors import SwarmExhausted
from tensorswap.swarm.messages import (
    TRACKER_APP,
    Announce,
    Holder,
    HoldersQuery,
    Leave,
    decode_answer,
    encode,
)
from tensorswap.swarm.scheduler import ChunkSource, SourceReport, SwarmSchedule
from tensorswap.swarm.seeder import SwarmSeeder
from tensorswap.swarm.sources import BlockSource, dial_seeder
from tensorswap.wire import BlockClient, RemoteError, Timeouts, WireLimits

if TYPE_CHECKING:  # the rounds engine is not imported for a fetch (a Flower ClientApp's)
    from tensorswap.rounds import RoundClient
    from tensorswap.rounds.core import RoundId

__all__ = ["SwarmFetch", "SwarmPeer"]

log = logging.getLogger("tensorswap.swarm")


@dataclass(frozen=True, slots=True)
class SwarmFetch:
    """What one swarm fetch did: per source (``coordinator`` first) the chunks it gave."""

    root: Cid
    chunks: int
    sources: list[SourceReport]
    dial_failures: list[str]
    seconds: float

    @property
    def from_coordinator(self) -> int:
        """Chunk bytes the coordinator sent (manifests not counted)."""
        return self.sources[0].nbytes if self.sources else 0

    @property
    def from_peers(self) -> int:
        return sum(r.nbytes for r in self.sources[1:])


class SwarmPeer:
    """Fetch results from the coordinator and the peers that hold them; serve them on.

    ``serve`` (default True): a read-only seeder (``SwarmSeeder``) listens on ``listen``
    and every fetched root is announced to the coordinator's tracker as ``advertise``
    (``host:port``; default the listen host, or, when that is a wildcard, the address the
    coordinator sees) as soon as the fetch starts: chunks are served while the rest comes.
    ``serve=False`` is the opt-out: the peer fetches from others but is never listed.
    Peers authenticate to each other with ``key`` (the federation's), over TLS with
    ``client_ssl`` / ``server_ssl`` when set. Serving needs an address other peers can
    reach; behind NAT, a peer nobody can dial is simply not used.

    Holders are dialled in tasks of their own; those connected within ``dial_wait`` s are
    asked what they hold before the coordinator is asked for anything, the others join when
    they answer, and one that never does (dead, behind NAT) delays nothing.

    ``store`` holds fetched results (pass the RoundClient's, so a submit's blocks count).
    """

    def __init__(
        self,
        store: BlockStore,
        *,
        peer: str,
        key: bytes | None = None,
        serve: bool = True,
        listen: tuple[str, int] = ("127.0.0.1", 0),
        advertise: tuple[str, int] | None = None,
        server_ssl: ssl_module.SSLContext | None = None,
        client_ssl: ssl_module.SSLContext | None = None,
        batch: int = 2,
        coordinator_batch: int = 1,
        refresh: float = 0.1,
        have_wait: float = 0.25,
        dial_wait: float = 0.5,
        limits: WireLimits | None = None,
        timeouts: Timeouts | None = None,
    ) -> None:
        self.store = store
        self.peer = peer
        self.key = key
        self.listen = listen
        self.advertise = advertise
        self.server_ssl = server_ssl
        self.client_ssl = client_ssl
        self.batch = batch
        self.coordinator_batch = coordinator_batch
        self.refresh = refresh
        self.have_wait = have_wait
        self.dial_wait = dial_wait
        self.limits = limits
        self.timeouts = timeouts or Timeouts(connect=3.0)
        self.seeder = (
            SwarmSeeder(store, key=key, limits=limits, timeouts=timeouts) if serve else None
        )

    async def start(self) -> Self:
        if self.seeder is not None:
            await self.seeder.start(self.listen[0], self.listen[1], ssl=self.server_ssl)
        return self

    async def aclose(self) -> None:
        if self.seeder is not None:
            await self.seeder.aclose()

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # ── fetching ─────────────────────────────────────────────────────────────
    async def fetch_result(
        self, client: RoundClient, round_id: RoundId, timeout: float | None = None
    ) -> dict[str, np.ndarray]:
        """``client.fetch_result`` through the swarm: wait for the round, fetch its aggregate
        from the coordinator and the peers that hold it, return the named arrays. Into the
        client's own store (``SwarmPeer(client.store)``), the result counts among the round's
        blocks there, kept for the client's latest rounds only (``rounds.client.retention``).

        The client's later submits then neither announce (``client.cut``) nor ask for the
        result behind their answer (``push_results``): both would bring the whole result
        from the coordinator, which the swarm fetches from peers too; this round's stream
        stops (what it brought counts as held)."""
        client.cut.enabled = client.push_results = False
        await client.cut.cancel(round_id)
        cid = await client.result(round_id, timeout)
        retention = client.retention if self.store is client.store else None
        if retention is not None:
            retention.begin()
        await self.fetch(client.blocks, cid)
        update = await asyncio.to_thread(get_update, self.store, cid)
        if retention is not None:
            retention.hold_root(round_id, cid)
        return dict(update.tensors)

    async def fetch(self, coordinator: BlockClient, root: Cid) -> SwarmFetch:
        """Fetch the closure of ``root`` into the store; every block is CID-checked first.

        The manifests come from the coordinator; the chunks from it and from the holders
        its tracker lists (refreshed every ``refresh`` s while fetching), at most ``batch``
        per peer in flight (``coordinator_batch`` from the coordinator). A coordinator
        without a tracker (``unsupported``) makes this a plain pull, chunk by chunk.
        SwarmExhausted if chunks remain that no source delivered.
        """
        begun = time.perf_counter()
        chunks = await self._manifests(coordinator, root)
        manifests = [c for c in chunks if c.codec is Multicodec.TENSORSWAP_MANIFEST]
        chunks = [c for c in chunks if c.codec is not Multicodec.TENSORSWAP_MANIFEST]
        holders: list[Holder] | None = []
        if self.seeder is not None:
            self.seeder.holdings.serve(root, manifests)
            self.seeder.holdings.add(root, [c for c in chunks if self.store.has(c)])
        holders = await self._track(coordinator, root, announce=True)
        on_stored = on_claim = None
        if self.seeder is not None:
            holdings = self.seeder.holdings

            def on_stored(cids: list[Cid]) -> None:
                holdings.add(root, cids)

            def on_claim(cids: list[Cid], claimed: bool) -> None:
                holdings.claim(root, cids, claimed)

        schedule = SwarmSchedule(
            chunks,
            self.store,
            seed=f"{self.peer}/{root}",
            batch=self.batch,
            coordinator_batch=self.coordinator_batch,
            have_wait=self.have_wait,
            on_stored=on_stored,
            on_claim=on_claim,
        )
        coord = BlockSource(coordinator, root, "coordinator", complete=True, owned=False)
        dialer = _Dialer(self, root, schedule)
        dialer.dial(holders or [])
        await dialer.settle(self.dial_wait)  # those answering by then are asked before any
        done = asyncio.Event()
        refresher = None
        if holders is not None and self.refresh > 0:
            refresher = asyncio.ensure_future(self._refresh(coordinator, root, dialer, done))
        try:
            reports = await schedule.run([coord])
        finally:
            done.set()
            if refresher is not None:
                with contextlib.suppress(TensorSwapError, OSError):
                    await refresher
            await dialer.aclose()
        failures = dialer.failures
        if schedule.needed:
            lacking = schedule.lacking
            why = [f"{r.name}: {r.failed}" for r in reports if r.failed]
            raise SwarmExhausted(str(root), len(lacking), str(lacking[0]), why + failures)
        return SwarmFetch(root, len(chunks), reports, failures, time.perf_counter() - begun)

    async def leave(self, coordinator: BlockClient, root: Cid) -> None:
        """Stop serving ``root`` and tell the tracker."""
        if self.seeder is not None:
            self.seeder.holdings.forget(root)
        with contextlib.suppress(RemoteError):
            await coordinator.request(TRACKER_APP, encode(Leave(root.to_bytes(), self.peer)))

    async def _manifests(self, coordinator: BlockClient, root: Cid) -> list[Cid]:
        """The closure of ``root``, its manifests fetched (one Get per level)."""
        level, closure = [root], []
        while level:
            lacking = self.store.missing(level)
            if lacking:
                absent = await coordinator.get_blocks(lacking, self.store)
                if absent:
                    msg = f"coordinator lacks {len(absent)} manifests of {root}, first {absent[0]}"
                    raise RemoteError("not_found", msg, coordinator.conn.peer)
            closure += level
            below: list[Cid] = []
            for cid in level:
                if cid.codec is Multicodec.TENSORSWAP_MANIFEST:
                    below += read_manifest(self.store, cid).links()
            level = [c for c in dict.fromkeys(below) if c.codec is Multicodec.TENSORSWAP_MANIFEST]
            closure += [c for c in dict.fromkeys(below) if c not in level]
        return list(dict.fromkeys(closure))

    async def _track(
        self, coordinator: BlockClient, root: Cid, *, announce: bool
    ) -> list[Holder] | None:
        """Announce (when serving) or ask for holders; None if the coordinator has no tracker."""
        if announce and self.seeder is not None:
            host, port = self.advertise or (self.listen[0], self.seeder.port)
            if host in ("", "0.0.0.0", "::"):
                host = ""  # the tracker takes the address it sees
            call: Announce | HoldersQuery = Announce(root.to_bytes(), self.peer, host, port)
        else:
            call = HoldersQuery(root.to_bytes(), self.peer)
        try:
            body = await coordinator.request(TRACKER_APP, encode(call))
        except RemoteError as exc:
            if exc.code == "unsupported":
                return None
            raise
        answer = decode_answer(body, coordinator.conn.peer)
        if answer.error is not None:
            log.warning("the tracker refused %s: %s", type(call).__name__, answer.error)
        return answer.holders

    async def _refresh(
        self, coordinator: BlockClient, root: Cid, dialer: _Dialer, done: asyncio.Event
    ) -> None:
        """Every ``refresh`` s until ``done``: holders that announced since, as new sources."""
        while not done.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.refresh):
                    await done.wait()
            if done.is_set():
                return
            dialer.dial(await self._track(coordinator, root, announce=False) or [])


class _Dialer:
    """One fetch's dials to holders, each in a task of its own: a holder that is slow to
    answer (or never does, behind NAT) delays nobody; each that connects joins the schedule."""

    def __init__(self, owner: SwarmPeer, root: Cid, schedule: SwarmSchedule) -> None:
        self.owner, self.root, self.schedule = owner, root, schedule
        self.tried: set[str] = {owner.peer}
        self.failures: list[str] = []
        self.sources: list[ChunkSource] = []
        self.tasks: set[asyncio.Task[None]] = set()

    def dial(self, holders: list[Holder]) -> None:
        for holder in holders:
            if holder.peer not in self.tried:
                self.tried.add(holder.peer)
                task = asyncio.ensure_future(self._one(holder))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)

    async def settle(self, timeout: float) -> None:
        if self.tasks and timeout > 0:
            await asyncio.wait(set(self.tasks), timeout=timeout)

    async def _one(self, holder: Holder) -> None:
        owner = self.owner
        try:
            source = await dial_seeder(
                holder.host,
                holder.port,
                self.root,
                holder.peer,
                key=owner.key,
                ssl=owner.client_ssl,
                limits=owner.limits,
                timeouts=owner.timeouts,
            )
        except (TensorSwapError, OSError) as exc:
            self.failures.append(f"{holder.peer} at {holder.host}:{holder.port}: {exc}")
            return
        self.sources.append(source)  # closed by aclose, whatever happens next
        await self.schedule.add(source)

    async def aclose(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for source in self.sources:
            await source.aclose()
