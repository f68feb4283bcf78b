"""Byte-stream transports: one interface, TCP/TLS (asyncio BufferedProtocol) and in-memory pairs."""

from __future__ import annotations

import asyncio
import ssl as ssl_module
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import TYPE_CHECKING, Self

from tensorswap.wire.errors import (
    ConnectionFailed,
    PeerTimeout,
    TransportClosed,
    UnexpectedEof,
)

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "DIRECT_RECEIVE_BYTES",
    "MemoryTransport",
    "TcpListener",
    "TcpTransport",
    "Transport",
    "connect_tcp",
    "memory_pair",
    "serve_tcp",
]

DIRECT_RECEIVE_BYTES = 64 * 1024
"""Reads at least this large are received by the kernel straight into the caller's buffer."""

_SPILL_BYTES = 256 * 1024  # bounded read-ahead for small reads (headers, control messages)
_WRITE_HIGH_WATER = 1024 * 1024
_CLOSE_FLUSH_SECONDS = 10.0


def _byte_view(data: Buffer) -> memoryview:
    view = data if isinstance(data, memoryview) else memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class Transport(ABC):
    """A reliable, ordered, bidirectional byte stream with bounded buffering.

    Guarantees of every implementation (checked by one conformance suite):

    - ``send`` delivers its parts in order, whole, after everything sent before; it returns
      once the bytes are handed over or buffered, and waits while more than a bounded amount
      is buffered (backpressure). A cancelled ``send`` may have delivered a prefix.
    - ``receive_into`` fills the given buffer completely, or returns fewer bytes only because
      the peer ended the stream (``send_eof``/``aclose``); 0 means EOF before any byte.
      A cancelled ``receive_into`` may have consumed a prefix into the buffer: the stream is
      then out of frame sync and should be closed.
    - OS-level failures surface as ConnectionFailed; use after ``aclose`` as TransportClosed.
    - ``aclose`` flushes and closes (idempotent); ``abort`` drops the connection at once.
    """

    peer: str = ""
    bytes_sent: int = 0
    bytes_received: int = 0

    @abstractmethod
    async def send(self, *parts: Buffer) -> None:
        """Send ``parts`` back to back, in order (see the class guarantees)."""

    @abstractmethod
    async def receive_into(self, buffer: Buffer) -> int:
        """Fill ``buffer`` (writable); return its length, or fewer bytes only at EOF."""

    @abstractmethod
    async def send_eof(self) -> None:
        """Flush and half-close: the peer's reads end; this side may still receive."""

    @abstractmethod
    async def aclose(self) -> None:
        """Flush what is buffered and close; idempotent."""

    @abstractmethod
    def abort(self) -> None:
        """Close at once, discarding buffered data (the peer sees EOF or a reset)."""

    async def receive_exactly(self, buffer: Buffer, what: str = "data") -> None:
        """Fill ``buffer`` completely or raise UnexpectedEof naming ``what``."""
        view = _byte_view(buffer)
        got = await self.receive_into(view)
        if got < view.nbytes:
            raise UnexpectedEof(what, got, view.nbytes)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None and not isinstance(exc, Exception):
            self.abort()  # cancelled or interrupted: do not wait on a flush
        else:
            await self.aclose()


