"""The asyncio protocol under TcpTransport: reads into the caller's buffer, bounded spill."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import cast

__all__ = ["DIRECT_RECEIVE_BYTES", "WRITE_HIGH_WATER", "StreamProtocol"]

DIRECT_RECEIVE_BYTES = 64 * 1024
"""Reads at least this large are received by the kernel straight into the caller's buffer."""
WRITE_HIGH_WATER = 1024 * 1024
"""Bytes asyncio may buffer for sending before a send waits (backpressure)."""

_SPILL_BYTES = 256 * 1024  # bounded read-ahead for small reads (headers, control messages)
# A connection's first read-ahead buffer; it doubles up to _SPILL_BYTES when it fills. A
# server with thousands of connections that each send a small request would otherwise zero
# (and fault in) 256 KiB per connection on its first read.
_SPILL_FIRST = 16 * 1024
# The most one read puts into the read-ahead buffer. After a large read is filled, the next
# frame's header comes through read-ahead; a read of the whole free buffer would also take up
# to 256 KiB of that frame's payload, copied once more on its way out (half of every byte of
# a stream of 512 KiB blocks). Small messages still accumulate over several reads.
_SPILL_READ = 16 * 1024


class StreamProtocol(asyncio.BufferedProtocol):
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
        self.on_connect: Callable[[StreamProtocol], None] | None = None
        # Idleness, tracked only where a listener set ``clock``: ``idle_since`` is when the
        # reader began waiting with nothing received for its read and nothing buffered,
        # outside ``held`` (a message in progress); None otherwise.
        self.clock: Callable[[], float] | None = None
        self.idle_since: float | None = None
        self.held = 0

    # asyncio callbacks (event loop thread)
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (asyncio's, or uvloop's, which does not subclass asyncio's).
        self.transport = cast(asyncio.Transport, transport)
        self.transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)
        if self.on_connect is not None:
            self.on_connect(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._target is not None:
            return self._target[self._filled :]
        size = self._spill_view.nbytes
        if self._end == size:
            if self._start:
                live = self._end - self._start
                self._spill_view[:live] = self._spill_view[self._start : self._end]
                self._start, self._end = 0, live
            elif size < _SPILL_BYTES:
                grown = memoryview(bytearray(min(_SPILL_BYTES, max(_SPILL_FIRST, 2 * size))))
                grown[:size] = self._spill_view
                self._spill_view = grown
        return self._spill_view[self._end : self._end + _SPILL_READ]

    def buffer_updated(self, nbytes: int) -> None:
        self.idle_since = None
        if self._target is not None:
            self._filled += nbytes
            if self._filled < len(self._target):
                return
            self._target = None
        else:
            self._end += nbytes
            full = self._end == self._spill_view.nbytes >= _SPILL_BYTES
            if full and self._start == 0:
                self._pause_reading()
        self._wake_reader()

    def eof_received(self) -> bool:
        self.eof = True
        self.idle_since = None
        self._wake_reader()
        return not self.tls  # keep the write side open after a TCP half-close

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = self.lost = True
        self.idle_since = None
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

    @property
    def writing_paused(self) -> bool:
        """asyncio paused writing: the write buffer is above its high-water mark."""
        return self._writing_paused

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

    async def _wait_reader(self, *, nothing_yet: bool) -> None:
        """Wait for bytes, EOF or loss; idle meanwhile if ``nothing_yet`` of this read came."""
        self._reader = asyncio.get_running_loop().create_future()
        if nothing_yet and self.clock is not None and not self.held:
            self.idle_since = self.clock()
        try:
            await self._reader
        finally:
            self._reader = None
            self.idle_since = None

    def take_buffered(self, view: memoryview, got: int = 0) -> int:
        """Copy read-ahead bytes into ``view[got:]`` without waiting; the new ``got``."""
        available = self._end - self._start
        if not available:
            return got
        take = min(available, view.nbytes - got)
        view[got : got + take] = self._spill_view[self._start : self._start + take]
        self._start += take
        if self._start == self._end:
            self._start = self._end = 0
            self._resume_reading()
        return got + take

    @property
    def buffered(self) -> int:
        """Read-ahead bytes ``take_buffered`` would copy now."""
        return self._end - self._start

    async def readable(self) -> None:
        """Wait for read-ahead bytes, EOF or loss; consumes nothing (cancel-safe)."""
        while self._end == self._start and not self.eof:
            self._resume_reading()
            await self._wait_reader(nothing_yet=True)

    async def receive_into(self, view: memoryview, got: int = 0) -> int:
        """Fill ``view`` from ``view[got:]`` on (fewer bytes only at EOF); the bytes filled."""
        total = view.nbytes
        while got < total:
            if self._end - self._start:
                got = self.take_buffered(view, got)
                continue
            if self.eof:
                break
            self._resume_reading()
            if total - got >= DIRECT_RECEIVE_BYTES:
                self._target, self._filled = view[got:], 0
                try:
                    await self._wait_reader(nothing_yet=got == 0)
                finally:
                    got += self._filled
                    self._target, self._filled = None, 0
            else:
                await self._wait_reader(nothing_yet=got == 0)
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
                    self.transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)
            return
        while self._writing_paused and not self.lost:
            self._drainer = asyncio.get_running_loop().create_future()
            try:
                await self._drainer
            finally:
                self._drainer = None
