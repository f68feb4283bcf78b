"""TCP and TLS transports on asyncio: receive into the caller's buffer, send without copies."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl as ssl_module
from typing import TYPE_CHECKING

from tensorswap.transport._stream import DIRECT_RECEIVE_BYTES, StreamProtocol
from tensorswap.transport.base import Transport, byte_view
from tensorswap.transport.errors import ConnectionFailed, PeerTimeout, TransportClosed

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "DIRECT_RECEIVE_BYTES",
    "DIRECT_SEND_BYTES",
    "TcpTransport",
    "connect_tcp",
]

DIRECT_SEND_BYTES = 64 * 1024
"""On plain TCP, parts at least this large go from the caller's buffer to the kernel."""

_WRITE_SLICE = 256 * 1024
_CLOSE_FLUSH_SECONDS = 10.0


_COALESCE_BYTES = 64 * 1024
"""Parts of one send totalling at most this are written together (one system call)."""


class TcpTransport(Transport):
    """A TCP (optionally TLS) connection, copy-free on the hot paths.

    Large reads land directly in the caller's buffer (BufferedProtocol). On plain TCP, large
    writes go straight from the caller's buffer to the kernel (``loop.sock_sendall`` on a
    duplicate of the socket, made at the first such write, once asyncio's own write buffer
    is empty, so order is kept); asyncio's transport would copy whatever the kernel does not
    take at once.
    """

    def __init__(self, protocol: StreamProtocol, peer: str) -> None:
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
    def direct_open(self) -> bool:
        """Whether this connection holds its duplicate socket for large sends (one file
        descriptor more; made by the first send of at least DIRECT_SEND_BYTES)."""
        return self._direct is not None

    @property
    def ssl_object(self) -> ssl_module.SSLObject | None:
        """The TLS session, when the connection uses TLS."""
        obj = self._transport.get_extra_info("ssl_object")
        return obj if isinstance(obj, ssl_module.SSLObject) else None

    @property
    def congestion_control(self) -> str:
        """The TCP congestion control algorithm of this connection ("" if unknown)."""
        sock = self._transport.get_extra_info("socket")
        if sock is None or not hasattr(socket, "TCP_CONGESTION"):
            return ""
        try:
            raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16)
        except OSError:
            return ""
        return bytes(raw).split(b"\0", 1)[0].decode("ascii", "replace")

    def set_congestion_control(self, algorithm: str) -> bool:
        """Use ``algorithm`` (``cubic``, ``bbr``, ...) for what this connection sends from now
        on (Linux ``TCP_CONGESTION``); whether the kernel took it. It refuses one it lacks,
        and one outside ``net.ipv4.tcp_allowed_congestion_control`` unless the process has
        CAP_NET_ADMIN; the connection then keeps the system's default."""
        sock = self._transport.get_extra_info("socket")
        if sock is None or not hasattr(socket, "TCP_CONGESTION"):
            return False
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, algorithm.encode())
        except OSError:
            return False
        return True

    @property
    def idle_since(self) -> float | None:
        """When this connection went idle, by its listener's clock; None while not idle.

        Idle: the reader waits for bytes with nothing received for its read and nothing
        buffered, outside ``busy()``. Tracked only for connections a TcpListener accepted.
        """
        return self._protocol.idle_since

    @property
    def peer_closed(self) -> bool:
        """The peer half-closed (EOF) or the connection was lost: sends may no longer arrive."""
        return self._protocol.eof

    @property
    def write_buffer_size(self) -> int:
        """Bytes handed to ``send`` that the kernel has not taken yet."""
        return 0 if self._protocol.lost else self._transport.get_write_buffer_size()

    def busy(self) -> contextlib.AbstractContextManager[None]:
        return _Busy(self._protocol)

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosed(self.peer)
        if self._protocol.lost:
            raise ConnectionFailed(self.peer, describe(self._protocol.error, "connection lost"))

    async def send(self, *parts: Buffer) -> None:
        self._check_open()
        views = [byte_view(part) for part in parts]
        if len(parts) > 1:
            total = sum(view.nbytes for view in views)
            if total <= _COALESCE_BYTES:  # a frame header and a small payload: one write
                self._transport.writelines(views)
                self.bytes_sent += total
                await self._protocol.drain()
                if self._protocol.lost:
                    raise ConnectionFailed(
                        self.peer, describe(self._protocol.error, "connection lost")
                    )
                return
        lead = _lead(views) if self._can_direct else 0
        if lead:  # a frame's header and prefix go with its body: one system call, no copy
            await self._protocol.drain(empty=True)
            self._check_open()
            await self._send_gathered(self._direct_socket(), views[: lead + 1])
            self.bytes_sent += sum(view.nbytes for view in views[: lead + 1])
            views = views[lead + 1 :]
        for view in views:
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
            raise ConnectionFailed(self.peer, describe(self._protocol.error, "connection lost"))

    def send_nowait(self, *parts: Buffer) -> bool:
        """Small parts (at most ``_COALESCE_BYTES`` in all) go to asyncio's write buffer in
        one write when writing is not paused (the write buffer is under its high-water
        mark): no wait, so no timeout scope around it. A send that finds it paused, or
        larger parts, take ``send``."""
        protocol = self._protocol
        if self._closed or protocol.lost or protocol.writing_paused:
            return False
        views = [byte_view(part) for part in parts]
        total = sum(view.nbytes for view in views)
        if total > _COALESCE_BYTES:
            return False
        self._transport.writelines(views)
        self.bytes_sent += total
        return True

    async def _send_direct(self, sock: socket.socket, view: memoryview) -> None:
        sending = asyncio.ensure_future(asyncio.get_running_loop().sock_sendall(sock, view))
        self._sending = sending
        try:
            await sending
        except OSError as exc:
            raise ConnectionFailed(self.peer, describe(exc, "send failed")) from exc
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self._closed and task is not None and not task.cancelling():
                raise ConnectionFailed(self.peer, "transport closed during a send") from None
            raise
        finally:
            self._sending = None

    async def _send_gathered(self, sock: socket.socket, views: list[memoryview]) -> None:
        """Send ``views`` (small parts, then a large one) on the direct socket: as many as
        the kernel takes at once in one ``sendmsg``, the rest as ``_send_direct`` does (the
        small parts left, if any, joined first: a few bytes copied)."""
        try:
            sent = sock.sendmsg(views)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:
            raise ConnectionFailed(self.peer, describe(exc, "send failed")) from exc
        rest = list(views)
        while rest and sent >= rest[0].nbytes:
            sent -= rest.pop(0).nbytes
        if rest and sent:
            rest[0] = rest[0][sent:]
        if len(rest) > 1:
            await self._send_direct(sock, memoryview(b"".join(rest[:-1])))
        if rest:
            await self._send_direct(sock, rest[-1])

    def _close_direct(self) -> None:
        if self._sending is not None:
            # cancel first: its done-callback unregisters the socket from the event loop
            self._sending.cancel()
        if self._direct is not None:
            self._direct.close()
            self._direct = None

    def receive_nowait(self, buffer: Buffer) -> int:
        if self._closed:
            return 0
        got = self._protocol.take_buffered(byte_view(buffer))
        self.bytes_received += got
        return got

    def buffered(self) -> int:
        return 0 if self._closed else self._protocol.buffered

    async def readable(self) -> None:
        if self._closed:
            raise TransportClosed(self.peer)
        await self._protocol.readable()

    async def receive_into(self, buffer: Buffer) -> int:
        if self._closed:
            raise TransportClosed(self.peer)
        view = byte_view(buffer)
        protocol = self._protocol
        got = protocol.take_buffered(view)  # small reads are mostly served from read-ahead
        if got < view.nbytes:
            got = await protocol.receive_into(view, got)
        self.bytes_received += got
        if got < view.nbytes and protocol.error is not None:
            raise ConnectionFailed(self.peer, describe(protocol.error, "connection lost"))
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


