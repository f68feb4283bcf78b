"""BlockServer: serves a block store over tensorswap frames (offer/want, put, commit, get)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl as ssl_module
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from typing import Self

from tensorswap.cid import Cid
from tensorswap.errors import StoreError, TensorSwapError
from tensorswap.store.base import BlockStore
from tensorswap.wire._budget import (
    DEFAULT_MAX_INFLIGHT_BYTES,
    ByteBudget,
    Reservation,
    Tie,
    owner_of,
)
from tensorswap.wire._buffers import HeapTrimmer, receive_buffers
from tensorswap.wire._server_handlers import (
    AppRequest,
    BlocksReply,
    FailedConnection,
    RequestHandler,
    ServerHandlers,
)
from tensorswap.wire._server_stats import (
    _NOT_REPORTED,
    ServerStats,
    _without_frames,
    error_code,
)
from tensorswap.wire._sink import BlockSink
from tensorswap.wire.auth import busy_refusal, server_handshake
from tensorswap.wire.connection import BlockFrame, Frame, FrameConnection, Timeouts, WireLimits
from tensorswap.wire.errors import StreamEnded
from tensorswap.wire.frames import BlockPrefix, Compression, FrameHeader, FrameKind
from tensorswap.wire.messages import (
    Commit,
    Committed,
    Get,
    Message,
    Offer,
    Request,
    Want,
    parse_cids,
    wire_cids,
)
from tensorswap.wire.tcp import DEFAULT_MAX_CONNECTIONS, TcpListener, serve_tcp
from tensorswap.wire.transport import Transport

__all__ = [
    "DEFAULT_MAX_INFLIGHT_BYTES",
    "AppRequest",
    "BlockServer",
    "BlocksReply",
    "FailedConnection",
    "RequestHandler",
    "ServerStats",
    "error_code",
]

logger = logging.getLogger("tensorswap.wire")

_INLINE_OFFER = 16
"""Offers of at most this many CIDs are answered on the event loop (stat + touch each)."""


class BlockServer(ServerHandlers):
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
    kept in ``errors`` (the last 100), logged and handed to ``on_failure`` (a
    ``FailedConnection``: the client's address and handshake name, the error), if set; the
    connection is then closed. A block
    that fails its hash or CRC check is answered so at once, while the client may still be
    sending or waiting, not at its next request.

    Memory: all connections share one budget of ``max_inflight_bytes`` for the frames they
    hold between receiving and storing (``ByteBudget``). Each frame's share is reserved
    before its payload is read: its payload, plus for a compressed block the ``raw_len`` it
    claims to decompress to. A connection whose next frame does not fit stops reading until
    others' blocks are stored (TCP backpressure reaches its client); a frame that could
    never fit (more than the whole budget) is refused with ``over_budget`` and the
    connection closed. ``stats`` shows the counters.
    """

    def __init__(
        self,
        store: BlockStore,
        *,
        key: bytes | None = None,
        operator_key: bytes | None = None,
        limits: WireLimits | None = None,
        timeouts: Timeouts | None = None,
        compression: Compression = Compression.NONE,
        on_root: Callable[[Cid], None] | None = None,
        on_failure: Callable[[FailedConnection], None] | None = None,
        name: str = "tensorswap",
        store_depth: int = 4,
        handlers: Mapping[str, RequestHandler] | None = None,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
        block_crc: bool = False,
    ) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {max_connections}")
        if max_inflight_bytes < 1:
            raise ValueError(f"max_inflight_bytes must be at least 1, got {max_inflight_bytes}")
        self.store = store
        if operator_key is not None and (key is None or not operator_key or operator_key == key):
            raise ValueError("an operator key needs a shared key, and must differ from it")
        self.key = key
        self.operator_key = operator_key
        """A second secret: clients proving it are the operator (``AppRequest.operator``)."""
        self.limits = limits or WireLimits()
        self.timeouts = timeouts or Timeouts()
        self.compression = compression
        self.block_crc = block_crc
        """Keep the CRC32C of block frames both ways (by default they go without one where
        the client agrees: each block's CID is checked, which covers its bytes)."""
        self.on_root = on_root
        self.on_failure = on_failure
        self.on_stored: Callable[[Cid, memoryview], None] | None = None
        """Called ``(cid, bytes)`` on the storing thread after each received block is checked
        and stored (a rounds coordinator's cut-through); it must not raise."""
        self.name = name
        self.chunk_bytes: Callable[[], int] | None = None
        """The chunk size said to each client in its Welcome (``Welcome.chunk_bytes``)."""
        self.store_depth = store_depth
        self.handlers: dict[str, RequestHandler] = dict(handlers or {})
        """Application request handlers by app name (see ``AppRequest``)."""
        self.max_connections = max_connections
        """Clients served at once once started (``start``); see ``start`` for one more."""
        self.budget = ByteBudget(max_inflight_bytes)
        """Bytes in flight over all connections (see the class docstring)."""
        self.budget.on_idle = HeapTrimmer(_busy(self.budget))
        self._counters = ServerStats(inflight_limit_bytes=max_inflight_bytes)
        self.errors: deque[BaseException] = deque(maxlen=100)
        self.listener: TcpListener | None = None

    @property
    def stats(self) -> ServerStats:
        """The server's counters, the budget's as of now."""
        stats, budget = self._counters, self.budget
        stats.inflight_bytes = budget.in_flight
        stats.inflight_peak_bytes = budget.peak
        stats.inflight_limit_bytes = budget.limit
        stats.inflight_waits = budget.waits
        stats.inflight_refused = budget.refused
        pool = receive_buffers()
        stats.pool_in_use_bytes = pool.in_use_bytes
        stats.pool_idle_bytes = pool.idle_bytes
        stats.pool_working_set_bytes = pool.working_set_bytes
        return stats

    def serving(self, peer: str) -> bool:
        """Whether a connection from the client address ``peer`` is being served now (a
        closed or reset one is not, once the server has read its end)."""
        return self._counters.serving(peer)

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
        sink = BlockSink(self.store, self.store_depth, self.on_stored)
        client = ""
        try:
            hello = await server_handshake(
                conn,
                self.key,
                name=self.name,
                operator_key=self.operator_key,
                lean_blocks=not self.block_crc,
                chunk_bytes=0 if self.chunk_bytes is None else self.chunk_bytes(),
            )
            client = hello.client
            await self._serve_watched(conn, sink)
        except (TensorSwapError, OSError) as exc:
            self._failed(exc, transport, client)
            if isinstance(exc, TensorSwapError) and not isinstance(exc, _NOT_REPORTED):
                await self._report(conn, error_code(exc), str(exc))
        except Exception as exc:  # a bug (ours or a handler's): never lost silently
            self._failed(exc, transport, client, unexpected=True)
            await self._report(conn, "internal", f"internal server error: {type(exc).__name__}")
        finally:
            self.stats.ended(transport)
            await sink.close()
            self.stats.blocks_stored += sink.blocks
            self.stats.bytes_stored += sink.nbytes

    def _failed(
        self, exc: BaseException, transport: Transport, client: str, *, unexpected: bool = False
    ) -> None:
        self.stats.failed_connections += 1
        if unexpected:
            logger.error("connection from %s failed: %r", transport.peer, exc, exc_info=exc)
        else:
            logger.warning("connection from %s failed: %s", transport.peer, exc)
        error = _without_frames(exc)
        self.errors.append(error)
        if self.on_failure is not None:
            try:
                self.on_failure(FailedConnection(transport.peer, client, error))
            except Exception as bug:  # the hook's own bug: logged, the connection still ends
                logger.error("on_failure hook failed: %r", bug, exc_info=bug)

    @staticmethod
    async def _report(conn: FrameConnection, code: str, message: str) -> None:
        """Best effort: tell the peer why the connection ends (an ERROR frame, 1 s at most)."""
        with contextlib.suppress(TensorSwapError, OSError):
            async with asyncio.timeout(1.0):
                await conn.send_error(code, message)

    async def _serve_watched(self, conn: FrameConnection, sink: BlockSink) -> None:
        """``_serve``, interrupted as soon as a received block fails its checks (the failure
        is raised then, not when the connection next waits on the sink)."""
        serving = asyncio.ensure_future(self._serve(conn, sink))
        failed = asyncio.ensure_future(sink.failed.wait())
        try:
            await asyncio.wait([serving, failed], return_when=asyncio.FIRST_COMPLETED)
        finally:
            failed.cancel()
            if not serving.done():
                serving.cancel()
                await asyncio.wait([serving])
            if not serving.cancelled():
                serving.exception()  # retrieved: raised below, or superseded by a cancel
        error = None if serving.cancelled() else serving.exception()
        del serving, failed  # raised below, a failure's traceback holds this frame: no cycle
        if error is not None:
            try:
                raise error  # its own failure, if it ended first
            finally:
                error = None
        if sink.failed.is_set():
            await sink.drain()  # raises the block's failure

    async def _receive(
        self, conn: FrameConnection, sink: BlockSink, in_transfer: bool
    ) -> tuple[Message, int] | None:
        """The next control message (and its stream id); a block is handed to ``sink``
        instead (None). Every frame holds its share of ``self.budget`` from before its
        payload is allocated for exactly as long as that memory exists: a block's payload
        and its decompressed bytes are each tied to the buffer holding them (``Tie``), so
        they count until freed (or until stored), whatever ends the connection meanwhile."""
        reservation: Reservation | None = None
        payload: Tie | None = None

        async def admit(header: FrameHeader, prefix: BlockPrefix | None) -> None:
            nonlocal reservation
            need, what = _needed(header, prefix)
            reservation = await self.budget.reserve(need, what)

        def allocated(buffer: memoryview) -> None:
            nonlocal payload
            if reservation is not None:  # the payload's share follows its buffer from now on
                payload = reservation.tie(owner_of(buffer), buffer.nbytes)

        frame: Frame | None = None
        block: BlockFrame | None = None
        try:
            frame = await conn.receive_frame(
                timeout="read" if in_transfer else "idle",
                defer_block_crc=True,
                admit=admit,
                allocated=allocated,
            )
            if frame.header.kind is not FrameKind.BLOCK:
                return conn.expect(frame, Offer, Commit, Get, Request), frame.header.stream_id
            raw = None
            if reservation is not None and frame.header.compression is not Compression.NONE:
                raw = reservation.tie()  # the decompressed bytes, tied once they exist
            block = await _parse_block(conn, frame, raw)
            frame = None  # the compressed payload goes (and its share with it) while stored
            await sink.submit(block, raw or payload)
            return None
        finally:
            frame = block = None  # a traceback keeps this frame: it must not keep the bytes too
            if reservation is not None:
                reservation.release()

    async def _serve(self, conn: FrameConnection, sink: BlockSink) -> None:
        in_transfer = False
        while True:
            try:
                received = await self._receive(conn, sink, in_transfer)
            except StreamEnded:
                return
            if received is None:  # a block, now with the sink
                continue
            message, stream_id = received
            if isinstance(message, Offer):
                offered = parse_cids(message.cids, "Offer")
                if len(offered) <= _INLINE_OFFER:  # a few stat calls: no thread hop
                    lacking = _missing_and_touch(self.store, offered)
                else:
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
                cids = parse_cids(message.cids, "Get")
                below = "closure" if message.closure else "manifests" if message.manifests else ""
                have = parse_cids(message.have, "Get have") if message.closure else []
                await self._answer_get(conn, cids, stream_id, below=below, have=have)
            elif isinstance(message, Request):
                await sink.drain()
                reply, then = await self._answer_request(
                    message, conn.peer, stream_id, operator=conn.operator
                )
                await conn.send_message(reply, stream_id)
                if then is not None:
                    await self._answer_get(
                        conn, then.roots, stream_id, below="closure", have=then.have
                    )
                in_transfer = False


