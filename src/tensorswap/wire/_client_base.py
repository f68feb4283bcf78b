"""What BlockClient's push and fetch paths share: the connection, the server's Welcome, a lock."""

from __future__ import annotations

import asyncio
from typing import Literal

from tensorswap.wire.connection import FrameConnection
from tensorswap.wire.errors import ProtocolViolation, RemoteError
from tensorswap.wire.messages import MAX_CIDS_PER_MESSAGE, Reply, Request, Welcome
from tensorswap.wire.transport import Transport

__all__ = ["ClientBase"]

_CIDS_PER_MESSAGE = MAX_CIDS_PER_MESSAGE  # ~2.6 MB of binary CIDs, under the message limit


class ClientBase:
    """One authenticated connection to a BlockServer, its requests run one at a time."""

    def __init__(self, conn: FrameConnection, welcome: Welcome) -> None:
        self.conn = conn
        self.welcome = welcome
        self._stream_id = 0
        self._lock = asyncio.Lock()

    @property
    def transport(self) -> Transport:
        return self.conn.transport

    def _next_stream(self) -> int:
        self._stream_id += 1
        return self._stream_id

    async def _request(
        self, app: str, body: bytes, timeout: float | Literal["read"] | None
    ) -> bytes:
        """One application request and its reply's body; the caller holds the lock."""
        stream = self._next_stream()
        await self.conn.send_message(Request(app=app, body=body), stream)
        reply, answered = await self.conn.receive_message(Reply, timeout=timeout)
        if answered != stream or reply.app != app:
            raise ProtocolViolation(
                f"Reply for {reply.app!r} on stream {answered}, expected {app!r} on {stream}"
            )
        if not reply.handled:
            msg = f"the server has no handler for application {app!r}"
            raise RemoteError("unsupported", msg, self.conn.peer)
        return reply.body
