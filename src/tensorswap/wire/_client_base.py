"""What BlockClient's push and fetch paths share: the connection, its exchanges, a lock."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Literal

from tensorswap.wire._exchange import Exchanges, ExchangeStats
from tensorswap.wire.connection import FrameConnection
from tensorswap.wire.errors import ConnectionBroken, ProtocolViolation, RemoteError
from tensorswap.wire.frames import FrameKind
from tensorswap.wire.messages import MAX_CIDS_PER_MESSAGE, Reply, Request, Welcome
from tensorswap.wire.transport import Transport

__all__ = ["ClientBase", "Redial"]

_CIDS_PER_MESSAGE = MAX_CIDS_PER_MESSAGE  # ~2.6 MB of binary CIDs, under the message limit

Redial = Callable[[], Awaitable[tuple[FrameConnection, Welcome]]]
"""Opens and authenticates a new connection to the same server, as the first was."""


class ClientBase:
    """One authenticated connection to a BlockServer, its requests run one at a time.

    Each public call is one exchange (``_exchange``): it begins on a connection in sync
    (answers owed to cancelled calls dropped first, or a new connection) and, if it ends
    early, leaves its unread answers owed or the connection broken (``wire._exchange``).
    """

    def __init__(self, conn: FrameConnection, welcome: Welcome) -> None:
        self.conn = conn
        self.welcome = welcome
        self.exchange_stats = ExchangeStats()
        """Calls cancelled with answers owed, frames dropped, connections broken, reconnects."""
        self.exchanges = Exchanges(conn, self.exchange_stats)
        self.redial: Redial | None = None
        """Set by ``BlockClient.connect``: how a broken connection is replaced."""
        self._lock = asyncio.Lock()
        self._sent_before = 0  # bytes sent on the connections replaced

    @property
    def transport(self) -> Transport:
        return self.conn.transport

    @property
    def bytes_sent(self) -> int:
        """Every byte this client sent, over all its connections."""
        return self._sent_before + self.conn.transport.bytes_sent

    def _next_stream(self) -> int:
        return self.exchanges.next_stream()

    def _exchange(self) -> _Held:
        """``async with self._exchange() as ex``: the lock, and the connection ready."""
        return _Held(self)

    async def _ready(self) -> Exchanges:
        """The connection ready for a new exchange (the lock held): the answers owed to
        cancelled calls read and dropped, or, when one of them is a wait's or the connection
        is broken, a new connection (ConnectionBroken when there is no ``redial``)."""
        ex = self.exchanges
        if not ex.clean and ex.broken is None:
            if ex.owes_wait and self.redial is not None:
                ex.fail("a wait was cancelled: reconnecting beats waiting for its answer")
            else:
                try:
                    await ex.settle()
                except Exception as exc:
                    ex.fail(f"{type(exc).__name__} in an answer owed to a cancelled call")
                    if self.redial is None:
                        raise ConnectionBroken(self.conn.peer, ex.broken or "") from exc
        if ex.broken is None:
            return ex
        if self.redial is None:
            raise ConnectionBroken(self.conn.peer, ex.broken)
        conn, welcome = await self.redial()
        self._sent_before += self.conn.transport.bytes_sent
        self.conn, self.welcome = conn, welcome
        self.exchanges = Exchanges(conn, self.exchange_stats)
        self.exchange_stats.reconnects += 1
        return self.exchanges

    async def _request(
        self,
        app: str,
        body: bytes,
        timeout: float | Literal["read"] | None,
        *,
        then_blocks: bool = False,
    ) -> bytes:
        """One application request and its reply's body; within an exchange."""
        ex = self.exchanges
        stream = ex.next_stream()
        await self.conn.send_message(Request(app=app, body=body), stream)
        ex.expect(stream, FrameKind.REPLY, timeout, then_blocks=then_blocks)
        reply = await ex.message(Reply, timeout)
        if reply.app != app:
            raise ProtocolViolation(f"Reply for {reply.app!r} on stream {stream}, asked {app!r}")
        if not reply.handled:
            msg = f"the server has no handler for application {app!r}"
            raise RemoteError("unsupported", msg, self.conn.peer)
        return reply.body


class _Held:
    """One exchange: the client's lock held, its connection ready; on an early end (a
    cancel, an error) the exchanges are told (``Exchanges.abandon``)."""

    __slots__ = ("client", "ex")

    def __init__(self, client: ClientBase) -> None:
        self.client = client

    async def __aenter__(self) -> Exchanges:
        client = self.client
        await client._lock.acquire()
        try:
            ex = client.exchanges
            if not ex.clean:
                ex = await client._ready()
        except BaseException:
            client._lock.release()
            raise
        self.ex = ex
        return ex

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if exc is not None:
                self.ex.abandon(exc)
        finally:
            self.client._lock.release()