# ── TCP / TLS ────────────────────────────────────────────────────────────────
class _StreamProtocol(asyncio.BufferedProtocol):
    """Receives into the caller's buffer for large reads, into a bounded spill buffer otherwise."""

    def __init__(self, *, tls: bool) -> None:
        self._tls = tls
        self._spill = bytearray(_SPILL_BYTES)
        self._spill_view = memoryview(self._spill)
        self._start = 0
        self._end = 0
        self._target: memoryview | None = None
        self._filled = 0
        self._reader: asyncio.Future[None] | None = None
        self._drainer: asyncio.Future[None] | None = None
        self._reading_paused = False
        self._writing_paused = False
        self.eof = False
        self.lost = False
        self.error: BaseException | None = None
        self.transport: asyncio.Transport | None = None
        self.closed = asyncio.Event()
        self.on_connect: Callable[[_StreamProtocol], None] | None = None

    # asyncio callbacks (event loop thread)
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.set_write_buffer_limits(high=_WRITE_HIGH_WATER)
        if self.on_connect is not None:
            self.on_connect(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._target is not None:
            return self._target[self._filled :]
        if self._end == len(self._spill) and self._start:
            live = self._end - self._start
            self._spill_view[:live] = self._spill_view[self._start : self._end]
            self._start, self._end = 0, live
        return self._spill_view[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._target is not None:
            self._filled += nbytes
            if self._filled < len(self._target):
                return
            self._target = None
        else:
            self._end += nbytes
            if self._end == len(self._spill) and self._start == 0:
                self._pause_reading()
        self._wake_reader()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake_reader()
        return not self._tls  # keep the write side open after a TCP half-close

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = self.lost = True
        self.error = exc
        self.closed.set()
        self._wake_reader()
        if self._drainer is not None and not self._drainer.done():
            self._drainer.set_result(None)

    def pause_writing(self) -> None:
        self._writing_paused = True

    def resume_writing(self) -> None:
        self._writing_paused = False
        if self._drainer is not None and not self._drainer.done():
            self._drainer.set_result(None)

    # helpers
    def _wake_reader(self) -> None:
        if self._reader is not None and not self._reader.done():
            self._reader.set_result(None)

    def _pause_reading(self) -> None:
        if not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if self._reading_paused and self.transport is not None and not self.lost:
            self._reading_paused = False
            self.transport.resume_reading()

    async def _wait_reader(self) -> None:
        self._reader = asyncio.get_running_loop().create_future()
        try:
            await self._reader
        finally:
            self._reader = None

    async def receive_into(self, view: memoryview) -> int:
        total = view.nbytes
        got = 0
        while got < total:
            available = self._end - self._start
            if available:
                take = min(available, total - got)
                view[got : got + take] = self._spill_view[self._start : self._start + take]
                self._start += take
                got += take
                if self._start == self._end:
                    self._start = self._end = 0
                    self._resume_reading()
                continue
            if self.eof:
                break
            self._resume_reading()
            if total - got >= DIRECT_RECEIVE_BYTES:
                self._target, self._filled = view[got:], 0
                try:
                    await self._wait_reader()
                finally:
                    got += self._filled
                    self._target, self._filled = None, 0
            else:
                await self._wait_reader()
        return got

    async def drain(self) -> None:
        while self._writing_paused and not self.lost:
            self._drainer = asyncio.get_running_loop().create_future()
            try:
                await self._drainer
            finally:
                self._drainer = None


class TcpTransport(Transport):
    """A TCP (optionally TLS) connection; large reads land directly in the caller's buffer."""

    def __init__(self, protocol: _StreamProtocol, peer: str) -> None:
        if protocol.transport is None:
            raise RuntimeError("protocol is not connected")
        self._protocol = protocol
        self._transport = protocol.transport
        self.peer = peer
        self.bytes_sent = 0
        self.bytes_received = 0
        self._closed = False

    @property
    def ssl_object(self) -> ssl_module.SSLObject | None:
        """The TLS session, when the connection uses TLS."""
        obj = self._transport.get_extra_info("ssl_object")
        return obj if isinstance(obj, ssl_module.SSLObject) else None

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosed(self.peer)
        if self._protocol.lost:
            raise ConnectionFailed(self.peer, _describe(self._protocol.error, "connection lost"))

    async def send(self, *parts: Buffer) -> None:
        self._check_open()
        for part in parts:
            view = _byte_view(part)
            if view.nbytes:
                self._transport.write(view)
                self.bytes_sent += view.nbytes
        await self._protocol.drain()
        if self._protocol.lost:
            raise ConnectionFailed(self.peer, _describe(self._protocol.error, "connection lost"))

    async def receive_into(self, buffer: Buffer) -> int:
        if self._closed:
            raise TransportClosed(self.peer)
        view = _byte_view(buffer)
        got = await self._protocol.receive_into(view)
        self.bytes_received += got
        if got < view.nbytes and self._protocol.error is not None:
            raise ConnectionFailed(self.peer, _describe(self._protocol.error, "connection lost"))
        return got

    async def send_eof(self) -> None:
        self._check_open()
        await self._protocol.drain()
        if self._transport.can_write_eof():
            self._transport.write_eof()
        else:  # TLS cannot half-close: close the whole connection instead
            await self.aclose()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self._transport.is_closing():
            self._transport.close()
        # wait for connection_lost so that the socket is really closed (no ResourceWarning);
        # a peer that never reads would hold a flush forever, so give up after a while
        try:
            async with asyncio.timeout(_CLOSE_FLUSH_SECONDS):
                await self._protocol.closed.wait()
        except TimeoutError:
            self._transport.abort()
            await self._protocol.closed.wait()

    def abort(self) -> None:
        self._closed = True
        self._transport.abort()


def _describe(exc: BaseException | None, default: str) -> str:
    return f"{type(exc).__name__}: {exc}" if exc is not None else default


def _peer_name(transport: asyncio.BaseTransport) -> str:
    peer = transport.get_extra_info("peername")
    if isinstance(peer, tuple) and len(peer) >= 2:
        host = str(peer[0])
        return f"[{host}]:{peer[1]}" if ":" in host else f"{host}:{peer[1]}"
    return str(peer)


async def connect_tcp(
    host: str,
    port: int,
    *,
    ssl: ssl_module.SSLContext | None = None,
    server_hostname: str | None = None,
    timeout: float | None = 10.0,
) -> TcpTransport:
    """Open a TCP (TLS when ``ssl`` is given) connection within ``timeout`` seconds.

    Raises PeerTimeout when the connect (and TLS handshake) takes longer, ConnectionFailed
    for refused/unreachable peers and failed TLS handshakes.
    """
    loop = asyncio.get_running_loop()
    tls = ssl is not None
    target = f"{host}:{port}"
    try:
        async with asyncio.timeout(timeout):
            _, protocol = await loop.create_connection(
                lambda: _StreamProtocol(tls=tls),
                host,
                port,
                ssl=ssl,
                server_hostname=(server_hostname or host) if tls else None,
            )
    except TimeoutError as exc:
        raise PeerTimeout("connect", timeout or 0.0, target) from exc
    except (OSError, ssl_module.SSLError) as exc:
        raise ConnectionFailed(target, _describe(exc, "connect failed")) from exc
    assert protocol.transport is not None
    return TcpTransport(protocol, _peer_name(protocol.transport))


class TcpListener:
    """A listening TCP server; each connection runs ``handler(transport)`` in its own task.

    The task owns its transport and closes it when the handler returns or fails. ``aclose``
    stops accepting, cancels running handlers and waits for them.
    """

    def __init__(self) -> None:
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.host = ""
        self.port = 0

    @property
    def connections(self) -> int:
        """Number of connections being handled now."""
        return len(self._tasks)

    def _spawn(
        self, handler: Callable[[Transport], Awaitable[None]], proto: _StreamProtocol
    ) -> None:
        assert proto.transport is not None
        transport = TcpTransport(proto, _peer_name(proto.transport))

        async def run() -> None:
            try:
                await handler(transport)
            finally:
                await transport.aclose()

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            task.exception()  # retrieved: handlers report their own errors

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


async def serve_tcp(
    handler: Callable[[Transport], Awaitable[None]],
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    ssl: ssl_module.SSLContext | None = None,
) -> TcpListener:
    """Listen on ``host:port`` (port 0 picks a free one; see ``listener.port``)."""
    loop = asyncio.get_running_loop()
    listener = TcpListener()
    tls = ssl is not None

    def factory() -> _StreamProtocol:
        proto = _StreamProtocol(tls=tls)
        proto.on_connect = lambda p: listener._spawn(handler, p)
        return proto

    try:
        server = await loop.create_server(factory, host, port, ssl=ssl)
    except OSError as exc:
        raise ConnectionFailed(f"{host}:{port}", _describe(exc, "listen failed")) from exc
    listener._server = server
    sockname = server.sockets[0].getsockname()
    listener.host, listener.port = str(sockname[0]), int(sockname[1])
    return listener


# ── in-memory ────────────────────────────────────────────────────────────────
class _Pipe:
    """One direction of an in-memory stream: a bounded byte buffer with EOF and reset."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.buffer = bytearray()
        self.eof = False
        self.reset = False
        self.changed = asyncio.Event()

    def notify(self) -> None:
        self.changed.set()

    async def wait(self) -> None:
        self.changed.clear()
        await self.changed.wait()


class MemoryTransport(Transport):
    """One end of an in-memory stream pair (see ``memory_pair``); same guarantees as TCP."""

    def __init__(self, outgoing: _Pipe, incoming: _Pipe, peer: str) -> None:
        self._out = outgoing
        self._in = incoming
        self.peer = peer
        self.bytes_sent = 0
        self.bytes_received = 0
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosed(self.peer)
        if self._out.reset or self._in.reset:
            raise ConnectionFailed(self.peer, "connection reset by peer")
        if self._out.eof:
            raise ConnectionFailed(self.peer, "send after send_eof")

    async def send(self, *parts: Buffer) -> None:
        for part in parts:
            view = _byte_view(part)
            done = 0
            while done < view.nbytes:
                self._check_open()
                room = self._out.capacity - len(self._out.buffer)
                if room <= 0:
                    await self._out.wait()
                    continue
                take = min(room, view.nbytes - done)
                self._out.buffer += view[done : done + take]
                done += take
                self.bytes_sent += take
                self._out.notify()
        self._check_open()

    async def receive_into(self, buffer: Buffer) -> int:
        if self._closed:
            raise TransportClosed(self.peer)
        view = _byte_view(buffer)
        got = 0
        while got < view.nbytes:
            if self._in.reset:
                raise ConnectionFailed(self.peer, "connection reset by peer")
            if self._in.buffer:
                take = min(len(self._in.buffer), view.nbytes - got)
                view[got : got + take] = self._in.buffer[:take]
                del self._in.buffer[:take]
                got += take
                self.bytes_received += take
                self._in.notify()
                continue
            if self._in.eof:
                break
            await self._in.wait()
        return got

    async def send_eof(self) -> None:
        self._check_open()
        self._out.eof = True
        self._out.notify()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._out.eof = True
        self._out.notify()
        self._in.notify()

    def abort(self) -> None:
        self._closed = True
        self._out.reset = self._in.reset = True
        self._out.buffer.clear()
        self._out.notify()
        self._in.notify()


def memory_pair(capacity: int = _SPILL_BYTES) -> tuple[MemoryTransport, MemoryTransport]:
    """Two connected in-memory transports; each direction buffers at most ``capacity`` bytes."""
    if capacity < 1:
        raise ValueError(f"capacity must be positive, got {capacity}")
    a_to_b, b_to_a = _Pipe(capacity), _Pipe(capacity)
    return MemoryTransport(a_to_b, b_to_a, "memory:b"), MemoryTransport(b_to_a, a_to_b, "memory:a")
