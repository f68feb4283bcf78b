"""VirtualClients: many peers, each its own identity, over one or a few connections.

For simulations (thousands of clients in one process) and gateways (one process speaking
for the peers behind it). Each virtual peer keeps its own name, and, on a coordinator that
holds per-peer keys, proves its own key for each contribution (``rounds.protocol.batch``). Submits
made at the same time are coalesced: their blocks go in one offer / push, the submits in
one ``submit_batch`` request, journaled by the coordinator in one transaction. Each
``submit`` still returns only once its own contribution is durable on the coordinator, and
raises what the coordinator refused it for (the same RoundsError leaf as RoundClient).
"""

from __future__ import annotations

import asyncio
import itertools
import ssl as ssl_module
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Self

import msgspec

from tensorswap.cid import Cid
from tensorswap.rounds.client._updates import children_first, is_small
from tensorswap.rounds.client.client import RoundClient
from tensorswap.rounds.core.errors import UnknownUpdate
from tensorswap.rounds.core.state import RoundId, RoundStatus
from tensorswap.rounds.protocol.batch import (
    MAX_BATCH,
    BatchAnswer,
    BatchItem,
    BatchSubmitRequest,
    submit_proof,
)
from tensorswap.rounds.protocol.codec import APP, raise_remote
from tensorswap.store import BlockStore, MemoryStore, ModelUpdate, put_update
from tensorswap.wire import ProtocolViolation, Timeouts, WireLimits

__all__ = ["PeerSubmit", "VirtualClients", "VirtualPeer"]

Update = ModelUpdate | Mapping[str, Any] | Cid
_encoder = msgspec.msgpack.Encoder()
_batch_decoder = msgspec.msgpack.Decoder(BatchAnswer)


@dataclass(frozen=True, slots=True)
class PeerSubmit:
    """One virtual peer's contribution: its name, its update, the update's sample count."""

    peer: str
    update: Update
    num_samples: int = 0


class _Queued:
    __slots__ = ("cid", "future", "peer")

    def __init__(self, peer: str, cid: Cid, future: asyncio.Future[RoundStatus]) -> None:
        self.peer, self.cid, self.future = peer, cid, future


