"""RoundServer: the coordinator and the block service on one port, over tensorswap frames."""

from __future__ import annotations

import asyncio
import logging
import math
import ssl as ssl_module
from dataclasses import dataclass
from typing import Self

import msgspec

from tensorswap.cid import Cid
from tensorswap.errors import InvalidCid, TensorSwapError
from tensorswap.rounds.coordinator import Coordinator
from tensorswap.rounds.errors import RoundNotFound, RoundTimeout
from tensorswap.rounds.protocol import (
    APP,
    OPS,
    RoundAnswer,
    RoundCall,
    RoundRow,
    decode_call,
    encode_answer,
    error_info,
    peer_of,
    round_id_of,
    row_of,
    spec_from_wire,
)
from tensorswap.rounds.state import RoundId, RoundStatus
from tensorswap.wire import (
    AppRequest,
    BlockServer,
    ProtocolViolation,
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


class RoundServer(BlockServer):
    """A BlockServer that also runs rounds (start, submit, status, wait) for ``coordinator``.

    Rounds requests are wire application requests for the app ``"rounds"`` (see
    ``rounds.protocol``): the block service stores every block sent before a request, then
    the request runs and its answer comes back in the REPLY. A refused request (a
    RoundsError) is answered in the reply and the connection stays usable; any other
    failure ends the connection as in BlockServer. ``wait`` requests do not hold a thread:
    they are woken by the coordinator's status changes. ``store_depth`` bounds the received
    blocks waiting to be stored per connection (memory: about ``connections * (store_depth
    + 1)`` blocks). The server does not own the coordinator.

    A ``wait`` lasts at most ``max_wait`` seconds whatever the client asked (then it is
    answered RoundTimeout with ``timeout`` = the time waited; RoundClient asks again), so a
    client that went away holds its connection for ``max_wait`` at most. A wait timeout that
    is not a finite number >= 0 is a protocol violation. A ``status`` answer that would not
    fit in the message limit leaves rounds out (live ones and the newest are kept) and says
    how many in ``omitted``.
    """

    def __init__(
        self,
        coordinator: Coordinator,
        *,
        key: bytes | None = None,
        limits: WireLimits | None = None,
        timeouts: Timeouts | None = None,
        name: str = "tensorswap-coordinator",
        store_depth: int = 2,
        max_wait: float = 300.0,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
    ) -> None:
        if not (isinstance(max_wait, int | float) and math.isfinite(max_wait) and max_wait > 0):
            raise ValueError(f"max_wait must be a finite number of seconds > 0, got {max_wait!r}")
        super().__init__(
            coordinator.store,
            key=key,
            limits=limits,
            timeouts=timeouts,
            name=name,
            store_depth=store_depth,
            handlers={APP: self._on_request},
            max_connections=max_connections,
            max_inflight_bytes=max_inflight_bytes,
        )
        self.coordinator = coordinator
        self.max_wait = float(max_wait)
        """The longest one ``wait`` request waits (seconds)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiters: dict[RoundId, set[asyncio.Event]] = {}
        self._live: set[Transport] = set()
        self._closed_in = 0
        self._closed_out = 0
        coordinator.subscribe(self._on_change)

    async def start(
        self, host: str = "127.0.0.1", port: int = 0, *, ssl: ssl_module.SSLContext | None = None
    ) -> Self:
        self._loop = asyncio.get_running_loop()
        await super().start(host, port, ssl=ssl)
        log.info("coordinator listening on %s:%d", host, self.port)
        return self

    def traffic(self) -> TrafficStats:
        """Bytes in and out so far, over closed and open connections."""
        live_in = sum(t.bytes_received for t in self._live)
        live_out = sum(t.bytes_sent for t in self._live)
        return TrafficStats(
            self._closed_in + live_in,
            self._closed_out + live_out,
            self.stats.connections,
            len(self._live),
        )

    # ── connections ──────────────────────────────────────────────────────────
    async def handle(self, transport: Transport) -> None:
        self._live.add(transport)
        try:
            await super().handle(transport)
        finally:
            self._live.discard(transport)
            self._closed_in += transport.bytes_received
            self._closed_out += transport.bytes_sent

    # ── rounds requests ──────────────────────────────────────────────────────
    async def _on_request(self, request: AppRequest) -> bytes:
        answer = await self._call(decode_call(request.body))
        body = encode_answer(answer)
        if len(body) > self._reply_budget and answer.rounds:
            body = encode_answer(self._trimmed(answer))
        return body

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

    async def _call(self, call: RoundCall) -> RoundAnswer:
        if call.op not in OPS:
            raise ProtocolViolation(f"unknown rounds op {call.op!r}; known {list(OPS)}")
        coord = self.coordinator
        try:
            if call.op == "status" and call.all:
                rows = [row_of(info) for info in coord.rounds()]
                return RoundAnswer(rounds=rows, stats=self._stats())
            rid = round_id_of(call)
            if call.op == "start":
                if call.spec is None:
                    raise ProtocolViolation("a start request needs a spec")
                spec = spec_from_wire(call.spec)
                started = await asyncio.to_thread(coord.start_round, rid, spec)
                return RoundAnswer(started=started, status=_status_dict(coord, rid))
            if call.op == "submit":
                peer = peer_of(call)
                update = _update_cid(call)
                status = await asyncio.to_thread(coord.submit, rid, peer, update)
                return RoundAnswer(status=status.to_dict())  # type: ignore[arg-type]
            if call.op == "wait":
                status = await self._wait(rid, call.timeout)
                return RoundAnswer(status=status.to_dict())  # type: ignore[arg-type]
            info = coord.info(rid)
            if info is None:
                raise RoundNotFound(rid.as_key())
            return RoundAnswer(rounds=[row_of(info)], status=info.status.to_dict())  # type: ignore[arg-type]
        except ProtocolViolation:
            raise
        except TensorSwapError as exc:
            return RoundAnswer(error=error_info(exc))

    async def _wait(self, rid: RoundId, timeout: float | None) -> RoundStatus:
        if timeout is not None and not (math.isfinite(timeout) and timeout >= 0):
            raise ProtocolViolation(
                f"a wait timeout must be a finite number of seconds >= 0, got {timeout!r}"
            )
        limit = self.max_wait if timeout is None else min(timeout, self.max_wait)
        event = asyncio.Event()
        self._waiters.setdefault(rid, set()).add(event)
        try:
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
        finally:
            waiting = self._waiters.get(rid)
            if waiting is not None:
                waiting.discard(event)
                if not waiting:
                    del self._waiters[rid]

    def _on_change(self, rid: RoundId, status: RoundStatus) -> None:
        """Called by the coordinator from any thread: wake this round's waiters on the loop."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._wake, rid)

    def _wake(self, rid: RoundId) -> None:
        for event in self._waiters.get(rid, ()):
            event.set()

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
        return stats


_REPLY_OVERHEAD = 1024
"""Room for the REPLY message around the answer body (app name, field names, lengths)."""
_ONE_ROW_OVERHEAD = len(encode_answer(RoundAnswer(rounds=[])))
"""What an answer holding nothing but an empty ``rounds`` list encodes to."""
_LIST_HEADER = 5
"""The most a msgpack array header takes."""


def _is_terminal(row: RoundRow) -> bool:
    return row.status.get("status") in ("Complete", "Failed")


def _update_cid(call: RoundCall) -> Cid:
    if call.update is None:
        raise ProtocolViolation("a submit request names no update")
    try:
        return Cid.parse(call.update)
    except InvalidCid as exc:
        raise ProtocolViolation(f"a submit request names an invalid CID: {exc.reason}") from exc


def _status_dict(coord: Coordinator, rid: RoundId) -> dict[str, float | int | str] | None:
    status = coord.status(rid)
    return None if status is None else status.to_dict()  # type: ignore[return-value]
