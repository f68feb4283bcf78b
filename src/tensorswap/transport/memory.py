"""In-memory transports: connected pairs with bounded buffers, for tests and in-process use."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from tensorswap.transport.base import Transport, byte_view
from tensorswap.transport.errors import ConnectionFailed, TransportClosed

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["MemoryTransport", "memory_pair"]

_MEMORY_CAPACITY = 256 * 1024


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

    def buffered(self) -> int:
        return 0 if self._closed or self._in.reset else len(self._in.buffer)

    def receive_nowait(self, buffer: Buffer) -> int:
        if self._closed or self._in.reset or not self._in.buffer:
            return 0
        view = byte_view(buffer)
        take = min(len(self._in.buffer), view.nbytes)
        view[:take] = self._in.buffer[:take]
        del self._in.buffer[:take]
        self.bytes_received += take
        self._in.notify()
        return take

    async def readable(self) -> None:
        if self._closed:
            raise TransportClosed(self.peer)
        pipe = self._in
        while not (pipe.buffer or pipe.eof or pipe.reset or self._closed):
            await pipe.wait()

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