class _Busy(contextlib.AbstractContextManager[None]):
    """``TcpTransport.busy()``: a class, not a generator: the DWE listener enters one a frame."""

    __slots__ = ("_protocol",)

    def __init__(self, protocol: StreamProtocol) -> None:
        self._protocol = protocol

    def __enter__(self) -> None:
        self._protocol.held += 1
        self._protocol.idle_since = None

    def __exit__(self, *exc_info: object) -> None:
        self._protocol.held -= 1


def _lead(views: list[memoryview]) -> int:
    """How many small parts (at most ``_COALESCE_BYTES`` in all) come before the first
    part of ``views``, if that one is sent directly (DIRECT_SEND_BYTES or more); else 0."""
    small = 0
    for index, view in enumerate(views):
        if view.nbytes >= DIRECT_SEND_BYTES:
            return index
        small += view.nbytes
        if small > _COALESCE_BYTES:
            return 0
    return 0


def describe(exc: BaseException | None, default: str) -> str:
    """``Type: message`` of ``exc``, or ``default`` when there is none."""
    return f"{type(exc).__name__}: {exc}" if exc is not None else default


def peer_name(transport: asyncio.BaseTransport) -> str:
    """``host:port`` (``[host]:port`` for IPv6) of the other end of ``transport``."""
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
    for refused/unreachable/unresolvable peers and failed TLS handshakes.
    """
    loop = asyncio.get_running_loop()
    tls = ssl is not None
    target = f"{host}:{port}"
    try:
        async with asyncio.timeout(timeout):
            _, protocol = await loop.create_connection(
                lambda: StreamProtocol(tls=tls),
                host,
                port,
                ssl=ssl,
                server_hostname=(server_hostname or host) if tls else None,
            )
    except TimeoutError as exc:
        raise PeerTimeout("connect", timeout or 0.0, target) from exc
    # UnicodeError: a host name IDNA cannot encode (a label over 63 characters) fails in
    # getaddrinfo, as an unknown name does
    except (OSError, ssl_module.SSLError, UnicodeError) as exc:
        raise ConnectionFailed(target, describe(exc, "connect failed")) from exc
    assert protocol.transport is not None
    return TcpTransport(protocol, peer_name(protocol.transport))
