"""RoundServer: the coordinator and the block service on one port, over tensorswap frames."""

from __future__ import annotations

import asyncio
import logging
import math
import ssl as ssl_module
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Self, assert_never

import msgspec

from tensorswap.cid import Cid
from tensorswap.errors import TensorSwapError, WireError
from tensorswap.rounds.core import PeerNotAuthorised, RoundNotFound, RoundTimeout, SampleHidden
from tensorswap.rounds.core.state import RoundId, RoundStatus
from tensorswap.rounds.engine.coordinator import Coordinator
from tensorswap.rounds.protocol.batch import (
    BatchAnswer,
    BatchSubmitRequest,
    ItemResult,
    PeerKeys,
    refusal,
)
from tensorswap.rounds.protocol.codec import (
    APP,
    CompleteWire,
    FailedWire,
    RoundAnswer,
    RoundRequest,
    RoundRow,
    StartRequest,
    StatusRequest,
    SubmitRequest,
    WaitRequest,
    encode_answer,
    error_info,
    row_of,
    spec_from_wire,
    status_to_wire,
)
from tensorswap.rounds.protocol.inline import (
    APP_INLINE,
    Blocks,
    decode_inline,
    inline_blocks,
    reserve_inline,
)
from tensorswap.rounds.protocol.paging import (
    PageAnswer,
    PeersPageRequest,
    RoundsPageRequest,
    next_start,
)
from tensorswap.rounds.protocol.push import APP_FETCH, result_push
from tensorswap.rounds.server._queue import IntakeQueue
from tensorswap.rounds.server._waiters import Waiters
from tensorswap.rounds.server.cut import CutService
from tensorswap.rounds.server.visibility import Visibility
from tensorswap.store import BlockStore
from tensorswap.wire import (
    AppRequest,
    BlockServer,
    ProtocolViolation,
    ServerStats,
    TcpListener,
    Timeouts,
    Transport,
    WireLimits,
)
from tensorswap.wire.server import DEFAULT_MAX_INFLIGHT_BYTES
from tensorswap.wire.tcp import DEFAULT_MAX_CONNECTIONS

