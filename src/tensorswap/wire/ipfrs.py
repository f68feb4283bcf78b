"""ipfrs-compatible gradient streams (seed 001): GradientStreamSession over the 16-byte frame."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Self

import numpy as np

from tensorswap.codec.garw import float32_vector
from tensorswap.codec.ipfrs import encode_ipfrs_gradient
from tensorswap.wire._ipfrs_chunks import (
    _FRAME,
    DEFAULT_CHUNK_SIZE,
    FRAME_HEADER_SIZE,
    GradientChunk,
    GradientReassembler,
    IpfrsFrameHeader,
    IpfrsLimits,
    _Template,
    _template,
    chunk_count,
    crc32,
)
from tensorswap.wire._pipeline import cpu_workers, prefetched
from tensorswap.wire.errors import (
    ChecksumMismatch,
    ConnectionFailed,
    DuplicateChunk,
    FrameTooLarge,
    IncompleteStream,
    PeerTimeout,
    StreamEnded,
    UnexpectedEof,
)
from tensorswap.wire.transport import Transport

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "FRAME_HEADER_SIZE",
    "GradientChunk",
    "GradientReassembler",
    "GradientStreamSession",
    "IpfrsFrameHeader",
    "IpfrsLimits",
    "chunk_count",
    "crc32",
]

_CHECK_DEPTH = 4  # chunks checked (CRC-32, decode) in worker threads while the next arrive
_BATCH = 16  # chunks checksummed per worker task (a thread hop per 65,536-value chunk costs)
_U32_MAX = 2**32 - 1

StreamReader = asyncio.StreamReader | Transport
StreamWriter = asyncio.StreamWriter | Transport


class GradientStreamSession:
    """Splits gradients into ipfrs chunks and streams them with the ipfrs 16-byte frame.

    Byte-compatible with ipfrs-transport 0.2 ``GradientStreamSession``. Differences (on
    purpose): EOF before the first frame raises StreamEnded instead of returning an empty
    gradient; EOF inside a frame raises UnexpectedEof; header lengths are bounded by
    ``limits`` before anything is allocated; duplicate, out-of-range and inconsistent chunks
    are refused with their own errors.
    """

    def __init__(
        self,
        session_id: str = "",
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        *,
        limits: IpfrsLimits | None = None,
        read_timeout: float | None = 60.0,
    ) -> None:
        if chunk_size < 0:
            raise ValueError(f"chunk_size must not be negative, got {chunk_size}")
        self.session_id = session_id
        self.chunk_size = max(chunk_size, 1)  # as ipfrs: a size of 0 becomes 1
        self.limits = limits or IpfrsLimits()
        self.read_timeout = read_timeout

    @classmethod
    def with_defaults(cls, session_id: str = "") -> Self:
        return cls(session_id, DEFAULT_CHUNK_SIZE)

    # ── chunking ─────────────────────────────────────────────────────────────
    def _slices(self, values: np.ndarray) -> list[np.ndarray]:
        if values.size == 0:
            return [values]
        return [values[i : i + self.chunk_size] for i in range(0, values.size, self.chunk_size)]

    def _chunk(self, index: int, total: int, part: np.ndarray) -> GradientChunk:
        payload = encode_ipfrs_gradient(part)
        return GradientChunk(self.session_id, index, total, payload, crc32(payload))

    def iter_chunks(self, gradient: Any) -> Iterator[GradientChunk]:
        """The chunks of ``gradient`` (float32, flattened), encoded one at a time."""
        values = float32_vector(gradient)
        parts = self._slices(values)
        for index, part in enumerate(parts):
            yield self._chunk(index, len(parts), part)

    def encode_gradient(self, gradient: Any) -> list[GradientChunk]:
        """All chunks of ``gradient``: ``chunk_count(n, chunk_size)`` of them, in order."""
        return list(self.iter_chunks(gradient))

    def decode_chunks(self, chunks: Iterable[GradientChunk]) -> np.ndarray:
        """Reassemble chunks given in any order into the gradient (float32, 1-D).

        Checks, in this order: each chunk's index and total (ChunkIndexOutOfRange,
        TotalChunksMismatch, DuplicateChunk), completeness (IncompleteStream, also for an
        empty list), then per chunk in index order the CRC-32 (ChecksumMismatch) and the
        payload (InvalidChunkPayload).
        """
        items = list(chunks)
        probe = GradientReassembler()
        seen: dict[int, GradientChunk] = {}
        for chunk in items:
            probe.check_header(chunk.header)
            probe.total = chunk.total_chunks
            if chunk.chunk_index in seen:
                raise DuplicateChunk(chunk.chunk_index)
            seen[chunk.chunk_index] = chunk
        if not items or len(seen) != probe.total:
            raise IncompleteStream(len(seen), probe.total)
        assembler = GradientReassembler()
        for index in sorted(seen):
            assembler.add(seen[index])
        return assembler.result()

    # ── streaming ────────────────────────────────────────────────────────────
    async def stream_to(self, gradient: Any, stream: StreamWriter, *, prefetch: int = 2) -> int:
        """Send ``gradient`` as ipfrs frames; return the number of chunks sent.

        Each chunk's file is sent as a cached prefix, the chunk's values straight from the
        gradient's memory, and a cached suffix (the bytes ``encode_ipfrs_gradient`` makes);
        CRC-32s are computed in worker threads, ``prefetch`` batches of chunks ahead of the
        socket. The stream is not closed (frames of several gradients may follow). A cancel
        may leave a partial frame on the stream: close it then.
        """
        values = float32_vector(gradient)
        parts = self._slices(values)
        total = len(parts)
        if total > _U32_MAX:
            raise ValueError(f"{total} chunks do not fit the u32 total_chunks field")
        batches = [range(i, min(i + _BATCH, total)) for i in range(0, total, _BATCH)]

        def frame(indices: range) -> list[Buffer]:
            out: list[Buffer] = []
            for index in indices:
                part = parts[index]
                template = _template(part.size)
                if template is None:  # a huge chunk size: encode the file
                    chunk = self._chunk(index, total, part)
                    out += (chunk.header.pack(), chunk.payload)
                    continue
                data = part.view(np.uint8).data
                crc = template.crc(data)
                head = _FRAME.pack(index, total, template.nbytes, crc)
                out += (head, template.prefix, data, template.suffix)
            return out

        try:
            framed = prefetched(batches, frame, prefetch, cpu_workers())
            async with contextlib.aclosing(framed) as it:
                async for pieces in it:
                    await _write(stream, *pieces)
        except OSError as exc:
            raise ConnectionFailed(_peer(stream), str(exc)) from exc
        return total

    async def receive_from(self, stream: StreamReader) -> np.ndarray:
        """Read frames until the stream's gradient is complete; return it (float32, 1-D).

        Reads exactly ``total_chunks`` frames, so later bytes on the stream are left unread.
        Raises StreamEnded when the stream ends before the first frame, IncompleteStream when
        it ends between frames with chunks missing, UnexpectedEof inside a frame,
        FrameTooLarge for lengths above ``limits`` (nothing allocated), PeerTimeout when a
        frame takes longer than ``read_timeout``, and the reassembler's chunk errors.

        From a Transport, chunks of ``chunk_size`` values are received straight into the
        result (no copy, no per-chunk buffers) when their files have the layout this module
        writes; any other file is received apart, checked and decoded in full.
        """
        assembler = GradientReassembler()
        checking: deque[tuple[list[int], asyncio.Future[list[np.ndarray | None]]]] = deque()

        async def settle_oldest() -> None:
            indices, future = checking.popleft()
            for index, values in zip(indices, await future, strict=True):
                if values is None:
                    assembler.accept_placed(index)
                else:
                    assembler.accept(index, values)

        try:
            await self._receive_frames(stream, assembler, checking, settle_oldest)
            while checking:
                await settle_oldest()
        finally:
            for _, future in checking:
                future.cancel()
            if checking:
                await asyncio.gather(*(f for _, f in checking), return_exceptions=True)
        return assembler.result()

    async def _receive_frames(
        self,
        stream: StreamReader,
        assembler: GradientReassembler,
        checking: deque[tuple[list[int], asyncio.Future[list[np.ndarray | None]]]],
        settle_oldest: Callable[[], Awaitable[None]],
    ) -> None:
        """Read frames until every chunk is claimed; CRC and decoding run in worker threads.

        Checks queue in batches; a batch goes to a worker when full, or when the frames
        so far are all claimed (the last one), or when too many batches are in flight.
        """
        total_bytes = 0
        batch: list[tuple[int, _Check]] = []
        loop = asyncio.get_running_loop()
        template = None
        if isinstance(stream, Transport) and 8 * self.chunk_size <= self.limits.max_payload_len:
            template = _template(self.chunk_size)  # only chunks a frame could carry
        scratch = np.empty(0 if template is None else template.nbytes - 4 * template.n, np.uint8)

        async def flush() -> None:
            nonlocal batch
            if not batch:
                return
            while len(checking) >= _CHECK_DEPTH:
                await settle_oldest()
            work = [check for _, check in batch]
            future = loop.run_in_executor(cpu_workers(), _run_checks, work)
            checking.append(([index for index, _ in batch], future))
            batch = []

        while assembler.total is None or assembler.claimed < assembler.total:
            try:
                async with asyncio.timeout(self.read_timeout):
                    raw = await _read(stream, FRAME_HEADER_SIZE, "ipfrs frame header")
                    if raw is None:
                        if assembler.claimed == 0:
                            raise StreamEnded("ipfrs gradient stream")
                        await flush()
                        while checking:  # a bad chunk already in is the better error
                            await settle_oldest()
                        raise IncompleteStream(assembler.received, assembler.total)
                    header = IpfrsFrameHeader.unpack(raw, self.limits)
                    assembler.check_header(header)
                    total_bytes += header.payload_len
                    if total_bytes > self.limits.max_total_bytes:
                        raise FrameTooLarge(
                            "ipfrs stream bytes", total_bytes, self.limits.max_total_bytes
                        )
                    what = f"ipfrs chunk {header.chunk_index} payload"
                    assembler.claim(header)
                    check = None
                    if (
                        template is not None
                        and isinstance(stream, Transport)
                        and header.payload_len == template.nbytes
                    ):
                        check = await self._receive_in_place(
                            stream, assembler, header, template, scratch, what
                        )
                    if check is None:
                        check = await self._receive_copied(stream, header, what)
            except TimeoutError as exc:
                raise PeerTimeout(
                    "an ipfrs frame", self.read_timeout or 0.0, _peer(stream)
                ) from exc
            except OSError as exc:
                raise ConnectionFailed(_peer(stream), str(exc)) from exc
            batch.append((header.chunk_index, check))
            if len(batch) >= _BATCH or assembler.claimed == assembler.total:
                await flush()
        await flush()

    async def _receive_copied(
        self, stream: StreamReader, header: IpfrsFrameHeader, what: str
    ) -> _Check:
        """Read a frame's payload into bytes of its own: the chunk, its check still to run."""
        payload = await _read(stream, header.payload_len, what, partial_ok=False)
        assert payload is not None
        chunk = GradientChunk(
            self.session_id,
            header.chunk_index,
            header.total_chunks,
            payload,
            header.checksum,
        )
        return _Check(chunk, None)

    async def _receive_in_place(
        self,
        stream: Transport,
        assembler: GradientReassembler,
        header: IpfrsFrameHeader,
        template: _Template,
        scratch: np.ndarray,
        what: str,
    ) -> _Check | None:
        """Receive a chunk's values into the result and its other bytes into ``scratch``.

        None if the chunk cannot go in place (nothing read then). A chunk whose bytes
        around the values differ from ``template`` is rebuilt whole and checked in full.
        """
        index = header.chunk_index
        limit = min(self.limits.max_total_bytes, self.limits.max_in_place_bytes)
        target = assembler.place(index, template.n, limit)
        if target is None:
            return None
        head = len(template.prefix)
        around = memoryview(scratch)  # type: ignore[arg-type]
        data = target.view(np.uint8).data
        await stream.receive_exactly(around[:head], what)
        await stream.receive_exactly(data, what)
        await stream.receive_exactly(around[head:], what)
        if template.frames_around(around[:head], around[head:]):
            return _Check(None, (template, data, header))
        whole = b"".join((around[:head], data, around[head:]))  # not our layout: check it all
        chunk = GradientChunk(self.session_id, index, header.total_chunks, whole, header.checksum)
        return _Check(chunk, None)