def _busy(budget: ByteBudget) -> Callable[[], bool]:
    """Whether ``budget`` has bytes in flight, without keeping it alive (the budget holds the
    trimmer that asks: a strong reference would make a cycle, and a server dropped with its
    store would wait for the garbage collector to free them)."""
    ref = weakref.ref(budget)

    def busy() -> bool:
        alive = ref()
        return alive is not None and alive.in_flight > 0

    return busy


def _needed(header: FrameHeader, prefix: BlockPrefix | None) -> tuple[int, str]:
    """The budget bytes a frame holds at its peak, and what they are, for OverBudget."""
    if prefix is None or header.compression is Compression.NONE:
        return header.payload_len, f"a {header.kind.name} frame ({header.payload_len} bytes)"
    need = header.payload_len + prefix.raw_len
    what = f"a {header.compression.name} BLOCK ({header.payload_len} bytes, raw_len "
    return need, what + f"{prefix.raw_len})"


async def _parse_block(conn: FrameConnection, frame: Frame, raw: Tie | None) -> BlockFrame:
    """``conn.parse_block(frame)``, a compressed one in a worker thread (decompression is
    CPU work). ``raw``, the budget share of the decompressed bytes, follows them as soon as
    the thread returns (an error comes back without the frames that held them, so its
    share goes back at once), even if the caller was cancelled meanwhile: those bytes count
    until they are freed."""
    if frame.header.compression is Compression.NONE:
        return conn.parse_block(frame)
    loop = asyncio.get_running_loop()
    try:
        parsing = loop.run_in_executor(None, _parse_bare, conn, frame)
    except BaseException:  # no thread to run it (the loop shutting down): nothing made
        if raw is not None:
            raw.release()
        raise
    if raw is not None:
        parsing.add_done_callback(partial(_follow, raw))
    try:
        return await asyncio.shield(parsing)
    except asyncio.CancelledError:
        try:
            await asyncio.wait([parsing])
            if not parsing.cancelled():
                parsing.exception()  # retrieved: superseded by the cancel
        finally:
            del parsing, frame  # the traceback keeps this frame, not the bytes
        raise
    except BaseException:
        del parsing, frame  # as above (and no cycle through the failed future)
        raise