class VirtualClients:
    """Virtual peers over ``clients`` (RoundClients to one coordinator, sharing ``store``).

    ``keys`` maps peer names to their own keys: a peer with a key proves it on each of its
    contributions (required by a coordinator given per-peer keys). Batches go to the
    connections in turn; waits use the last connection, so with two or more a long wait
    never holds back submits. ``max_batch`` bounds the items one request carries. Every
    update put here stays in ``store`` (default: in memory) until the caller removes it.
    """

    def __init__(
        self,
        clients: Sequence[RoundClient],
        *,
        keys: Mapping[str, bytes] | None = None,
        max_batch: int = MAX_BATCH,
    ) -> None:
        if not clients:
            raise ValueError("VirtualClients needs at least one connection")
        if not 0 < max_batch <= MAX_BATCH:
            raise ValueError(f"max_batch must be 1 to {MAX_BATCH}, got {max_batch}")
        store = clients[0].store
        if any(c.store is not store for c in clients):
            raise ValueError("the connections of one VirtualClients must share one store")
        self.clients = list(clients)
        self.store: BlockStore = store
        self.keys = dict(keys or {})
        self.max_batch = max_batch
        submitters = self.clients[:-1] if len(self.clients) > 1 else self.clients
        self._turn = itertools.cycle(submitters)
        self._queued: dict[RoundId, list[_Queued]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    @classmethod
    async def connect(
        cls,
        host: str,
        port: int,
        *,
        connections: int = 1,
        name: str = "virtual-clients",
        key: bytes | None = None,
        keys: Mapping[str, bytes] | None = None,
        ssl: ssl_module.SSLContext | None = None,
        server_hostname: str | None = None,
        store: BlockStore | None = None,
        limits: WireLimits | None = None,
        timeouts: Timeouts | None = None,
        max_batch: int = MAX_BATCH,
    ) -> Self:
        """``connections`` authenticated connections (shared ``key``) sharing one store."""
        if connections < 1:
            raise ValueError(f"connections must be at least 1, got {connections}")
        shared = store if store is not None else MemoryStore()
        clients: list[RoundClient] = []
        try:
            for i in range(connections):
                clients.append(
                    await RoundClient.connect(
                        host,
                        port,
                        peer=f"{name}-{i}",
                        key=key,
                        ssl=ssl,
                        server_hostname=server_hostname,
                        store=shared,
                        limits=limits,
                        timeouts=timeouts,
                    )
                )
        except BaseException:
            for client in clients:
                await client.aclose()
            raise
        return cls(clients, keys=keys, max_batch=max_batch)

    async def aclose(self) -> None:
        """Cancel batches not yet sent and close every connection."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for client in self.clients:
            await client.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def client_for(self, peer: str, index: int = 0) -> RoundClient:
        """A RoundClient named ``peer`` over connection ``index`` (its lock, its store): for
        APIs built on one, e.g. ``RunClient(pool.client_for("site-7")).register(...)``. Its
        inline submits carry the proof of ``peer``'s key when the pool holds one; its plain
        ones carry none (refused by a coordinator with per-peer keys)."""
        base = self.clients[index]
        view = RoundClient(base.blocks, peer, base.store, peer_key=self.keys.get(peer))
        view.inline = base.inline
        view._lock = base._lock  # one request at a time on the shared connection
        return view

    def peer(self, name: str, key: bytes | None = None) -> VirtualPeer:
        """The virtual peer ``name`` (its ``key`` recorded when given)."""
        if not name:
            raise ValueError("peer must be a non-empty name")
        if key is not None:
            self.keys[name] = key
        return VirtualPeer(self, name)

    # ── submits ──────────────────────────────────────────────────────────────
    async def submit(
        self, round_id: RoundId, peer: str, update: Update, num_samples: int = 0
    ) -> RoundStatus:
        """Submit ``peer``'s update; coalesced with the submits made at the same time.

        Returns the round's status once this contribution is durable on the coordinator;
        raises what it was refused for.
        """
        item = [PeerSubmit(peer, update, num_samples)]
        if isinstance(update, Cid) or is_small(
            update
        ):  # hashing and encoding a tiny update costs less than a thread hop
            (cid,) = self._put(item)
        else:
            (cid,) = await asyncio.to_thread(self._put, item)
        future: asyncio.Future[RoundStatus] = asyncio.get_running_loop().create_future()
        queue = self._queued.setdefault(round_id, [])
        queue.append(_Queued(peer, cid, future))
        if len(queue) == 1:  # the first since the last flush: flush on the next loop turn
            task = asyncio.ensure_future(self._flush_soon(round_id))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return await future

    async def submit_many(
        self, round_id: RoundId, items: Sequence[PeerSubmit], *, batch: int | None = None
    ) -> list[RoundStatus | Exception]:
        """Submit every item (each for its own peer) in requests of ``batch`` items (default
        ``max_batch``), sent on the submit connections at once; per item the round's status
        once durable, or the error that refused it."""
        size = min(batch or self.max_batch, self.max_batch)
        sends: list[asyncio.Task[list[RoundStatus | Exception]]] = []
        try:
            for start in range(0, len(items), size):
                part = list(items[start : start + size])
                # the next part is encoded while the ones before it are on the wire
                cids = await asyncio.to_thread(self._put, part)
                pairs = [(item.peer, cid) for item, cid in zip(part, cids, strict=True)]
                sends.append(asyncio.ensure_future(self._send(next(self._turn), round_id, pairs)))
            sent = await asyncio.gather(*sends)
        except BaseException:
            for task in sends:
                task.cancel()
            await asyncio.gather(*sends, return_exceptions=True)
            raise
        return [outcome for part in sent for outcome in part]

    def _put(self, items: list[PeerSubmit]) -> list[Cid]:
        cids = []
        for item in items:
            update = item.update
            if isinstance(update, Cid):
                cids.append(update)
                continue
            if not isinstance(update, ModelUpdate):
                update = ModelUpdate(dict(update), item.num_samples)
            cids.append(put_update(self.store, update))
        return cids

    async def _flush_soon(self, round_id: RoundId) -> None:
        await asyncio.sleep(0)  # let the submits of this loop turn queue up
        while queue := self._queued.pop(round_id, None):
            for start in range(0, len(queue), self.max_batch):
                part = queue[start : start + self.max_batch]
                try:
                    results = await self._send(
                        next(self._turn), round_id, [(q.peer, q.cid) for q in part]
                    )
                except BaseException as exc:
                    for q in part:
                        if not q.future.done():
                            q.future.set_exception(exc)
                    if not isinstance(exc, Exception):
                        raise
                    continue
                for q, result in zip(part, results, strict=True):
                    if q.future.done():
                        continue
                    if isinstance(result, Exception):
                        q.future.set_exception(result)
                    else:
                        q.future.set_result(result)

    async def _send(
        self, client: RoundClient, round_id: RoundId, items: list[tuple[str, Cid]]
    ) -> list[RoundStatus | Exception]:
        """Push what the coordinator lacks of ``items``' updates and submit them in one
        request; items refused as UnknownUpdate (a block quarantined there) are pushed and
        submitted once more."""
        async with client._lock:
            results = await self._push_and_submit(client, round_id, items)
            again = [i for i, r in enumerate(results) if isinstance(r, UnknownUpdate)]
            if again:
                retried = await self._push_and_submit(client, round_id, [items[i] for i in again])
                for i, result in zip(again, retried, strict=True):
                    results[i] = result
        return results

    async def _push_and_submit(
        self, client: RoundClient, round_id: RoundId, items: list[tuple[str, Cid]]
    ) -> list[RoundStatus | Exception]:
        closure = await asyncio.to_thread(self._closure, [cid for _, cid in items])
        lacking = await client.blocks.missing(closure)
        if lacking:
            await client.blocks.put_blocks(self.store, lacking)
        request = BatchSubmitRequest(
            round=round_id.round,
            initiator=round_id.initiator,
            items=[
                BatchItem(peer, cid.to_bytes(), self._proof(round_id, peer, cid))
                for peer, cid in items
            ],
        )
        return await request_submit_batch(client, request)

    def _closure(self, cids: list[Cid]) -> list[Cid]:
        """Every block of ``cids``' updates, each once, chunks before their manifests."""
        seen: set[Cid] = set()
        order: list[Cid] = []
        for cid in cids:
            if cid not in seen:
                fresh = [c for c in children_first(self.store, cid) if c not in seen]
                seen.update(fresh)
                order.extend(fresh)
        return order

    def _proof(self, round_id: RoundId, peer: str, cid: Cid) -> bytes:
        key = self.keys.get(peer)
        return b"" if key is None else submit_proof(key, round_id, peer, cid)

    # ── waiting and reading (one connection) ─────────────────────────────────
    @property
    def reader(self) -> RoundClient:
        """The connection waits, status and fetches use (the last one)."""
        return self.clients[-1]

    async def wait(self, round_id: RoundId, timeout: float | None = None) -> RoundStatus:
        """``RoundClient.wait`` on the reader connection (one wait serves every peer)."""
        return await self.reader.wait(round_id, timeout)

    async def fetch_result(self, round_id: RoundId, timeout: float | None = None) -> dict[str, Any]:
        """``RoundClient.fetch_result`` on the reader connection."""
        return await self.reader.fetch_result(round_id, timeout)


class VirtualPeer:
    """One virtual peer of a VirtualClients: its own name (and key), a shared connection."""

    def __init__(self, pool: VirtualClients, name: str) -> None:
        self.pool = pool
        self.name = name

    async def submit(self, round_id: RoundId, update: Update, num_samples: int = 0) -> RoundStatus:
        """Submit this peer's update (coalesced with other peers' submits); its status."""
        return await self.pool.submit(round_id, self.name, update, num_samples)

    async def wait(self, round_id: RoundId, timeout: float | None = None) -> RoundStatus:
        return await self.pool.wait(round_id, timeout)

    def __repr__(self) -> str:
        return f"VirtualPeer({self.name!r})"


async def request_submit_batch(
    client: RoundClient, request: BatchSubmitRequest
) -> list[RoundStatus | Exception]:
    """Send ``request`` (its blocks pushed before) on ``client``'s connection; each item's
    status, or the typed error it alone was refused with, in order. A refusal of the whole
    request is raised, as is an answer that does not match the items (ProtocolViolation)."""
    body = await client.blocks.request(APP, _encoder.encode(request), timeout="read")
    try:
        answer = _batch_decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise ProtocolViolation(f"bad submit_batch answer: {exc}") from exc
    peer = client.blocks.conn.peer
    if answer.error is not None:
        raise_remote(answer.error, peer)
    if len(answer.results) != len(request.items):
        raise ProtocolViolation(
            f"submit_batch answered {len(answer.results)} results for {len(request.items)} items"
        )
    out: list[RoundStatus | Exception] = []
    for result in answer.results:
        if result.error is not None:
            try:
                raise_remote(result.error, peer)
            except Exception as exc:
                out.append(exc)
        elif result.status is not None:
            out.append(result.status.to_status())
        else:
            raise ProtocolViolation("a submit_batch result holds neither status nor error")
    return out
