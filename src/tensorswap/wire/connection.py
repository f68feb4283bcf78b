"""Frames over a Transport: bounded, checksummed, time-limited sends and receives."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from tensorswap.cid import Cid
from tensorswap.wire._buffers import receive_buffers
from tensorswap.wire._prepare import PreparedBlock, prepare_block
from tensorswap.wire.errors import (
    ChecksumMismatch,
    ConnectionFailed,
    FrameTooLarge,
    PeerTimeout,
    ProtocolViolation,
    StreamEnded,
    UnexpectedEof,
    remote_error,
)
from tensorswap.wire.frames import (
    BLOCK_PREFIX_MAX,
    HEADER_SIZE,
    BlockPrefix,
    Compression,
    FrameHeader,
    FrameKind,
    crc32c,
    decompress,
    parse_block_prefix,
)
from tensorswap.wire.messages import Error, Message, decode_message, encode_message
from tensorswap.wire.transport import Transport

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "Admit",
    "BlockFrame",
    "Frame",
    "FrameConnection",
    "PreparedBlock",
    "Timeouts",
    "WireLimits",
    "prepare_block",
]

M = TypeVar("M", bound=Message)

Admit = Callable[["FrameHeader", "BlockPrefix | None"], Awaitable[None]]
"""``await admit(header, prefix)`` before a frame's payload is allocated (see receive_frame)."""

_RAW_LEN_BYTES = 8


@dataclass(frozen=True, slots=True)
class WireLimits:
    """Upper bounds on what a peer may make us allocate; checked before any allocation."""

    max_block_bytes: int = 256 * 1024 * 1024
    """Largest block (uncompressed and on the wire)."""
    max_message_bytes: int = 16 * 1024 * 1024
    """Largest control-message payload (an Offer of ~400k CIDs)."""

    def __post_init__(self) -> None:
        if self.max_block_bytes < 1 or self.max_message_bytes < 64:
            raise ValueError(f"limits too small: {self}")

    @property
    def max_block_payload(self) -> int:
        return self.max_block_bytes + BLOCK_PREFIX_MAX


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Seconds before a stalled peer is dropped (None waits forever; not recommended)."""

    connect: float | None = 10.0
    """TCP connect plus TLS handshake."""
    handshake: float | None = 10.0
    """The authentication exchange after connecting."""
    read: float | None = 60.0
    """One whole frame, once it is due (an answer, or the rest of a transfer)."""
    idle: float | None = 300.0
    """A server waiting for a client's next request."""


@dataclass(frozen=True, slots=True)
class Frame:
    """A received frame; its payload CRC32C has been checked unless ``checked`` is False.

    Only ``receive_frame(defer_block_crc=True)`` returns unchecked (BLOCK) frames; their
    check then happens in ``BlockFrame.check_crc``, before anything uses the bytes.
    """

    header: FrameHeader
    payload: memoryview
    checked: bool = True

    def check_crc(self) -> None:
        """Raise ChecksumMismatch unless the payload matches the header's CRC32C."""
        _check_crc(self.header, self.payload)


@dataclass(frozen=True, slots=True)
class BlockFrame:
    """A received block: its claimed CID and its (decompressed) bytes, not yet hash-checked.

    When the frame's CRC32C is still to be checked, ``frame`` holds it: call ``check_crc``
    (in a worker thread, say) before trusting ``cid`` or ``data``.
    """

    cid: Cid
    data: memoryview
    wire_bytes: int
    compression: Compression
    frame: Frame | None = None

    def check_crc(self) -> None:
        """Check the frame's CRC32C if that is still due (ChecksumMismatch)."""
        if self.frame is not None:
            self.frame.check_crc()


def _check_crc(header: FrameHeader, payload: memoryview) -> None:
    if header.lean:  # accepted at the handshake: the block's CID is checked instead
        return
    actual = crc32c(payload)
    if actual != header.payload_crc:
        raise ChecksumMismatch(
            None,
            header.payload_crc,
            actual,
            algorithm="crc32c",
            what=f"{header.kind.name} frame (stream {header.stream_id})",
        )