__all__ = ["RoundServer", "TrafficStats"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TrafficStats:
    """Bytes over every connection so far (live ones included) and connections now open."""

    bytes_in: int
    bytes_out: int
    connections: int
    open_connections: int


class RoundServer:
    """A BlockServer plus rounds (start, submit, status, wait) for ``coordinator``.

    It holds a ``BlockServer`` (``self.blocks``) over the coordinator's store with a handler
    for the app ``"rounds"`` (see ``rounds.protocol``): the block service stores every block
    sent before a request, then the request runs and its answer comes back in the REPLY. A
    refused request (a RoundsError) is answered in the reply and the connection stays
    usable; any other failure ends the connection as in BlockServer. ``wait`` requests do
    not hold a thread: they are woken by the coordinator's status changes. ``store_depth``
    bounds the received blocks waiting to be stored per connection (memory: about
    ``connections * (store_depth + 1)`` blocks). The server does not own the coordinator.

    A ``wait`` lasts at most ``max_wait`` seconds whatever the client asked (then answered
    RoundTimeout with ``timeout`` = the time waited; RoundClient asks again): a client gone
    away holds its connection that long at most. A ``status`` answer too large for the
    message limit leaves rounds out (keeping live ones and the newest; ``omitted`` counts
    them). Wire counters are the block server's ``stats``. ``cut`` serves cut-through.
    """

    def __init__(
        self,
        coordinator: Coordinator,
        *,
        key: bytes | None = None,
        limits: WireLimits | None = None,
        timeouts: Timeouts | None = None,
        name: str = "tensorswap-coordinator",
        store_depth: int = 1,
        max_wait: float = 300.0,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
        peer_keys: Mapping[str, bytes] | None = None,
        operator_key: bytes | None = None,
    ) -> None:
        if not (isinstance(max_wait, int | float) and math.isfinite(max_wait) and max_wait > 0):
            raise ValueError(f"max_wait must be a finite number of seconds > 0, got {max_wait!r}")
        self.blocks = BlockServer(
            coordinator.store,
            key=key,
            operator_key=operator_key,
            limits=limits,
            timeouts=timeouts,
            name=name,
            store_depth=store_depth,
            handlers={
                APP: self._on_request,
                APP_INLINE: self._on_inline,
                APP_FETCH: result_push(self._on_request, coordinator.store),
            },
            max_connections=max_connections,
            max_inflight_bytes=max_inflight_bytes,
        )
        """The block service every connection is served by (rounds requests included)."""
        self.coordinator = coordinator
        self.max_wait = float(max_wait)
        """The longest one ``wait`` request waits (seconds)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiters = Waiters()
        self._intake = IntakeQueue(coordinator)
        self.peer_keys = None if peer_keys is None else PeerKeys(peer_keys)
        """Per-peer keys: when set, every contribution must prove its peer's key
        (``rounds.protocol.batch``); the plain ``submit`` op is refused."""
        self.stat_sources: list[Callable[[], Mapping[str, float | int | str]]] = []
        """More counters for ``status`` answers' stats (services attached to this server)."""
        self.visibility = Visibility()
        """Whose rounds' peer names peers are not shown (a DP run's: the runs service adds
        its test); a connection with the operator key is shown them."""
        coordinator.subscribe(self._on_change)
        self.cut = CutService(coordinator, lambda: self.peer_keys, lambda: self.max_wait)
        """Cut-through rounds: announcements, and results streamed as they are folded."""
        self.blocks.handlers.update(self.cut.handlers)
        self.blocks.on_stored = self.cut.on_stored
        self.blocks.chunk_bytes = lambda: coordinator.result_chunk_bytes  # clients cut so
        self.stat_sources.append(coordinator.cut.stats)  # cut_held_bytes, cut_folded, ...

    # ── lifecycle: the block server's ───────────────────────────────────────
    async def start(
        self, host: str = "127.0.0.1", port: int = 0, *, ssl: ssl_module.SSLContext | None = None
    ) -> Self:
        """Listen on ``host:port`` (TLS with ``ssl``); the bound port is ``self.port``.

        The listener is the block server's (``blocks.listener``: its connection cap and
        busy refusals), but each connection enters through ``self.handle``.
        """
        self._loop = asyncio.get_running_loop()
        await self.blocks.start(host, port, ssl=ssl, handler=self.handle)
        log.info("coordinator listening on %s:%d", host, self.port)
        return self

    async def handle(self, transport: Transport) -> None:
        """Serve one connection (the block service and rounds) until the client closes it."""
        await self.blocks.handle(transport)

    async def aclose(self) -> None:
        """Stop listening and cancel the connections being served; submits already handed
        to the coordinator finish (they are journaled or refused, as if answered)."""
        await self.blocks.aclose()
        await self._intake.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    @property
    def port(self) -> int:
        return self.blocks.port

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)`` the server listens on (RuntimeError before ``start``)."""
        listener = self.listener
        if listener is None:
            raise RuntimeError("server not started")
        return listener.host, listener.port

    @property
    def listener(self) -> TcpListener | None:
        return self.blocks.listener

    @property
    def stats(self) -> ServerStats:
        """The block server's counters (connections, bytes, blocks, requests)."""
        return self.blocks.stats

    @property
    def errors(self) -> deque[BaseException]:  # the last failures that ended a connection
        return self.blocks.errors

    @property
    def store(self) -> BlockStore:
        return self.blocks.store

    @property
    def limits(self) -> WireLimits:
        return self.blocks.limits

    @property
    def timeouts(self) -> Timeouts:
        return self.blocks.timeouts

    @property
    def max_connections(self) -> int:
        return self.blocks.max_connections

    def traffic(self) -> TrafficStats:
        """Bytes in and out so far, over closed and open connections (the wire's counts)."""
        stats = self.blocks.stats
        return TrafficStats(
            stats.bytes_in, stats.bytes_out, stats.connections, stats.open_connections
        )

    # ── rounds requests ──────────────────────────────────────────────────────
    async def _on_request(self, request: AppRequest) -> bytes:
        self._loop = asyncio.get_running_loop()
        call = _decode_any(request.body)
        if isinstance(call, BatchSubmitRequest):
            return _encoder.encode(await self._submit_batch(call))
        if isinstance(call, RoundsPageRequest | PeersPageRequest):
            return _encoder.encode(self._page(call, operator=request.operator))
        if isinstance(call, SubmitRequest) and self.peer_keys is not None:
            refused = PeerNotAuthorised(
                call.round_id.as_key(), call.peer, "this coordinator takes only proven submits"
            )
            return encode_answer(RoundAnswer(error=error_info(refused)))
        answer = await self._call(call)
        if answer.rounds and not request.operator:
            answer = msgspec.structs.replace(answer, rounds=self.visibility.rows(answer.rounds))
        body = encode_answer(answer)
        if len(body) > self._reply_budget and answer.rounds:
            body = encode_answer(self._trimmed(answer))
        return body

    async def _on_inline(self, request: AppRequest) -> bytes:
        """An inline submit (``protocol.inline``): proof first, then its blocks, the submit."""
        self._loop = asyncio.get_running_loop()
        call = decode_inline(request.body)
        rid, cid = call.round_id, call.cid
        if self.peer_keys is not None:
            try:
                self.peer_keys.check(rid, call.peer, cid, call.proof)
            except PeerNotAuthorised as exc:
                return encode_answer(RoundAnswer(error=error_info(exc)))
        with await reserve_inline(self.blocks.budget, call):
            try:
                status = await self._submit(rid, call.peer, cid, inline_blocks(call))
            except WireError:  # a block that fails its CID: the connection ends
                raise
            except TensorSwapError as exc:
                return encode_answer(RoundAnswer(error=error_info(exc)))
        self.blocks.stats.blocks_stored += len(call.blocks)
        self.blocks.stats.bytes_stored += call.nbytes
        return encode_answer(RoundAnswer(status=status_to_wire(status)))

    @property
    def _reply_budget(self) -> int:
        """The largest answer body that fits a REPLY frame within the message limit."""
        return self.limits.max_message_bytes - _REPLY_OVERHEAD

    def _trimmed(self, answer: RoundAnswer) -> RoundAnswer:
        """``answer`` with as many of its rounds as fit the budget: live ones first, then the
        newest; listed in their original order; ``omitted`` says how many are left out."""
        rows = answer.rounds or []
        room = self._reply_budget - len(
            encode_answer(msgspec.structs.replace(answer, rounds=[], omitted=len(rows)))
        )
        sizes = [len(encode_answer(RoundAnswer(rounds=[row]))) - _ONE_ROW_OVERHEAD for row in rows]
        order = sorted(
            range(len(rows)),
            key=lambda i: (_is_terminal(rows[i]), -rows[i].created_at, -i),
        )
        keep: set[int] = set()
        for i in order:
            if sizes[i] + _LIST_HEADER <= room:
                keep.add(i)
                room -= sizes[i]
        kept = [row for i, row in enumerate(rows) if i in keep]
        return msgspec.structs.replace(answer, rounds=kept, omitted=len(rows) - len(kept))

    async def _call(self, request: RoundRequest) -> RoundAnswer:
        """The answer to a decoded (so checked) request; a RoundsError becomes a refusal."""
        coord = self.coordinator
        try:
            match request:
                case StatusRequest(all=True):
                    rows = [row_of(info) for info in coord.rounds()]
                    return RoundAnswer(rounds=rows, stats=self._stats())
                case StartRequest():
                    rid, spec = request.round_id, spec_from_wire(request.spec)
                    started = await asyncio.to_thread(coord.start_round, rid, spec)
                    current = coord.status(rid)
                    wired = None if current is None else status_to_wire(current)
                    return RoundAnswer(started=started, status=wired)
                case SubmitRequest():
                    status = await self._submit(request.round_id, request.peer, request.cid)
                    if request.timeout is not None and not status.is_terminal:
                        status = await self._settle(request.round_id, request.timeout, status)
                    return RoundAnswer(status=status_to_wire(status))
                case WaitRequest():
                    status = await self._wait(request.round_id, request.timeout)
                    return RoundAnswer(status=status_to_wire(status))
                case StatusRequest():
                    rid = request.round_id
                    info = coord.info(rid)
                    if info is None:
                        raise RoundNotFound(rid.as_key())
                    return RoundAnswer(rounds=[row_of(info)], status=status_to_wire(info.status))
                case _:
                    assert_never(request)
        except ProtocolViolation:
            raise
        except TensorSwapError as exc:
            return RoundAnswer(error=error_info(exc))

    async def _submit(
        self, rid: RoundId, peer: str, cid: Cid, blocks: Blocks | None = None
    ) -> RoundStatus:
        """``coordinator.submit``, batched with the submits other connections make meanwhile
        and pipelined (``rounds.server._queue``); each answer still waits for its own commit."""
        return await self._intake.submit(rid, peer, cid, blocks)

    async def _submit_batch(self, call: BatchSubmitRequest) -> BatchAnswer:
        """Check each item's proof (with per-peer keys), then submit the rest together."""
        rid = call.round_id
        results: list[ItemResult | None] = [None] * len(call.items)
        todo: list[tuple[int, str, Cid]] = []
        for index, item in enumerate(call.items):
            try:
                if self.peer_keys is not None:
                    self.peer_keys.check(rid, item.peer, item.cid, item.proof)
            except PeerNotAuthorised as exc:
                results[index] = refusal(exc)
                continue
            todo.append((index, item.peer, item.cid))
        if todo:
            pairs = [(peer, cid) for _, peer, cid in todo]
            outcomes = await asyncio.to_thread(self.coordinator.submit_many, rid, pairs)
            for (index, _, _), outcome in zip(todo, outcomes, strict=True):
                if isinstance(outcome, TensorSwapError):
                    results[index] = refusal(outcome)
                elif isinstance(outcome, Exception):
                    raise outcome
                else:
                    results[index] = ItemResult(status=status_to_wire(outcome))
        return BatchAnswer(results=[r for r in results if r is not None])

    def _page(self, call: RoundsPageRequest | PeersPageRequest, *, operator: bool) -> PageAnswer:
        tracker = self.coordinator.tracker
        if isinstance(call, RoundsPageRequest):
            infos, total = tracker.page(call.start, call.limit, call.peers)
            rows = [row_of(info) for info in infos]
            rows = rows if operator else self.visibility.rows(rows)
            stats = self._stats() if call.stats else {}
            after = next_start(call.start, len(rows), total)
            return PageAnswer(rounds=rows, total=total, next=after, stats=stats)
        try:
            names, total = tracker.peers_page(call.round_id, call.start, call.limit)
            if not operator and self.visibility.hides(call.round_id):
                raise SampleHidden(call.round_id.as_key())
        except (RoundNotFound, SampleHidden) as exc:
            return PageAnswer(error=error_info(exc))
        return PageAnswer(peers=names, total=total, next=next_start(call.start, len(names), total))

    async def _wait(self, rid: RoundId, timeout: float | None) -> RoundStatus:
        """The round's status once terminal; RoundTimeout after ``timeout`` (checked finite
        and >= 0 when the request was decoded) or ``max_wait``, whichever is shorter."""
        limit = self.max_wait if timeout is None else min(timeout, self.max_wait)
        try:
            with self._waiters.waiting(rid) as event:
                async with asyncio.timeout(limit):
                    while True:
                        event.clear()
                        status = self.coordinator.status(rid)
                        if status is None:
                            raise RoundNotFound(rid.as_key())
                        if status.is_terminal:
                            return status
                        await event.wait()
        except TimeoutError:
            status = self.coordinator.status(rid)
            name = status.name if status is not None else "gone"
            raise RoundTimeout(rid.as_key(), limit, name) from None

    async def _settle(self, rid: RoundId, timeout: float, status: RoundStatus) -> RoundStatus:
        """A submit's wait (``SubmitRequest.timeout``): terminal status, else the latest."""
        try:
            return await self._wait(rid, timeout)
        except (RoundTimeout, RoundNotFound):
            return self.coordinator.status(rid) or status

    def _on_change(self, rid: RoundId, status: RoundStatus) -> None:
        """From any thread: wake this round's waiters on the loop once it is terminal (a wait
        returns only then: no loop wake-up per accepted contribution)."""
        if not status.is_terminal:
            return
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._wake, rid)

    def _wake(self, rid: RoundId) -> None:
        self._waiters.wake(rid)

    def _stats(self) -> dict[str, float | int | str]:
        stats: dict[str, float | int | str] = dict(self.coordinator.stats().to_dict())
        traffic = self.traffic()
        stats.update(
            bytes_in=traffic.bytes_in,
            bytes_out=traffic.bytes_out,
            connections=traffic.connections,
            open_connections=traffic.open_connections,
            blocks_stored=self.stats.blocks_stored,
            blocks_served=self.stats.blocks_served,
        )
        wire = self.stats
        stats.update(  # the wire's in-flight budget, over all connections
            inflight_bytes=wire.inflight_bytes,
            inflight_peak_bytes=wire.inflight_peak_bytes,
            inflight_limit_bytes=wire.inflight_limit_bytes,
            inflight_waits=wire.inflight_waits,
            inflight_refused=wire.inflight_refused,
            pool_in_use_bytes=wire.pool_in_use_bytes,
            pool_idle_bytes=wire.pool_idle_bytes,
            pool_working_set_bytes=wire.pool_working_set_bytes,
        )
        for source in self.stat_sources:
            stats.update(source())
        return stats


_REPLY_OVERHEAD = 1024
"""Room for the REPLY message around the answer body (app name, field names, lengths)."""
_ONE_ROW_OVERHEAD = len(encode_answer(RoundAnswer(rounds=[])))
"""What an answer holding nothing but an empty ``rounds`` list encodes to."""
_LIST_HEADER = 5
"""The most a msgpack array header takes."""


_encoder = msgspec.msgpack.Encoder()
_any_decoder = msgspec.msgpack.Decoder(
    StartRequest
    | SubmitRequest
    | StatusRequest
    | WaitRequest
    | BatchSubmitRequest
    | RoundsPageRequest
    | PeersPageRequest
)


def _decode_any(
    body: bytes,
) -> RoundRequest | BatchSubmitRequest | RoundsPageRequest | PeersPageRequest:
    """A rounds request of any op (``decode_call``'s checks, and the batch and page ops)."""
    try:
        return _any_decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise ProtocolViolation(f"bad rounds request: {exc}") from exc
    except RecursionError:
        raise ProtocolViolation("bad rounds request: nested too deeply") from None


def _is_terminal(row: RoundRow) -> bool:
    return isinstance(row.status, CompleteWire | FailedWire)
