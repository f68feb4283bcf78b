"""RoundClient: join a coordinator's rounds over tensorswap frames; submit, wait, fetch."""

from __future__ import annotations

import asyncio
import functools
import math
import ssl as ssl_module
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Literal, Self

import numpy as np

from tensorswap.cid import Cid
from tensorswap.errors import StoreError
from tensorswap.rounds.client._updates import children_first, is_small
from tensorswap.rounds.client.cut import CutThroughClient
from tensorswap.rounds.client.results import ServerStatus, SubmitResult
from tensorswap.rounds.client.retention import RoundBlocks
from tensorswap.rounds.core.errors import RoundFailed, RoundTimeout, UnknownUpdate
from tensorswap.rounds.core.state import Complete, RoundId, RoundSpec, RoundStatus
from tensorswap.rounds.protocol.batch import submit_proof
from tensorswap.rounds.protocol.codec import (
    APP,
    RoundAnswer,
    RoundRequest,
    RoundRow,
    StartRequest,
    StatusRequest,
    SubmitRequest,
    WaitRequest,
    decode_answer,
    encode_call,
    raise_remote,
    spec_to_wire,
)
from tensorswap.rounds.protocol.inline import APP_INLINE, INLINE_SEND_BYTES, encode_inline
from tensorswap.rounds.protocol.push import APP_FETCH, result_roots
from tensorswap.store import (
    BlockStore,
    MemoryStore,
    ModelUpdate,
    get_update,
    put_update,
)
from tensorswap.wire import (
    BlockClient,
    Compression,
    ProtocolViolation,
    PushResult,
    RemoteError,
    Timeouts,
    WireLimits,
)
from tensorswap.wire.frames import CompressionChoice

__all__ = ["RoundClient", "ServerStatus", "SubmitResult"]

_SUBMITS_REMEMBERED = 8


