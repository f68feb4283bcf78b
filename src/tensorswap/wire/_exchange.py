"""A client connection's exchanges: answers owed by stream id, frames taken whole, cancel-safe.

A server answers a connection's requests one at a time, in order, each answer on its
request's stream id. ``Exchanges`` keeps the ledger of the answers still to come (``open``),
so that a call cancelled at any await point leaves the connection in a known state:

- a frame is only ever taken whole: a read waits for its first byte without consuming any
  (``Transport.readable``), takes a frame already read ahead at once, and finishes one it
  had to begin in a task of its own, shielded from the caller's cancel (the next read
  picks that frame up). No partial frame is left behind;
- the answers a cancelled call did not read stay open, and the next exchange first reads
  and drops them (``settle``; counted in ``ExchangeStats``), or the client reconnects when
  one of them is a wait (it may take long) or the connection is broken;
- a send cut inside a frame cannot be taken back: the connection is then broken
  (``fail``), and so it is after a wire error in the middle of an answer.

So a frame on a stream other than the one due is a real protocol violation, never a
leftover of a cancelled call.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Literal, TypeVar, cast

from tensorswap.wire._buffers import receive_buffers
from tensorswap.wire.connection import Frame, FrameConnection, _check_crc
from tensorswap.wire.errors import PeerTimeout, ProtocolViolation, UnexpectedEof, WireError
from tensorswap.wire.frames import HEADER_SIZE, FrameHeader, FrameKind
from tensorswap.wire.messages import Message, Reply, decode_message

__all__ = ["MAX_OWED", "ExchangeStats", "Exchanges", "take_header", "take_payload"]

M = TypeVar("M", bound=Message)

Timeout = float | Literal["read"] | None

MAX_OWED = 256
"""Answers a connection may owe to cancelled calls; past that it is given up (broken)."""


@dataclass(slots=True)
class ExchangeStats:
    """What cancelled calls cost one client, over all its connections."""

    abandoned: int = 0
    """Calls cancelled (or failed outside the wire) with answers still to come."""
    discarded_frames: int = 0
    """Frames of those answers read and dropped."""
    discarded_bytes: int = 0
    broken: int = 0
    """Connections given up: a frame cut by a cancel, a wire error inside an answer, a
    wait cancelled where reconnecting is quicker than waiting for its answer."""
    reconnects: int = 0


@dataclass(slots=True)
class _Open:
    """An answer to come: on ``stream``, ending with a frame of kind ``ends``."""

    stream: int
    ends: FrameKind
    timeout: Timeout
    then_blocks: bool = False
    """A REPLY that blocks and a GOT follow when it is handled (``request_blocks``)."""


def _retrieve(task: asyncio.Task[Frame]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved here: the next read (or none) re-raises it


class Exchanges:
    """The ledger of one connection's answers to come (see the module docstring).

    Used under the client's lock, one exchange at a time: ``next_stream`` before a request
    is sent, ``expect`` once it is, ``receive`` / ``message`` for each frame of the answers,
    ``abandon`` when a call ends early, ``settle`` before the next one.
    """

    def __init__(self, conn: FrameConnection, stats: ExchangeStats) -> None:
        self.conn = conn
        self.stats = stats
        self.open: deque[_Open] = deque()
        self.broken: str | None = None
        """Why the connection was given up (None while it is in sync)."""
        self._reading: asyncio.Task[Frame] | None = None
        self._stream = 0

    @property
    def clean(self) -> bool:
        """In sync with nothing owed: a new exchange may begin at once."""
        return self.broken is None and not self.open and self._reading is None

    @property
    def owes_wait(self) -> bool:
        """Whether an owed answer is a wait's (sent with a timeout other than ``"read"``)."""
        return any(owed.timeout != "read" for owed in self.open)

    def next_stream(self) -> int:
        self._stream += 1
        return self._stream

    def expect(
        self, stream: int, ends: FrameKind, timeout: Timeout = "read", *, then_blocks: bool = False
    ) -> None:
        """A request on ``stream`` was sent whole: its answer ends with an ``ends`` frame."""
        self.open.append(_Open(stream, ends, timeout, then_blocks))

    # ── reading ──────────────────────────────────────────────────────────────
    async def receive(self, timeout: Timeout = "read", *, defer_block_crc: bool = False) -> Frame:
        """The next frame of the answer due (``timeout`` as ``receive_frame``'s), whole."""
        frame = await self._take(timeout, defer_block_crc)
        self._note(frame)
        return frame

    async def message(self, expected: type[M], timeout: Timeout = "read") -> M:
        """The next frame, which must be an ``expected`` message (see ``receive_message``)."""
        frame = await self.receive(timeout)
        return cast(M, self.conn.expect(frame, expected))

    async def _take(self, timeout: Timeout, defer_block_crc: bool) -> Frame:
        task = self._reading
        if task is None:
            conn = self.conn
            header = take_header(conn)
            if header is None:
                await self._readable(conn._seconds(timeout))
                header = take_header(conn)
            if header is not None:
                frame = take_payload(conn, header, defer_block_crc=defer_block_crc)
                if frame is not None:
                    return frame
                work = conn.receive_frame(header=header, defer_block_crc=defer_block_crc)
            else:  # a header split on the way: the whole frame in the task
                work = conn.receive_frame(timeout=timeout, defer_block_crc=defer_block_crc)
            task = self._reading = asyncio.ensure_future(work)
            task.add_done_callback(_retrieve)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.done() and self._reading is task:
                self._reading = None
                self._dropped(task)  # it came as the caller was cancelled: it is consumed
            raise
        finally:
            if task.done() and self._reading is task:
                self._reading = None

    def _dropped(self, task: asyncio.Task[Frame]) -> None:
        """A frame read for a caller that was cancelled meanwhile: noted and dropped."""
        if task.cancelled() or task.exception() is not None:
            self.fail("a frame's read failed after its caller was cancelled")
            return
        frame = task.result()
        try:
            self._note(frame)
        except ProtocolViolation as exc:
            self.fail(str(exc))
            return
        self.stats.discarded_frames += 1
        self.stats.discarded_bytes += HEADER_SIZE + frame.payload.nbytes

    async def _readable(self, seconds: float | None) -> None:
        """Wait for the next frame's first byte, consuming none (a cancel here is free)."""
        transport = self.conn.transport
        if seconds is None:
            await transport.readable()
            return
        try:
            async with asyncio.timeout(seconds):
                await transport.readable()
        except TimeoutError as exc:
            raise PeerTimeout("a frame header", seconds, self.conn.peer) from exc

    def _note(self, frame: Frame) -> None:
        """Check ``frame`` against the answer due and move the ledger past it."""
        kind, stream = frame.header.kind, frame.header.stream_id
        if kind is FrameKind.ERROR:
            return  # raised by whoever decodes it; the server closes after it
        if not self.open:
            raise ProtocolViolation(f"a {kind.name} frame on stream {stream}, no answer due")
        head = self.open[0]
        if stream != head.stream:
            raise ProtocolViolation(
                f"a {kind.name} frame on stream {stream}, the answer due is on {head.stream}"
            )
        if kind is head.ends:
            if head.then_blocks and _handled(frame):
                head.ends, head.then_blocks = FrameKind.GOT, False
            else:
                self.open.popleft()
        elif kind is not FrameKind.BLOCK or head.ends is not FrameKind.GOT:
            raise ProtocolViolation(
                f"a {kind.name} frame on stream {stream}, expected {head.ends.name}"
            )

    # ── after a call ─────────────────────────────────────────────────────────
    def abandon(self, exc: BaseException) -> None:
        """A call ended in ``exc`` (a cancel, or an error) with answers maybe still open:
        a wire error inside an answer, or any end during a send cut inside a frame, breaks
        the connection; otherwise the answers are owed and ``settle`` drops them."""
        if self.broken is not None:
            return
        if self.conn.send_broken:
            self.fail("a send was cut inside a frame")
        elif self.open or self._reading is not None:
            if isinstance(exc, WireError | OSError):
                self.fail(f"{type(exc).__name__} inside an answer")
            else:
                self.stats.abandoned += 1
                if len(self.open) > MAX_OWED:
                    self.fail(f"more than {MAX_OWED} answers owed to cancelled calls")

    async def settle(self) -> None:
        """Read and drop the answers owed to cancelled calls, in order (each within the
        timeout its request had). A cancel leaves what is still owed; an error is raised
        (the caller gives the connection up)."""
        while self.open:
            head = self.open[0]
            frame = await self._take(head.timeout, True)
            if frame.header.kind is FrameKind.ERROR:
                self.conn.expect(frame)  # raises the server's RemoteError
            self._note(frame)
            self.stats.discarded_frames += 1
            self.stats.discarded_bytes += HEADER_SIZE + frame.payload.nbytes

    def fail(self, reason: str) -> None:
        """Give the connection up: out of frame sync, or not worth waiting on."""
        if self.broken is None:
            self.broken = reason
            self.stats.broken += 1
        self.close()
        self.conn.transport.abort()

    def close(self) -> None:
        """Stop a frame read left running by a cancelled call."""
        if self._reading is not None:
            self._reading.cancel()
            self._reading = None