class FrameConnection:
    """Sends and receives frames on one transport; not safe for concurrent senders/receivers.

    Every receive is bounded in size (``WireLimits``) before allocation and in time
    (``Timeouts.read``, or the ``timeout`` given); the payload CRC32C is checked before a
    frame is returned. A receive that fails leaves the stream out of sync: close it. Every
    send is bounded by ``Timeouts.read`` too (PeerTimeout), and an outgoing control message
    by ``max_message_bytes`` (FrameTooLarge, nothing sent).
    """

    def __init__(
        self,
        transport: Transport,
        *,
        limits: WireLimits | None = None,
        timeouts: Timeouts | None = None,
    ) -> None:
        self.transport = transport
        self.limits = limits or WireLimits()
        self.timeouts = timeouts or Timeouts()
        self._header = bytearray(HEADER_SIZE)
        self._send_broken = False
        self.operator = False
        """Whether the client proved the server's operator key (``server_handshake``)."""
        self.accept_lean = False
        """Whether BLOCK frames without a CRC32C are taken (this side offered it)."""
        self.send_lean = False
        """Whether BLOCK frames are sent without a CRC32C (both sides offered it): a block's
        CID, checked by its receiver, covers its bytes; the CRC32C would check them twice."""

    @property
    def peer(self) -> str:
        return self.transport.peer

    @property
    def send_broken(self) -> bool:
        """A send stopped inside a frame (a cancel, a timeout): the stream is out of sync."""
        return self._send_broken

    # ── sending ──────────────────────────────────────────────────────────────
    async def _send(self, what: str, *parts: Buffer) -> None:
        """Send one whole frame within ``Timeouts.read`` (PeerTimeout: the peer stopped
        reading). A send that does not complete leaves the stream out of frame sync: every
        later send then fails at once with ConnectionFailed."""
        if self._send_broken:
            raise ConnectionFailed(self.peer, "an earlier send stopped inside a frame")
        if self.transport.send_nowait(*parts):  # a small frame handed over: nothing to time
            return
        seconds = self.timeouts.read
        done = False
        try:
            async with asyncio.timeout(seconds):
                await self.transport.send(*parts)
            done = True
        except TimeoutError as exc:
            raise PeerTimeout(f"sending {what}", seconds or 0.0, self.peer) from exc
        finally:
            if not done:
                self._send_broken = True

    async def send_message(self, message: Message, stream_id: int = 0) -> None:
        """Send a control message; FrameTooLarge (nothing sent) above ``max_message_bytes``."""
        kind, payload = encode_message(message)
        if len(payload) > self.limits.max_message_bytes:
            raise FrameTooLarge(
                f"outgoing {kind.name} message", len(payload), self.limits.max_message_bytes
            )
        header = FrameHeader(kind, len(payload), crc32c(payload), stream_id)
        await self._send(f"a {kind.name} frame ({len(payload)} bytes)", header.pack(), payload)

    async def send_prepared(self, block: PreparedBlock) -> None:
        await self._send(
            f"a BLOCK frame ({block.wire_bytes} bytes)",
            block.header,
            block.prefix,
            *block.parts,
        )

    async def send_block(
        self, cid: Cid, data: Buffer, compression: Compression = Compression.NONE
    ) -> int:
        """Send one block (checksummed here, on the loop); the bytes put on the wire."""
        block = prepare_block(cid, data, compression, crc=not self.send_lean)
        await self.send_prepared(block)
        return block.wire_bytes

    async def send_error(self, code: str, message: str, stream_id: int = 0) -> None:
        await self.send_message(Error(code=code, message=message[:2000]), stream_id)

    # ── receiving ────────────────────────────────────────────────────────────
    def _seconds(self, timeout: float | Literal["read", "idle"] | None) -> float | None:
        if timeout == "read":
            return self.timeouts.read
        if timeout == "idle":
            return self.timeouts.idle
        return timeout

    async def receive_frame(
        self,
        *,
        timeout: float | Literal["read", "idle"] | None = "read",
        defer_block_crc: bool = False,
        max_payload: int | None = None,
        whole_frame: bool = False,
        admit: Admit | None = None,
        header: FrameHeader | None = None,
        allocated: Callable[[memoryview], None] | None = None,
    ) -> Frame:
        """The next frame, CRC-checked.

        ``timeout`` bounds the wait for the 32-byte header (default ``Timeouts.read``; the
        server waits ``"idle"`` between requests); the payload then must arrive within
        ``Timeouts.read``, or, with ``whole_frame``, within what is left of ``timeout``
        (header and payload together). ``max_payload`` lowers the payload limit of every
        frame kind below ``WireLimits`` (the handshake's small messages). Raises StreamEnded
        (clean EOF before a header), UnexpectedEof (EOF inside a frame), PeerTimeout,
        ProtocolViolation/FrameTooLarge (bad header; nothing allocated) or ChecksumMismatch.
        With ``defer_block_crc``, a BLOCK frame is returned unchecked (``checked=False``) for
        the caller to check off the event loop. ``admit(header, prefix)``, if given, is
        awaited once the header (and of a BLOCK frame its prefix: CID and raw_len, or None if
        malformed) is read and before the payload is allocated or read further; the payload
        then has ``Timeouts.read`` from its return (the server waits there for memory).
        ``header``: the frame's header, already taken (``_exchange``): its payload follows.
        ``allocated(payload)``, if given, is called with the payload's buffer as soon as it
        exists (a server ties its budget share to it: counted until that memory is freed).
        """
        loop = asyncio.get_running_loop()
        seconds = self._seconds(timeout)
        deadline = None if seconds is None else loop.time() + seconds
        if header is None:
            header = await self._receive_header(seconds, deadline, max_payload)
        what = f"{header.kind.name} payload ({header.payload_len} bytes)"
        if not whole_frame:
            seconds = self.timeouts.read
            deadline = None if seconds is None else loop.time() + seconds
        head = b""
        if admit is not None:
            prefix = None
            if header.kind is FrameKind.BLOCK:
                head = await self._receive_block_prefix(header, what, seconds, deadline)
                prefix = self._block_prefix(head)
            await admit(header, prefix)
            if not whole_frame:
                deadline = None if seconds is None else loop.time() + seconds
        # Bounded by unpack above. Uninitialised (it is filled completely before any use)
        # and recycled: fresh pages cost more than the bytes received into them.
        payload = receive_buffers().take(header.payload_len)
        if allocated is not None:
            allocated(payload)
        try:
            frame = await self._fill(payload, header, head, what, seconds, deadline, whole_frame)
        finally:
            del payload  # a traceback keeps this frame: it must not keep the buffer too
        if defer_block_crc and header.kind is FrameKind.BLOCK:
            return frame
        try:
            _check_crc(header, frame.payload)
        except ChecksumMismatch:
            del frame  # as above: the error must not keep the payload
            raise
        return Frame(header, frame.payload)

    async def _fill(
        self,
        payload: memoryview,
        header: FrameHeader,
        head: bytes,
        what: str,
        seconds: float | None,
        deadline: float | None,
        whole_frame: bool,
    ) -> Frame:
        """``receive_frame``'s payload read into ``payload`` (``head`` already read), as an
        unchecked frame."""
        payload[: len(head)] = head
        filled = len(head)
        if filled < header.payload_len:
            filled += self.transport.receive_nowait(payload[filled:])
        try:
            if filled < header.payload_len:
                async with asyncio.timeout_at(deadline):
                    await self.transport.receive_exactly(payload[filled:], what)
        except TimeoutError as exc:
            if whole_frame:
                what = f"a whole {header.kind.name} frame ({header.payload_len} bytes)"
            del payload
            raise PeerTimeout(what, seconds or 0.0, self.peer) from exc
        except UnexpectedEof as exc:
            del payload
            if not filled:
                raise
            raise UnexpectedEof(what, filled + exc.received, header.payload_len) from None
        except BaseException:
            del payload  # cancelled: the traceback keeps this frame, not the buffer
            raise
        return Frame(header, payload, checked=False)

    async def _receive_header(
        self, seconds: float | None, deadline: float | None, max_payload: int | None
    ) -> FrameHeader:
        # Bytes already read ahead need no wait, so no timeout scope (a pipelined peer's
        # frames, a payload that came with its header).
        got = self.transport.receive_nowait(self._header)
        if got < HEADER_SIZE:
            try:
                async with asyncio.timeout_at(deadline):
                    got += await self.transport.receive_into(memoryview(self._header)[got:])
            except TimeoutError as exc:
                raise PeerTimeout("a frame header", seconds or 0.0, self.peer) from exc
        if got == 0:
            raise StreamEnded(f"connection from {self.peer}")
        if got < HEADER_SIZE:
            raise UnexpectedEof("frame header", got, HEADER_SIZE)
        return self._unpack_header(max_payload)

    def _unpack_header(self, max_payload: int | None = None) -> FrameHeader:
        message_limit = self.limits.max_message_bytes
        block_limit = self.limits.max_block_payload
        if max_payload is not None:
            message_limit = min(message_limit, max_payload)
            block_limit = min(block_limit, max_payload)
        header = FrameHeader.unpack(
            self._header, max_payload=message_limit, max_block_payload=block_limit
        )
        if header.lean and not self.accept_lean:
            raise ProtocolViolation("a BLOCK frame without a CRC32C, which this side refused")
        return header

    async def _receive_block_prefix(
        self, header: FrameHeader, what: str, seconds: float | None, deadline: float | None
    ) -> bytes:
        """The first bytes of a BLOCK payload, up to the end of its prefix (CID, raw_len)."""
        head = bytearray(min(header.payload_len, 1))
        try:
            async with asyncio.timeout_at(deadline):
                got = await self.transport.receive_into(head)
                if got < len(head):
                    raise UnexpectedEof(what, got, header.payload_len)
                if head:
                    end = min(header.payload_len, 1 + head[0] + _RAW_LEN_BYTES)
                    rest = bytearray(end - 1)
                    got = await self.transport.receive_into(rest)
                    if got < len(rest):
                        raise UnexpectedEof(what, 1 + got, header.payload_len)
                    head += rest
        except TimeoutError as exc:
            raise PeerTimeout(what, seconds or 0.0, self.peer) from exc
        return bytes(head)

    def _block_prefix(self, head: bytes) -> BlockPrefix | None:
        """``head`` parsed, or None if malformed (the whole frame is read and CRC-checked
        before that is reported, as for any block: see ``parse_block``)."""
        try:
            return parse_block_prefix(memoryview(head), max_raw_len=self.limits.max_block_bytes)
        except ProtocolViolation:
            return None

    async def receive_message(
        self,
        expected: type[M],
        *,
        timeout: float | Literal["read", "idle"] | None = "read",
        max_payload: int | None = None,
        whole_frame: bool = False,
    ) -> tuple[M, int]:
        """The next control message, which must be an ``expected``; with its stream id.

        An Error message from the peer raises RemoteError; any other kind ProtocolViolation.
        ``max_payload`` and ``whole_frame`` are those of ``receive_frame``.
        """
        frame = await self.receive_frame(
            timeout=timeout, max_payload=max_payload, whole_frame=whole_frame
        )
        message = self.expect(frame, expected)
        if not isinstance(message, expected):  # pragma: no cover - expect checked it
            raise ProtocolViolation(f"unexpected {type(message).__name__} message")
        return message, frame.header.stream_id

    def expect(self, frame: Frame, *expected: type[Any]) -> Message:
        """Decode ``frame`` as one of the ``expected`` message types (see receive_message).

        Error from the peer raises RemoteError unless Error is among ``expected``.
        """
        if frame.header.kind is FrameKind.BLOCK:
            raise ProtocolViolation(f"unexpected BLOCK frame, expected {_names(expected)}")
        message = decode_message(frame.header.kind, frame.payload)
        if isinstance(message, Error) and Error not in expected:
            raise remote_error(message.code, message.message, self.peer)
        if not isinstance(message, expected):
            raise ProtocolViolation(
                f"unexpected {type(message).__name__} message, expected {_names(expected)}"
            )
        return message

    def parse_block(self, frame: Frame) -> BlockFrame:
        """Split a BLOCK frame into CID and bytes (decompressed, bounded by the limits).

        An unchecked frame (see ``receive_frame``) stays unchecked only if it is
        uncompressed and well formed: anything that fails here is CRC-checked first, so
        that corruption is reported as ChecksumMismatch, not as a malformed block.
        """
        if frame.header.kind is not FrameKind.BLOCK:
            raise ProtocolViolation(f"expected a BLOCK frame, got {frame.header.kind.name}")
        if not frame.checked and frame.header.compression is not Compression.NONE:
            frame.check_crc()
            frame = Frame(frame.header, frame.payload)
        try:
            prefix = parse_block_prefix(frame.payload, max_raw_len=self.limits.max_block_bytes)
            body = frame.payload[prefix.size :]
            data = decompress(body, frame.header.compression, prefix.raw_len)
        except ProtocolViolation:
            if not frame.checked:
                frame.check_crc()
            raise
        view = data if isinstance(data, memoryview) else memoryview(data)
        return BlockFrame(
            prefix.cid,
            view,
            HEADER_SIZE + frame.payload.nbytes,
            frame.header.compression,
            None if frame.checked else frame,
        )


def _names(types: tuple[type, ...]) -> str:
    return " or ".join(t.__name__ for t in types)
