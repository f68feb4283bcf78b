"""TCP and TLS transports on asyncio: receive into the caller's buffer, send without copies."""

from __future__ import annotations

import asyncio
import socket
import ssl as ssl_module
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Self

from tensorswap.wire.errors import ConnectionFailed, PeerTimeout, TransportClosed
from tensorswap.wire.transport import Transport, byte_view

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "DEFAULT_MAX_CONNECTIONS",
    "DIRECT_RECEIVE_BYTES",
    "DIRECT_SEND_BYTES",
    "TcpListener",
    "TcpTransport",
    "connect_tcp",
    "serve_tcp",
]

DIRECT_RECEIVE_BYTES = 64 * 1024
"""Reads at least this large are received by the kernel straight into the caller's buffer."""
DIRECT_SEND_BYTES = 64 * 1024
"""On plain TCP, parts at least this large go from the caller's buffer to the kernel."""
DEFAULT_MAX_CONNECTIONS = 1024
"""Connections a listener handles at once unless told otherwise (``serve_tcp``)."""

_SPILL_BYTES = 256 * 1024  # bounded read-ahead for small reads (headers, control messages)
_WRITE_HIGH_WATER = 1024 * 1024
_WRITE_SLICE = 256 * 1024
_CLOSE_FLUSH_SECONDS = 10.0


class _StreamProtocol(asyncio.BufferedProtocol):
    """Receives into the caller's buffer for large reads, into a bounded spill buffer otherwise."""

    def __init__(self, *, tls: bool) -> None:
        self.tls = tls
        # allocated on first use: a connection that sends nothing costs no spill buffer
        self._spill_view = memoryview(b"")
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
        if not self._spill_view.nbytes:
            self._spill_view = memoryview(bytearray(_SPILL_BYTES))
        if self._end == self._spill_view.nbytes and self._start:
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
            if self._end == self._spill_view.nbytes and self._start == 0:
                self._pause_reading()
        self._wake_reader()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake_reader()
        return not self.tls  # keep the write side open after a TCP half-close

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

    async def drain(self, *, empty: bool = False) -> None:
        """Wait while the write buffer is above its high-water mark (``empty``: until empty)."""
        if empty and self.transport is not None and self.transport.get_write_buffer_size():
            # Lower the marks to 0 for a moment: asyncio pauses us now and resumes us only
            # once everything buffered has reached the kernel.
            self.transport.set_write_buffer_limits(high=0, low=0)
            try:
                await self.drain()
            finally:
                if not self.lost:
                    self.transport.set_write_buffer_limits(high=_WRITE_HIGH_WATER)
            return
        while self._writing_paused and not self.lost:
            self._drainer = asyncio.get_running_loop().create_future()
            try:
                await self._drainer
            finally:
                self._drainer = None


class TcpTransport(Transport):
    """A TCP (optionally TLS) connection, copy-free on the hot paths.

    Large reads land directly in the caller's buffer (BufferedProtocol). On plain TCP, large
    writes go straight from the caller's buffer to the kernel (``loop.sock_sendall`` on a
    duplicate of the socket, made at the first such write, once asyncio's own write buffer
    is empty, so order is kept); asyncio's transport would copy whatever the kernel does not
    take at once.
    """

    def __init__(self, protocol: _StreamProtocol, peer: str) -> None:
        if protocol.transport is None:
            raise RuntimeError("protocol is not connected")
        self._protocol = protocol
        self._transport = protocol.transport
        self.peer = peer
        self.bytes_sent = 0
        self.bytes_received = 0
        self._closed = False
        self._direct: socket.socket | None = None  # the duplicate, made at first use
        self._sending: asyncio.Future[None] | None = None
        sock = self._transport.get_extra_info("socket")
        self._can_direct = not protocol.tls and sock is not None and sock.type == socket.SOCK_STREAM

    def _direct_socket(self) -> socket.socket:
        """The duplicate socket for direct sends (made on first use; the transport is open)."""
        if self._direct is None:
            direct = self._transport.get_extra_info("socket").dup()
            direct.setblocking(False)
            self._direct = direct
        return self._direct

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
            view = byte_view(part)
            if self._can_direct and view.nbytes >= DIRECT_SEND_BYTES:
                await self._protocol.drain(empty=True)
                self._check_open()
                await self._send_direct(self._direct_socket(), view)
            elif view.nbytes <= _WRITE_SLICE:
                self._transport.write(view)
            else:
                # In slices with backpressure between them: asyncio's TLS layer would take a
                # large buffer whole (encrypted) into its own buffers.
                for start in range(0, view.nbytes, _WRITE_SLICE):
                    self._transport.write(view[start : start + _WRITE_SLICE])
                    await self._protocol.drain()
                    self._check_open()
            self.bytes_sent += view.nbytes
        await self._protocol.drain()
        if self._protocol.lost:
            raise ConnectionFailed(self.peer, _describe(self._protocol.error, "connection lost"))

    async def _send_direct(self, sock: socket.socket, view: memoryview) -> None:
        sending = asyncio.ensure_future(asyncio.get_running_loop().sock_sendall(sock, view))
        self._sending = sending
        try:
            await sending
        except OSError as exc:
            raise ConnectionFailed(self.peer, _describe(exc, "send failed")) from exc
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self._closed and task is not None and not task.cancelling():
                raise ConnectionFailed(self.peer, "transport closed during a send") from None
            raise
        finally:
            self._sending = None

    def _close_direct(self) -> None:
        if self._sending is not None:
            # cancel first: its done-callback unregisters the socket from the event loop
            self._sending.cancel()
        if self._direct is not None:
            self._direct.close()
            self._direct = None

    async def receive_into(self, buffer: Buffer) -> int:
        if self._closed:
            raise TransportClosed(self.peer)
        view = byte_view(buffer)
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
        self._close_direct()
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
        self._close_direct()
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
    stops accepting, cancels running handlers and waits for them. At most
    ``max_connections`` are handled at once: a connection beyond them is aborted as soon as
    it is accepted (the peer sees a reset; ``refused`` counts them).
    """

    def __init__(self, *, max_connections: int = DEFAULT_MAX_CONNECTIONS) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {max_connections}")
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.host = ""
        self.port = 0
        self.max_connections = max_connections
        self.refused = 0
        """Connections aborted because ``max_connections`` were being handled."""

    @property
    def connections(self) -> int:
        """Number of connections being handled now."""
        return len(self._tasks)

    def _spawn(
        self, handler: Callable[[Transport], Awaitable[None]], proto: _StreamProtocol
    ) -> None:
        assert proto.transport is not None
        if len(self._tasks) >= self.max_connections:
            self.refused += 1
            proto.transport.abort()
            return
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
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
) -> TcpListener:
    """Listen on ``host:port`` (port 0 picks a free one; see ``listener.port``).

    At most ``max_connections`` connections are handled at once; more are aborted at once.
    """
    loop = asyncio.get_running_loop()
    listener = TcpListener(max_connections=max_connections)
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
