"""BlockServer: serves a block store over tensorswap frames (offer/want, put, commit, get)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl as ssl_module
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Self

from tensorswap.cid import Cid
from tensorswap.errors import BlockNotFound, StoreError, TensorSwapError
from tensorswap.store.base import BlockStore
from tensorswap.store.manifest import manifest_closure
from tensorswap.wire._pipeline import prefetched
from tensorswap.wire._sink import BlockSink
from tensorswap.wire.auth import busy_refusal, server_handshake
from tensorswap.wire.connection import (
    FrameConnection,
    PreparedBlock,
    Timeouts,
    WireLimits,
    prepare_block,
)
from tensorswap.wire.errors import (
    AuthenticationFailed,
    BlockHashMismatch,
    ChecksumMismatch,
    ConnectionFailed,
    FrameTooLarge,
    PeerTimeout,
    ProtocolViolation,
    StreamEnded,
    TransportClosed,
)
from tensorswap.wire.frames import Compression, FrameKind
from tensorswap.wire.messages import (
    Commit,
    Committed,
    Get,
    Got,
    Offer,
    Reply,
    Request,
    Want,
    parse_cids,
    wire_cids,
)
from tensorswap.wire.tcp import DEFAULT_MAX_CONNECTIONS, TcpListener, serve_tcp
from tensorswap.wire.transport import Transport

__all__ = ["AppRequest", "BlockServer", "RequestHandler", "ServerStats", "error_code"]

logger = logging.getLogger("tensorswap.wire")


@dataclass
class ServerStats:
    """Counters over the server's lifetime (mutated by the event loop only).

    ``bytes_in`` / ``bytes_out``: wire bytes over every connection so far, open ones included.
    """

    connections: int = 0
    blocks_stored: int = 0
    bytes_stored: int = 0
    roots_committed: int = 0
    blocks_served: int = 0
    failed_connections: int = 0
    requests: int = 0
    ended_bytes_in: int = 0
    ended_bytes_out: int = 0

    def __post_init__(self) -> None:
        self._open: set[Transport] = set()

    def opened(self, transport: Transport) -> None:
        """Count a connection that is now being served."""
        self.connections += 1
        self._open.add(transport)

    def ended(self, transport: Transport) -> None:
        """Count a served connection's end; its bytes move to ``ended_bytes_*``."""
        self._open.discard(transport)
        self.ended_bytes_in += transport.bytes_received
        self.ended_bytes_out += transport.bytes_sent

    @property
    def open_connections(self) -> int:
        return len(self._open)

    @property
    def bytes_in(self) -> int:
        return self.ended_bytes_in + sum(t.bytes_received for t in self._open)

    @property
    def bytes_out(self) -> int:
        return self.ended_bytes_out + sum(t.bytes_sent for t in self._open)


@dataclass(frozen=True, slots=True)
class AppRequest:
    """An application request (a REQUEST frame) as its handler receives it."""

    app: str
    """The application name the client addressed (the key in ``BlockServer.handlers``)."""
    body: bytes
    """The request body, opaque to the wire layer (untrusted: the handler validates it)."""
    peer: str
    """The client's address, for logs and errors."""
    stream_id: int


RequestHandler = Callable[[AppRequest], Awaitable[bytes]]
"""``async handler(request) -> reply body``. A TensorSwapError it raises fails the connection
(ERROR frame, then closed); answer refusals the client should survive inside the reply body."""


_NOT_REPORTED = (AuthenticationFailed, StreamEnded, ConnectionFailed, TransportClosed)
"""Failures not answered with an ERROR frame: the handshake already told the client, or the
connection no longer works."""


def error_code(exc: BaseException) -> str:
    """The Error-message code a failure is reported to the peer with."""
    for kind, code in _CODES:
        if isinstance(exc, kind):
            return code
    return "internal"


_CODES: Sequence[tuple[type[BaseException], str]] = (
    (AuthenticationFailed, "auth_failed"),
    (BlockHashMismatch, "block_hash_mismatch"),
    (ChecksumMismatch, "checksum_mismatch"),
    (FrameTooLarge, "frame_too_large"),
    (ProtocolViolation, "protocol_violation"),
    (PeerTimeout, "timeout"),
    (StoreError, "store_error"),
    (TensorSwapError, "error"),
)