@dataclass(frozen=True, slots=True)
class _Check:
    """A received chunk to verify: a whole file, or values received in place."""

    chunk: GradientChunk | None
    placed: tuple[_Template, memoryview, IpfrsFrameHeader] | None


def _run_checks(checks: list[_Check]) -> list[np.ndarray | None]:
    """Verify received chunks (worker thread): their values, or None for those in place."""
    out: list[np.ndarray | None] = []
    for check in checks:
        if check.chunk is not None:
            out.append(GradientReassembler.verify(check.chunk))
            continue
        assert check.placed is not None
        template, data, header = check.placed
        actual = template.crc(data)
        if actual != header.checksum:
            raise ChecksumMismatch(header.chunk_index, header.checksum, actual)
        out.append(None)
    return out


async def _write(stream: StreamWriter, *parts: Buffer) -> None:
    if isinstance(stream, Transport):
        await stream.send(*parts)
    else:
        for part in parts:
            stream.write(memoryview(part))
        await stream.drain()


async def _read(
    stream: StreamReader, n: int, what: str, *, partial_ok: bool = True
) -> memoryview | bytes | None:
    """``n`` bytes; None for EOF before the first byte (if ``partial_ok``); else UnexpectedEof."""
    if isinstance(stream, Transport):
        # n is bounded by the caller; uninitialised memory, filled completely before use
        buf = memoryview(np.empty(n, dtype=np.uint8))  # type: ignore[arg-type]
        got = await stream.receive_into(buf)
        if got == n:
            return buf
        if got == 0 and partial_ok and n:
            return None
        raise UnexpectedEof(what, got, n)
    try:
        return await stream.readexactly(n)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial and partial_ok:
            return None
        raise UnexpectedEof(what, len(exc.partial), n) from exc


def _peer(stream: StreamReader | StreamWriter) -> str:
    if isinstance(stream, Transport):
        return stream.peer
    if isinstance(stream, asyncio.StreamWriter):
        return str(stream.get_extra_info("peername"))
    transport = getattr(stream, "_transport", None)  # StreamReader keeps no public handle
    return str(transport.get_extra_info("peername")) if transport is not None else "peer"