def _parse_bare(conn: FrameConnection, frame: Frame) -> BlockFrame:
    """``conn.parse_block(frame)`` on a worker thread; an error leaves it without its
    traceback (and those of the errors chained to it), whose frames would hold the
    decompressed buffer after the share for it went back: the buffer is freed here."""
    try:
        return conn.parse_block(frame)
    except BaseException as exc:
        seen: set[int] = set()
        error: BaseException | None = exc
        while error is not None and id(error) not in seen:
            seen.add(id(error))
            error.__traceback__ = None
            chained = error.__cause__ or error.__context__
            error = chained
        raise exc.with_traceback(None) from exc.__cause__


def _follow(raw: Tie, done: asyncio.Future[BlockFrame]) -> None:
    """The decompressed bytes' share follows what holds them once the parse is done."""
    if done.cancelled() or done.exception() is not None:
        raw.release()  # nothing holds them: an error comes back without its frames
    else:
        raw.follow(owner_of(done.result().data))


def _missing_and_touch(store: BlockStore, offered: list[Cid]) -> list[Cid]:
    """The offered blocks ``store`` lacks. The held ones are touched first, so every block
    reported held was touched while held: a collection with a grace period spares it while
    the client goes on to reference it. A failed touch only costs that protection."""
    try:
        store.touch(offered)
    except StoreError as exc:
        logger.warning("cannot refresh the age of offered blocks: %s", exc)
    return store.missing(offered)
