"""Byte-stream transports: the Transport interface and in-memory pairs (TCP/TLS in ``tcp``)."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from types import TracebackType
from typing import TYPE_CHECKING, Self

from tensorswap.wire.errors import ConnectionFailed, TransportClosed, UnexpectedEof

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["MemoryTransport", "Transport", "memory_pair"]

_MEMORY_CAPACITY = 256 * 1024


def byte_view(data: Buffer) -> memoryview:
    """A flat unsigned-byte view of ``data`` (no copy)."""
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
        view = byte_view(buffer)
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
            view = byte_view(part)
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
        view = byte_view(buffer)
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


def memory_pair(capacity: int = _MEMORY_CAPACITY) -> tuple[MemoryTransport, MemoryTransport]:
    """Two connected in-memory transports; each direction buffers at most ``capacity`` bytes."""
    if capacity < 1:
        raise ValueError(f"capacity must be positive, got {capacity}")
    a_to_b, b_to_a = _Pipe(capacity), _Pipe(capacity)
    return MemoryTransport(a_to_b, b_to_a, "memory:b"), MemoryTransport(b_to_a, a_to_b, "memory:a")
