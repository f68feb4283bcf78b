"""The Transport interface: a reliable, ordered, bidirectional byte stream."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from types import TracebackType
from typing import TYPE_CHECKING, Self

from tensorswap.transport.errors import UnexpectedEof

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["Transport", "byte_view"]


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
      then out of frame sync and should be closed. ``readable`` waits for bytes without
      consuming any (a cancel there costs nothing), and ``buffered`` says how many a
      ``receive_nowait`` would copy now: together they let a reader take a frame only once
      it is whole (see ``wire._exchange``).
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

    def busy(self) -> contextlib.AbstractContextManager[None]:
        """Mark a message in progress for the block's duration (nestable).

        A listener at its connection cap never evicts a connection inside ``busy()``, even
        while it waits for the peer's bytes (see ``TcpListener``). Elsewhere a no-op.
        """
        return contextlib.nullcontext()

    def send_nowait(self, *parts: Buffer) -> bool:
        """Hand ``parts`` over without waiting, where that is possible now: True if done
        (as ``send`` would have, in order), False if nothing was sent and the caller must
        ``await send(...)``. A fast path for small frames; by default never taken."""
        return False

    def receive_nowait(self, buffer: Buffer) -> int:
        """Copy bytes already received (read ahead) into ``buffer`` without waiting; how
        many (0 when none, or where the transport has no such fast path). ``receive_into``
        goes on from there."""
        return 0

    def buffered(self) -> int:
        """How many bytes ``receive_nowait`` would copy now (read ahead, no waiting); 0
        where the transport has no such fast path."""
        return 0

    async def readable(self) -> None:
        """Return once bytes, EOF or a failure are there to receive, consuming nothing: a
        cancel here leaves the stream as it was. By default at once (a transport without
        read-ahead then has ``buffered`` 0, and the caller reads as usual)."""
        return

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