class RoundClient:
    """One connection to a RoundServer (a coordinator); requests run one at a time.

    ``peer`` names this client in the rounds it joins. Every call either returns what the
    coordinator answered or raises: the same RoundsError leaf the coordinator raised (e.g.
    DuplicateContribution, with its facts), or a wire error.

    A call cancelled at any await point (``asyncio.timeout`` around it, a task cancelled)
    leaves the connection usable for the next: the answers it did not read are dropped
    before the next request, or, where its answer is a wait's or a frame was cut half-sent,
    the next call reconnects (see ``BlockClient``; a client made over a given BlockClient
    without ``redial`` raises ConnectionBroken instead). A wire error breaks the connection
    the same way. What a cancelled call asked for may still happen on the coordinator: a
    cancelled submit may be accepted (submitted again, DuplicateContribution); a resubmit
    sends only the blocks still missing.
    """

    def __init__(
        self,
        blocks: BlockClient,
        peer: str,
        store: BlockStore | None = None,
        *,
        peer_key: bytes | None = None,
    ) -> None:
        if not peer:
            raise ValueError("peer must be a non-empty name")
        self.blocks = blocks
        self.peer = peer
        self.store = store if store is not None else MemoryStore()
        # a store of its own keeps the latest rounds' blocks only (retention.py)
        self.retention = RoundBlocks(self.store) if store is None else None
        self.peer_key = peer_key
        """This peer's own key, for a coordinator with per-peer keys: inline submits then
        carry its ``submit_proof`` (plain ones cannot, and such a coordinator refuses them)."""
        self.push_results = True
        """Whether a submit that waits asks for the result behind its answer
        (``rounds.protocol.push``); turned off when the coordinator turns out to predate it."""
        self.inline = True
        """Whether tiny updates go inline with their submit (``rounds.protocol.inline``); turned off
        when the coordinator turns out to predate it."""
        self.dial: Callable[[], Awaitable[BlockClient]] | None = None
        """Opens another connection to the same coordinator, as this one was (set by
        ``connect``): for work that must not wait behind this connection's requests."""
        self.cut = CutThroughClient(self)  # the result streamed while it uploads (client.cut)
        self._lock = asyncio.Lock()  # one request (push + rounds call) at a time
        # the blocks this client submitted to recent rounds: all a result may share with the
        # store (a chunk equal in every contribution); a fetch asks for the rest at once
        self._submitted: OrderedDict[RoundId, list[Cid]] = OrderedDict()
        # Updates whose blocks went inline (bounded): submitted again, they go as a plain
        # submit, no offer (one the coordinator lost since is pushed then: UnknownUpdate)
        self._inlined: OrderedDict[Cid, None] = OrderedDict()
        # terminal statuses that submits with ``wait`` came back with (a few rounds)
        self._settled: OrderedDict[RoundId, RoundStatus] = OrderedDict()

    @classmethod
    async def connect(
        cls,
        host: str,
        port: int,
        *,
        peer: str,
        key: bytes | None = None,
        ssl: ssl_module.SSLContext | None = None,
        server_hostname: str | None = None,
        store: BlockStore | None = None,
        limits: WireLimits | None = None,
        timeouts: Timeouts | None = None,
        peer_key: bytes | None = None,
    ) -> Self:
        """Connect and authenticate; ``store`` (default: in memory) holds updates and results.

        ``key`` is the federation's shared key (the handshake); ``peer_key`` this peer's own,
        where the coordinator holds per-peer keys (see ``peer_key``).
        """
        dial = functools.partial(
            BlockClient.connect,
            host,
            port,
            key=key,
            ssl=ssl,
            server_hostname=server_hostname,
            limits=limits,
            timeouts=timeouts,
        )
        client = cls(await dial(), peer, store, peer_key=peer_key)
        client.dial = dial
        return client

    async def aclose(self) -> None:
        await self.cut.aclose()
        await self.blocks.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        await self.cut.aclose()
        await self.blocks.__aexit__(exc_type, exc, tb)

    # ── rounds ───────────────────────────────────────────────────────────────
    async def start_round(self, round_id: RoundId, spec: RoundSpec) -> bool:
        """Start a round on the coordinator; False if it already exists (then just join it)."""
        rid = round_id
        request = StartRequest(round=rid.round, initiator=rid.initiator, spec=spec_to_wire(spec))
        answer = await self._call(request)
        return bool(answer.started)

    async def submit(
        self,
        round_id: RoundId,
        update: ModelUpdate | Mapping[str, Any] | Cid,
        num_samples: int = 0,
        *,
        compression: CompressionChoice = Compression.NONE,
        wait: float | None = None,
    ) -> SubmitResult:
        """Store the update locally, push what the coordinator lacks, and submit it.

        ``update`` is a ModelUpdate, a dict of named numpy arrays / torch tensors (then
        ``num_samples`` is its sample count), or the CID of an update already in this
        client's store. Returns once the contribution is durable on the coordinator; raises
        what the coordinator refused it for. If the coordinator answers that it lacks a block
        (one of its copies failed its hash check and was quarantined), the blocks it lacks are
        pushed once more and the submit repeated.

        An update given as values whose blocks total at most ``INLINE_SEND_BYTES`` goes in
        one request with its blocks (``rounds.protocol.inline``: one round trip, no dedup) unless
        ``inline`` is off; ``compression`` does not apply to it.

        A larger update is announced first (``self.cut``): where the coordinator takes it, the
        round's result streams back while it uploads, and ``fetch_result`` reads it locally.

        ``wait`` (seconds): the coordinator holds the answer until the round is terminal, that
        long at most (``SubmitRequest.timeout``): the submit and the wait are one round trip,
        and a later ``wait``, ``result`` or ``fetch_result`` of the round returns without
        asking again. With ``push_results`` (the default) and no stream, the aggregate's
        blocks come behind a Complete answer (``rounds.protocol.push``): submit, wait and
        fetch in one round trip. A peer that fetches results elsewhere (``SwarmPeer``) turns
        ``push_results`` off. Not for inline submits.
        """
        small = is_small(update)  # then encoding and listing it cost less than thread hops
        self._begin_round_call()
        if not isinstance(update, Cid | ModelUpdate):
            update = ModelUpdate(dict(update), num_samples)
        cid = update if isinstance(update, Cid) else await self._put(update, small)
        known = cid in self._inlined  # its blocks went inline before: submit, no offer
        if small and not isinstance(update, Cid) and self.inline and not known:
            closure = children_first(self.store, cid)
            inlined = await self._submit_inline(round_id, cid, closure)
            if inlined is not None:
                self._inlined[cid] = None
                if len(self._inlined) > _INLINED_KEPT:
                    self._inlined.popitem(last=False)
                self._remember(round_id, closure)
                return inlined
        if not small:  # its result may stream back while it uploads (client.cut)
            cid = await self.cut.begin(round_id, cid, None if isinstance(update, Cid) else update)
        call = SubmitRequest.of(round_id, self.peer, cid, wait)
        read = self.blocks.conn.timeouts.read
        limit = None if wait is None or read is None else wait + read
        async with self._lock:
            start, wire_start = time.perf_counter(), self.blocks.bytes_sent
            if small and not isinstance(update, Cid):
                closure = children_first(self.store, cid)
            else:
                closure = await asyncio.to_thread(children_first, self.store, cid)
            answer, sent, sent_blocks = await self._push_and_call(
                call, closure, known, compression, limit
            )
            self._remember(round_id, closure)
            push = PushResult(
                roots=(cid,),
                offered=len(closure),
                sent_blocks=sent_blocks,
                sent_bytes=sent,
                wire_bytes=self.blocks.bytes_sent - wire_start,
                seconds=time.perf_counter() - start,
            )
        status = _status(answer)
        self._hold_result(round_id, status)  # its blocks may have come behind the answer
        if status.is_terminal:
            self._settled[round_id] = status
            while len(self._settled) > _SUBMITS_REMEMBERED:
                self._settled.popitem(last=False)
        return SubmitResult(cid, status, push)

    async def _put(self, update: ModelUpdate, small: bool) -> Cid:
        """``update`` into this client's store, cut as ``self.cut`` says; its CID."""
        if small:
            return put_update(self.store, update)
        size = self.cut.chunk_bytes
        return await asyncio.to_thread(put_update, self.store, update, chunk_bytes=size)

    async def _push_and_call(
        self,
        call: SubmitRequest,
        closure: list[Cid],
        known: bool,
        compression: CompressionChoice,
        limit: float | None,
    ) -> tuple[RoundAnswer, int, int]:
        """Push the blocks of ``closure`` the coordinator lacks (none when ``known``; paced by
        ``cut``), then submit (the lock held): the answer, bytes and blocks sent. Pushes again
        if the coordinator turns out to lack a block after all."""
        lacking = [] if known else await self.blocks.missing(closure)
        before = self.cut.before_send(RoundId(call.round, call.initiator))
        sent = await self.blocks.put_blocks(
            self.store, lacking, compression=compression, before=before
        )
        sent_blocks = len(lacking)
        # The server stores every block sent before it runs the submit: no separate
        # commit, one round trip.
        try:
            answer = await self._submit_call(call, limit)
        except UnknownUpdate:
            # A block the coordinator held failed its hash check there (it quarantined
            # it) or went away: it now lacks it, so push what it lacks once more.
            lacking = await self.blocks.missing(closure)
            if not lacking:
                raise
            sent += await self.blocks.put_blocks(self.store, lacking, compression=compression)
            sent_blocks += len(lacking)
            answer = await self._submit_call(call, limit)
        return answer, sent, sent_blocks

    async def _submit_call(self, call: SubmitRequest, limit: float | None) -> RoundAnswer:
        """The submit's answer (the lock held); a submit that waits goes to ``rounds/fetch``,
        so a Complete answer comes with the result's blocks into the store
        (``rounds.protocol.push``), unless they come by the round's stream (``client.cut``)."""
        rid = RoundId(call.round, call.initiator)
        if call.timeout is not None and self.push_results and not self.cut.streaming(rid):
            try:
                body, _ = await self.blocks.request_blocks(
                    APP_FETCH, encode_call(call), self.store, result_roots, timeout=limit or "read"
                )
            except RemoteError as exc:
                if exc.code != "unsupported":
                    raise
                self.push_results = False  # a coordinator from before rounds/fetch
            else:
                answer = decode_answer(body)
                if answer.error is not None:
                    raise_remote(answer.error, self.blocks.conn.peer)
                return answer
        return await self._call(call, limit=limit, locked=True)

    async def _submit_inline(
        self, round_id: RoundId, cid: Cid, closure: list[Cid]
    ) -> SubmitResult | None:
        """Submit ``cid`` with its blocks (``closure``, children first) in one request; None
        when they are too many bytes or the coordinator predates inline submits (then
        ``inline`` is turned off)."""
        blocks = [(c, self.store.get(c, verify=False)) for c in closure]
        nbytes = sum(data.nbytes for _, data in blocks)
        if nbytes > INLINE_SEND_BYTES:
            return None
        key = self.peer_key
        proof = b"" if key is None else submit_proof(key, round_id, self.peer, cid)
        body = encode_inline(round_id, self.peer, cid, blocks, proof)
        async with self._lock:
            start, wire_start = time.perf_counter(), self.blocks.bytes_sent
            try:
                reply = await self.blocks.request(APP_INLINE, body)
            except RemoteError as exc:
                if exc.code != "unsupported":
                    raise
                self.inline = False  # a coordinator from before inline submits
                return None
            answer = decode_answer(reply)
            if answer.error is not None:
                raise_remote(answer.error, self.blocks.conn.peer)
            push = PushResult(
                roots=(cid,),
                offered=len(closure),
                sent_blocks=len(closure),
                sent_bytes=nbytes,
                wire_bytes=self.blocks.bytes_sent - wire_start,
                seconds=time.perf_counter() - start,
            )
        return SubmitResult(cid, _status(answer), push)

    async def status(self, round_id: RoundId) -> RoundStatus:
        """The round's current status (RoundNotFound if the coordinator has no such round)."""
        answer = await self._call(StatusRequest(round=round_id.round, initiator=round_id.initiator))
        return _status(answer)

    async def round_row(self, round_id: RoundId) -> RoundRow:
        """The coordinator's row for one round: its strategy, quorum, peers, deadline."""
        answer = await self._call(StatusRequest(round=round_id.round, initiator=round_id.initiator))
        if not answer.rounds:
            raise ProtocolViolation("the coordinator's answer lacks the round's row")
        return answer.rounds[0]

    async def server_status(self) -> ServerStatus:
        """Every round with its peers and bytes, and the coordinator's counters."""
        answer = await self._call(StatusRequest(all=True))
        return ServerStatus(answer.rounds or [], answer.stats or {}, max(0, answer.omitted or 0))

    async def wait(self, round_id: RoundId, timeout: float | None = None) -> RoundStatus:
        """Wait until the round is Complete or Failed (RoundTimeout after ``timeout`` s).

        ``timeout`` None (or infinite) waits as long as it takes; a negative one is 0. The
        coordinator ends each wait request after its own ``max_wait`` at most; this call then
        asks again, so it still waits as long as asked. Cancelled while the coordinator holds
        the wait, it leaves that answer owed: the next call reconnects rather than wait for
        it (see the class docstring).
        """
        settled = self._settled.get(round_id)
        if settled is not None:  # a submit's answer said so (terminal: final)
            return settled
        if timeout is not None:
            if math.isnan(timeout):
                raise ValueError("timeout must be a number of seconds or None, got nan")
            timeout = None if math.isinf(timeout) and timeout > 0 else max(0.0, timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        asked = timeout
        while True:
            call = WaitRequest(round=round_id.round, initiator=round_id.initiator, timeout=asked)
            read = self.blocks.conn.timeouts.read
            limit = None if asked is None or read is None else asked + read
            try:
                return _status(await self._call(call, limit=limit, unbounded=asked is None))
            except RoundTimeout as exc:
                if not _cut_short(exc, asked):
                    if asked == timeout:
                        raise
                    raise RoundTimeout(round_id.as_key(), timeout or 0.0, _fact(exc)) from None
                last = _fact(exc)
            if deadline is not None:
                asked = deadline - time.monotonic()
                if asked <= 0:
                    raise RoundTimeout(round_id.as_key(), timeout or 0.0, last)

    async def result(self, round_id: RoundId, timeout: float | None = None) -> Cid:
        """Wait for the round and return its aggregate's CID (RoundFailed if it failed)."""
        status = await self.wait(round_id, timeout)
        if isinstance(status, Complete):
            return Cid.parse(status.cid)
        raise RoundFailed(round_id.as_key(), getattr(status, "reason", status.name))

    def _remember(self, round_id: RoundId, closure: list[Cid]) -> None:
        """The blocks of what this client submitted to ``round_id`` (a few rounds kept)."""
        self._submitted[round_id] = closure
        while len(self._submitted) > _SUBMITS_REMEMBERED:
            self._submitted.popitem(last=False)
        if self.retention is not None:
            self.retention.hold_new(round_id, closure)

    def _begin_round_call(self) -> None:
        if self.retention is not None:  # what the store holds before the call brings more
            self.retention.begin()

    def _hold_result(self, round_id: RoundId, status: RoundStatus) -> None:
        if isinstance(status, Complete) and self.retention is not None:
            self.retention.hold_root(round_id, Cid.parse(status.cid))

    async def fetch(self, cid: Cid, *, have: Sequence[Cid] | None = None) -> ModelUpdate:
        """Pull the update ``cid`` into this client's store (only blocks it lacks) and load it.
        ``have``: blocks of it the store may hold; then everything else is asked for in one
        round trip (``BlockClient.pull``), else level by level."""
        async with self._lock:
            await self.blocks.pull(cid, self.store, have=have)
        return await asyncio.to_thread(get_update, self.store, cid)

    async def fetch_result(
        self, round_id: RoundId, timeout: float | None = None
    ) -> dict[str, np.ndarray]:
        """Wait for the round (``timeout`` in all), fetch its aggregate, return the arrays.

        After a submit to that round on this client, the aggregate is fetched in one round
        trip: all its blocks but those of the update submitted (a chunk equal in every
        contribution, a frozen layer, is the one kind it shares with them)."""
        start = time.monotonic()
        streamed = await self.cut.take(round_id, timeout)
        if streamed is not None:  # the stream brought it whole: loaded here
            try:
                update = await asyncio.to_thread(get_update, self.store, streamed)
            except StoreError:
                pass
            else:
                self._hold_result(round_id, Complete(str(streamed)))
                return dict(update.tensors)
        if timeout is not None:  # what the stream's wait left of it
            timeout = max(0.0, timeout - (time.monotonic() - start))
        cid = await self.result(round_id, timeout)
        self._begin_round_call()
        update = await self.fetch(cid, have=self._submitted.get(round_id))
        if self.retention is not None:
            self.retention.hold_root(round_id, cid)
        return dict(update.tensors)

    # ── one request ──────────────────────────────────────────────────────────
    async def _call(
        self,
        call: RoundRequest,
        *,
        limit: float | None = None,
        unbounded: bool = False,
        locked: bool = False,
    ) -> RoundAnswer:
        if not locked:
            async with self._lock:
                return await self._call(call, limit=limit, unbounded=unbounded, locked=True)
        timeout: float | Literal["read"] | None = None if unbounded else (limit or "read")
        try:
            body = await self.blocks.request(APP, encode_call(call), timeout=timeout)
        except RemoteError as exc:
            if exc.code == "unsupported":
                peer = self.blocks.conn.peer
                raise ProtocolViolation(f"{peer} is not a tensorswap coordinator") from exc
            raise
        answer = decode_answer(body)
        if answer.error is not None:
            raise_remote(answer.error, self.blocks.conn.peer)
        return answer


_INLINED_KEPT = 1024


def _cut_short(exc: RoundTimeout, asked: float | None) -> bool:
    """Whether the coordinator ended a wait before the time asked (its ``max_wait``)."""
    waited = getattr(exc, "timeout", None)
    if isinstance(waited, bool) or not isinstance(waited, int | float):
        return False
    return waited > 0 and (asked is None or waited < asked)


def _fact(exc: RoundTimeout) -> str:
    return status if isinstance(status := getattr(exc, "status", None), str) else "unknown"


def _status(answer: RoundAnswer) -> RoundStatus:
    if answer.status is None:
        raise ProtocolViolation("the coordinator's answer lacks a status")
    return answer.status.to_status()
