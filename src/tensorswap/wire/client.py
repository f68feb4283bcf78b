"""BlockClient: push tensors/updates to a BlockServer with dedup and resume; fetch blocks back."""

from __future__ import annotations

import ssl as ssl_module
from typing import Literal, Self

from tensorswap.wire._client_fetch import FetchPath, PullResult
from tensorswap.wire._client_push import Progress, PushPath, PushResult
from tensorswap.wire.auth import client_handshake
from tensorswap.wire.connection import FrameConnection, Timeouts, WireLimits
from tensorswap.wire.frames import CompressionChoice
from tensorswap.wire.messages import Welcome
from tensorswap.wire.tcp import connect_tcp
from tensorswap.wire.transport import Transport

__all__ = ["BlockClient", "CompressionChoice", "Progress", "PullResult", "PushResult"]


async def _handshake(
    transport: Transport,
    key: bytes | None,
    limits: WireLimits | None,
    timeouts: Timeouts | None,
    name: str,
    block_crc: bool,
) -> tuple[FrameConnection, Welcome]:
    """The client's handshake on ``transport``; on failure the transport is aborted."""
    conn = FrameConnection(transport, limits=limits, timeouts=timeouts)
    try:
        welcome = await client_handshake(conn, key, name=name, lean_blocks=not block_crc)
    except BaseException:
        transport.abort()
        raise
    return conn, welcome


class BlockClient(PushPath, FetchPath):
    """One authenticated connection to a BlockServer; requests run one at a time.

    Open with ``await BlockClient.connect(...)`` (TCP/TLS) or ``await BlockClient.open(t)``
    (any Transport); close with ``aclose`` or ``async with``.

    Cancelling a call (``asyncio.timeout``, ``wait_for``, a task's cancel) at any await point
    leaves the connection usable: the answers it did not read are read and dropped by the
    next call before its own request (counted in ``exchange_stats``); no partial frame is
    left behind. The server may still have acted on a request whose answer was dropped (a
    block stored, a submit accepted). Where a send was cut inside a frame, where a wire error
    came inside an answer, or where the answer owed is a wait's (it may take long), the
    connection is given up: the next call reconnects (a client from ``connect``; a push
    resumes where it stopped) or raises ConnectionBroken (one from ``open``).
    """

    @classmethod
    async def open(
        cls,
        transport: Transport,
        *,
        key: bytes | None = None,
        limits: WireLimits | None = None,
        timeouts: Timeouts | None = None,
        name: str = "tensorswap",
        block_crc: bool = False,
    ) -> Self:
        """Run the handshake on ``transport``; on failure the transport is aborted.

        Such a client cannot dial again: once its connection is broken (see the class
        docstring) its calls raise ConnectionBroken. ``block_crc`` as for ``connect``.
        """
        conn, welcome = await _handshake(transport, key, limits, timeouts, name, block_crc)
        return cls(conn, welcome)

    @classmethod
    async def connect(
        cls,
        host: str,
        port: int,
        *,
        key: bytes | None = None,
        ssl: ssl_module.SSLContext | None = None,
        server_hostname: str | None = None,
        limits: WireLimits | None = None,
        timeouts: Timeouts | None = None,
        name: str = "tensorswap",
        block_crc: bool = False,
    ) -> Self:
        """Connect (within ``timeouts.connect``), then authenticate (``timeouts.handshake``).

        ``name``: this client's name in its handshake (the server's ``FailedConnection``
        shows it). A broken connection (see the class docstring) is replaced the same way by
        the next call. Blocks travel without a CRC32C in their frames where both sides agree
        (their CIDs are checked on receipt, which covers every byte); ``block_crc=True``
        keeps it, both ways, for those who want both checks."""
        timeouts = timeouts or Timeouts()

        async def dial() -> tuple[FrameConnection, Welcome]:
            transport = await connect_tcp(
                host, port, ssl=ssl, server_hostname=server_hostname, timeout=timeouts.connect
            )
            return await _handshake(transport, key, limits, timeouts, name, block_crc)

        client = cls(*await dial())
        client.redial = dial
        return client

    async def aclose(self) -> None:
        self.exchanges.close()
        await self.conn.transport.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc is not None and not isinstance(exc, Exception):
            self.exchanges.close()
            self.conn.transport.abort()
        else:
            await self.aclose()

    # ── application requests ─────────────────────────────────────────────────
    async def request(
        self,
        app: str,
        body: bytes,
        *,
        timeout: float | Literal["read"] | None = "read",
    ) -> bytes:
        """Send a request to the server's handler for ``app``; return its reply body.

        Every block sent on this connection before the request is stored on the server
        before its handler runs, so a request may name blocks just pushed. ``timeout``
        bounds the wait for the reply (default ``Timeouts.read``; None waits forever).
        Raises RemoteError with code ``unsupported`` when the server has no handler for
        ``app`` (the connection stays usable), RemoteError for an Error frame (the server
        then closes the connection), PeerTimeout or ProtocolViolation (the connection is
        then broken: the next call reconnects or raises ConnectionBroken). Cancelled, the
        request may still be handled there; its reply is dropped by the next call.
        """
        async with self._exchange():
            return await self._request(app, body, timeout)