def _handled(frame: Frame) -> bool:
    reply = decode_message(frame.header.kind, frame.payload)
    return isinstance(reply, Reply) and reply.handled


def take_header(conn: FrameConnection) -> FrameHeader | None:
    """The next frame's header if all of it is read ahead (taken, checked as
    ``receive_frame`` checks it), else None and nothing taken. No waiting."""
    if conn.transport.buffered() < HEADER_SIZE:
        return None
    got = conn.transport.receive_nowait(conn._header)
    if got < HEADER_SIZE:  # the transport miscounted: out of sync now
        raise UnexpectedEof("frame header", got, HEADER_SIZE)
    return conn._unpack_header()


def take_payload(
    conn: FrameConnection, header: FrameHeader, *, defer_block_crc: bool = False
) -> Frame | None:
    """The frame of ``header`` (just taken) if its whole payload is read ahead (taken and
    CRC-checked, as ``receive_frame`` returns it), else None and nothing taken."""
    length = header.payload_len
    if length and conn.transport.buffered() < length:
        return None
    payload = receive_buffers().take(length)
    got = conn.transport.receive_nowait(payload) if length else 0
    if got < length:
        raise UnexpectedEof(f"{header.kind.name} payload", got, length)
    if defer_block_crc and header.kind is FrameKind.BLOCK:
        return Frame(header, payload, checked=False)
    _check_crc(header, payload)
    return Frame(header, payload)