class BlockServer:
    """Serves ``store`` to clients: they learn what it lacks, send blocks, commit roots, fetch.

    Per connection, after the handshake (``key`` set: mutual HMAC proof, else refused and
    nothing read or stored), requests are answered in order:

    - Offer -> Want: the offered CIDs the store lacks.
    - BLOCK frames: CRC32C checked on arrival, then hash-checked and stored in arrival order
      by a worker thread (bounded); a block that arrived whole stays stored even if the
      connection breaks later, so a retry only sends what is still missing.
    - Commit -> Committed, once every block is stored and each root's closure is complete;
      ``on_root(root)`` is called for each root then.
    - Get -> BLOCK frames for the CIDs held, then Got naming those not held.
    - Request -> Reply: once every block received before it is stored, the handler
      registered for its ``app`` in ``handlers`` answers it; an unknown app gets a Reply
      with ``handled=False`` and the connection goes on. Requests on one connection are
      answered one at a time, in order.

    A failure is answered with an Error frame (when the connection still works), counted,
    kept in ``errors`` (the last 100) and logged; the connection is then closed.
    """

    def __init__(
        self,
        store: BlockStore,
        *,
        key: bytes | None = None,
        limits: WireLimits | None = None,
        timeouts: Timeouts | None = None,
        compression: Compression = Compression.NONE,
        on_root: Callable[[Cid], None] | None = None,
        name: str = "tensorswap",
        store_depth: int = 4,
        handlers: Mapping[str, RequestHandler] | None = None,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
    ) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {max_connections}")
        self.store = store
        self.key = key
        self.limits = limits or WireLimits()
        self.timeouts = timeouts or Timeouts()
        self.compression = compression
        self.on_root = on_root
        self.name = name
        self.store_depth = store_depth
        self.handlers: dict[str, RequestHandler] = dict(handlers or {})
        """Application request handlers by app name (see ``AppRequest``)."""
        self.max_connections = max_connections
        """Clients served at once once started (``start``); see ``start`` for one more."""
        self.stats = ServerStats()
        self.errors: deque[BaseException] = deque(maxlen=100)
        self.listener: TcpListener | None = None

    # ── lifecycle ────────────────────────────────────────────────────────────
    async def start(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        ssl: ssl_module.SSLContext | None = None,
        handler: Callable[[Transport], Awaitable[None]] | None = None,
    ) -> Self:
        """Listen on ``host:port`` (TLS with ``ssl``); the bound port is ``self.port``.

        At most ``self.max_connections`` clients are served at once; one more closes the
        connection idle the longest, or is refused with ``ERROR busy`` (``ServerBusy`` on
        the client) when none has been idle for ``DEFAULT_MIN_IDLE`` seconds (see wire.md).
        Each connection is served by ``handler`` (default ``self.handle``; a service that
        wraps this server passes its own, which ends in ``self.handle``).
        """
        self.listener = await serve_tcp(
            handler or self.handle,
            host,
            port,
            ssl=ssl,
            max_connections=self.max_connections,
            on_refused=busy_refusal(self.max_connections),
        )
        return self

    @property
    def port(self) -> int:
        if self.listener is None:
            raise RuntimeError("server not started")
        return self.listener.port

    async def aclose(self) -> None:
        """Stop listening and cancel the connections being served."""
        if self.listener is not None:
            await self.listener.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # ── one connection ───────────────────────────────────────────────────────
    async def handle(self, transport: Transport) -> None:
        """Serve one connection until the client closes it; never raises a wire error.

        The transport is left open for the caller to close.
        """
        self.stats.opened(transport)
        conn = FrameConnection(transport, limits=self.limits, timeouts=self.timeouts)
        sink = BlockSink(self.store, self.store_depth)
        try:
            await server_handshake(conn, self.key, name=self.name)
            await self._serve(conn, sink)
        except (TensorSwapError, OSError) as exc:
            self._failed(exc, transport)
            if isinstance(exc, TensorSwapError) and not isinstance(exc, _NOT_REPORTED):
                await self._report(conn, error_code(exc), str(exc))
        except Exception as exc:  # a bug (ours or a handler's): never lost silently
            self._failed(exc, transport, unexpected=True)
            await self._report(conn, "internal", f"internal server error: {type(exc).__name__}")
        finally:
            self.stats.ended(transport)
            await sink.close()
            self.stats.blocks_stored += sink.blocks
            self.stats.bytes_stored += sink.nbytes

    def _failed(
        self, exc: BaseException, transport: Transport, *, unexpected: bool = False
    ) -> None:
        self.stats.failed_connections += 1
        self.errors.append(exc)
        if unexpected:
            logger.error("connection from %s failed: %r", transport.peer, exc, exc_info=exc)
        else:
            logger.warning("connection from %s failed: %s", transport.peer, exc)

    @staticmethod
    async def _report(conn: FrameConnection, code: str, message: str) -> None:
        """Best effort: tell the peer why the connection ends (an ERROR frame, 1 s at most)."""
        with contextlib.suppress(TensorSwapError, OSError):
            async with asyncio.timeout(1.0):
                await conn.send_error(code, message)

    async def _serve(self, conn: FrameConnection, sink: BlockSink) -> None:
        in_transfer = False
        while True:
            try:
                frame = await conn.receive_frame(
                    timeout="read" if in_transfer else "idle", defer_block_crc=True
                )
            except StreamEnded:
                return
            stream_id = frame.header.stream_id
            if frame.header.kind is FrameKind.BLOCK:
                await sink.submit(conn.parse_block(frame))
                continue
            message = conn.expect(frame, Offer, Commit, Get, Request)
            if isinstance(message, Offer):
                offered = parse_cids(message.cids, "Offer")
                lacking = await asyncio.to_thread(_missing_and_touch, self.store, offered)
                queued = sink.queued  # arrived and being stored: not wanted again
                lacking = [cid for cid in lacking if cid not in queued]
                await conn.send_message(Want(cids=wire_cids(lacking)), stream_id)
                in_transfer = bool(lacking)
            elif isinstance(message, Commit):
                roots = list(dict.fromkeys(parse_cids(message.roots, "Commit")))
                await sink.drain()
                await asyncio.to_thread(self._check_roots, roots)
                await conn.send_message(
                    Committed(roots=message.roots, blocks=sink.blocks, nbytes=sink.nbytes),
                    stream_id,
                )
                self.stats.roots_committed += len(roots)
                in_transfer = False
                if self.on_root is not None:
                    for root in roots:
                        self.on_root(root)
            elif isinstance(message, Get):
                await self._answer_get(conn, parse_cids(message.cids, "Get"), stream_id)
            elif isinstance(message, Request):
                await sink.drain()
                reply = await self._answer_request(message, conn.peer, stream_id)
                await conn.send_message(reply, stream_id)
                in_transfer = False

    async def _answer_request(self, message: Request, peer: str, stream_id: int) -> Reply:
        self.stats.requests += 1
        handler = self.handlers.get(message.app)
        if handler is None:
            return Reply(app=message.app, body=b"", handled=False)
        body = await handler(AppRequest(message.app, message.body, peer, stream_id))
        return Reply(app=message.app, body=bytes(body))

    def _check_roots(self, roots: list[Cid]) -> None:
        """Check that each root's closure is held: one walk over all of them, so a block
        (and a manifest's decoding) shared by several roots is visited once."""
        seen: set[Cid] = set()
        for root in roots:
            try:  # the part of root's closure not checked for an earlier root
                added = manifest_closure(self.store, root, seen=seen)
            except BlockNotFound as exc:
                msg = f"committed root {root} lacks block {exc.cid}"
                raise ProtocolViolation(msg) from exc
            lacking = self.store.missing(added)
            if lacking:
                raise ProtocolViolation(
                    f"committed root {root} lacks {len(lacking)} blocks, first {lacking[0]}"
                )

    async def _answer_get(self, conn: FrameConnection, cids: list[Cid], stream_id: int) -> None:
        missing: list[Cid] = []

        def load(cid: Cid) -> PreparedBlock | None:
            try:
                data = self.store.get(cid)
            except BlockNotFound:
                return None
            return prepare_block(cid, data, self.compression, stream_id)

        async with contextlib.aclosing(prefetched(cids, load, 2)) as blocks:
            index = 0
            async for block in blocks:
                if block is None:
                    missing.append(cids[index])
                else:
                    await conn.send_prepared(block)
                    self.stats.blocks_served += 1
                index += 1
        await conn.send_message(Got(missing=wire_cids(missing)), stream_id)


def _missing_and_touch(store: BlockStore, offered: list[Cid]) -> list[Cid]:
    """The offered blocks ``store`` lacks. The held ones are touched first, so every block
    reported held was touched while held: a collection with a grace period spares it while
    the client goes on to reference it. A failed touch only costs that protection."""
    try:
        store.touch(offered)
    except StoreError as exc:
        logger.warning("cannot refresh the age of offered blocks: %s", exc)
    return store.missing(offered)
