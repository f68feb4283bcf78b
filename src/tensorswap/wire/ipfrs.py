"""ipfrs-compatible gradient streams (seed 001): chunking, reassembly and the 16-byte frame."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import struct
import zlib
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Self

import numpy as np

from tensorswap.codec.garw import float32_vector
from tensorswap.codec.ipfrs import decode_ipfrs_gradient, encode_ipfrs_gradient
from tensorswap.errors import CodecError
from tensorswap.wire._pipeline import cpu_workers, prefetched
from tensorswap.wire.errors import (
    ChecksumMismatch,
    ChunkIndexOutOfRange,
    ConnectionFailed,
    DuplicateChunk,
    FrameTooLarge,
    IncompleteStream,
    InvalidChunkPayload,
    PeerTimeout,
    StreamEnded,
    TotalChunksMismatch,
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

DEFAULT_CHUNK_SIZE = 65_536
"""Values per chunk in ipfrs (65,536 float32, about 256 KiB of values)."""
FRAME_HEADER_SIZE = 16
_FRAME = struct.Struct("<IIII")
_CHECK_DEPTH = 4  # chunks checked (CRC-32, decode) in worker threads while the next arrive
_BATCH = 16  # chunks checksummed per worker task (a thread hop per 65,536-value chunk costs)
_U32_MAX = 2**32 - 1

StreamReader = asyncio.StreamReader | Transport
StreamWriter = asyncio.StreamWriter | Transport


def crc32(data: Buffer) -> int:
    """CRC-32 (IEEE 802.3, as zlib and crc32fast compute it) of ``data``."""
    return zlib.crc32(data) & 0xFFFFFFFF


def chunk_count(n_values: int, chunk_size: int) -> int:
    """Chunks for ``n_values``: ceiling division, and 1 for an empty gradient (ipfrs rule)."""
    size = max(chunk_size, 1)
    return max(1, -(-n_values // size))


@dataclass(frozen=True, slots=True)
class IpfrsLimits:
    """Bounds on what a peer's frame headers may make the receiver allocate."""

    max_payload_len: int = 64 * 1024 * 1024
    """Largest chunk payload (the default 65,536-value chunk is about 512 KiB)."""
    max_total_chunks: int = 1 << 20
    """Largest total_chunks a stream may announce."""
    max_total_bytes: int = 8 * 1024**3
    """Largest sum of payload bytes of one stream."""
    max_in_place_bytes: int = 1024**3
    """Largest result a receiver allocates up front, from the first header, to receive the
    chunks straight into (``total_chunks * chunk_size`` float32). A stream announcing more is
    received chunk by chunk (memory grows with the bytes that really arrive) and joined at
    the end."""


@dataclass(frozen=True, slots=True)
class IpfrsFrameHeader:
    """``[chunk_index u32][total_chunks u32][payload_len u32][crc32 u32]``, little-endian."""

    chunk_index: int
    total_chunks: int
    payload_len: int
    checksum: int

    def pack(self) -> bytes:
        return _FRAME.pack(self.chunk_index, self.total_chunks, self.payload_len, self.checksum)

    @classmethod
    def unpack(cls, data: Buffer, limits: IpfrsLimits | None = None) -> Self:
        """Parse 16 bytes; FrameTooLarge when payload_len or total_chunks exceed ``limits``."""
        lim = limits or IpfrsLimits()
        header = cls(*_FRAME.unpack(bytes(data)))
        if header.payload_len > lim.max_payload_len:
            raise FrameTooLarge("ipfrs payload_len", header.payload_len, lim.max_payload_len)
        if header.total_chunks > lim.max_total_chunks:
            raise FrameTooLarge("ipfrs total_chunks", header.total_chunks, lim.max_total_chunks)
        return header


@dataclass(frozen=True, slots=True, eq=False)
class GradientChunk:
    """One chunk of a gradient stream: a slice of the values as an ipfrs gradient file."""

    session_id: str
    chunk_index: int
    total_chunks: int
    payload: Buffer
    """The Arrow IPC file bytes of this slice (any bytes-like object)."""
    checksum: int
    """CRC-32 (IEEE) of ``payload`` as sent."""

    @staticmethod
    def compute_checksum(data: Buffer) -> int:
        return crc32(data)

    def verify_checksum(self) -> bool:
        return crc32(self.payload) == self.checksum

    @property
    def header(self) -> IpfrsFrameHeader:
        length = memoryview(self.payload).nbytes
        return IpfrsFrameHeader(self.chunk_index, self.total_chunks, length, self.checksum)


@dataclass(frozen=True, slots=True)
class _Template:
    """The ipfrs gradient file of ``n`` values is ``prefix + values + suffix``.

    Everything but the values (magic, schema, record-batch message, validity bitmaps, the
    index column 0..n-1, padding, footer) depends on ``n`` alone, so a sender frames a chunk
    from the gradient's own memory between two cached byte strings, and checksums only the
    values (the prefix's CRC-32 is cached). A receiver that finds the same prefix and
    suffix around the values knows where they are without decoding the file.
    """

    n: int
    prefix: bytes
    suffix: bytes
    prefix_crc: int

    @property
    def nbytes(self) -> int:
        return len(self.prefix) + 4 * self.n + len(self.suffix)

    def crc(self, values: Buffer) -> int:
        """CRC-32 of ``prefix + values + suffix``, reading only ``values``."""
        return zlib.crc32(self.suffix, zlib.crc32(values, self.prefix_crc)) & 0xFFFFFFFF

    def frames_around(self, prefix: memoryview, suffix: memoryview) -> bool:
        """Whether received prefix and suffix bytes are this template's."""
        return _same(prefix, self.prefix) and _same(suffix, self.suffix)


def _same(a: memoryview, b: bytes) -> bool:
    return a.nbytes == len(b) and bool(
        np.array_equal(np.frombuffer(a, np.uint8), np.frombuffer(b, np.uint8))
    )


_TEMPLATE_MAX_VALUES = 1 << 22  # above this, chunks are encoded one by one (cache memory)


@functools.lru_cache(maxsize=8)
def _template(n: int) -> _Template | None:
    """Where the values sit in ``encode_ipfrs_gradient`` of n values (encode twice, diff).

    None if the file does not hold them verbatim in one place, or for chunks of more than
    ``_TEMPLATE_MAX_VALUES`` values (callers then encode each chunk).
    """
    if n > _TEMPLATE_MAX_VALUES:
        return None
    zeros = encode_ipfrs_gradient(np.zeros(n, np.float32))
    ones = encode_ipfrs_gradient(np.full(4 * n, 0xFF, np.uint8).view(np.float32))
    if len(zeros) != len(ones):
        return None
    if n == 0:
        return _Template(0, zeros, b"", crc32(zeros)) if zeros == ones else None
    differ = np.flatnonzero(np.frombuffer(zeros, np.uint8) != np.frombuffer(ones, np.uint8))
    start, end = int(differ[0]), int(differ[-1]) + 1
    if end - start != 4 * n:
        return None
    return _Template(n, zeros[:start], zeros[end:], crc32(zeros[:start]))


class GradientReassembler:
    """Collects the chunks of one stream in any order and checks each as it arrives.

    ``add`` raises, for the chunk at hand: ChunkIndexOutOfRange, TotalChunksMismatch (against
    the first chunk added), DuplicateChunk, ChecksumMismatch or InvalidChunkPayload; a chunk
    that raised is not kept. ``result`` raises IncompleteStream until every chunk is in.
    ``add`` is ``claim`` + ``verify`` + ``accept``; a receiver may run ``verify`` (CRC-32 and
    decoding, thread-safe) in a worker thread between the other two.
    """

    def __init__(self) -> None:
        self.total: int | None = None
        self._claimed: set[int] = set()
        self._parts: dict[int, np.ndarray] = {}
        self._out: np.ndarray | None = None  # the gradient, when chunks are received in place
        self._stride = 0
        self._placed: set[int] = set()

    def place(self, index: int, stride: int, limit: int) -> np.ndarray | None:
        """Where chunk ``index`` of ``stride`` values goes in the result, to receive into.

        The result is allocated on first use, for ``total * stride`` values, only if that
        is at most ``limit`` bytes (and the allocation succeeds) and every chunk so far was
        placed with this stride; otherwise None (receive the chunk apart). The values count
        once ``accept`` ed.
        """
        total = self.total
        if total is None or index >= total - 1:  # the last chunk may be shorter
            return None
        if self._out is None:
            if total * stride * 4 > limit:
                return None
            try:
                self._out = np.empty(total * stride, np.float32)
            except MemoryError:
                return None  # receive the chunks apart, as they come
            self._stride = stride
        elif stride != self._stride:
            return None
        return self._out[index * stride : (index + 1) * stride]

    def accept_placed(self, index: int) -> None:
        """Keep the verified values received in place for a claimed chunk."""
        assert self._out is not None
        stride = self._stride
        self._placed.add(index)
        self._parts[index] = self._out[index * stride : (index + 1) * stride]

    @property
    def received(self) -> int:
        return len(self._parts)

    @property
    def claimed(self) -> int:
        """Chunks whose headers were accepted (verified or not yet)."""
        return len(self._claimed)

    @property
    def complete(self) -> bool:
        return self.total is not None and len(self._parts) == self.total

    def check_header(self, header: IpfrsFrameHeader) -> None:
        """The index/total checks of ``add``, before the payload is read."""
        index, total = header.chunk_index, header.total_chunks
        if index >= total:
            raise ChunkIndexOutOfRange(index, total)
        if self.total is not None and total != self.total:
            raise TotalChunksMismatch(index, self.total, total)
        if index in self._claimed:
            raise DuplicateChunk(index)

    def claim(self, header: IpfrsFrameHeader) -> None:
        """Check and reserve the header's index (the stream's total is fixed by the first)."""
        self.check_header(header)
        self.total = header.total_chunks
        self._claimed.add(header.chunk_index)

    @staticmethod
    def verify(chunk: GradientChunk) -> np.ndarray:
        """The chunk's values after its CRC-32 and payload are checked."""
        actual = crc32(chunk.payload)
        if actual != chunk.checksum:
            raise ChecksumMismatch(chunk.chunk_index, chunk.checksum, actual)
        try:
            return decode_ipfrs_gradient(chunk.payload)
        except CodecError as exc:
            raise InvalidChunkPayload(chunk.chunk_index, str(exc)) from exc

    def accept(self, index: int, values: np.ndarray) -> None:
        """Keep the verified values of a claimed chunk."""
        self._parts[index] = values

    def add(self, chunk: GradientChunk) -> None:
        total = self.total
        self.claim(chunk.header)
        try:
            values = self.verify(chunk)
        except BaseException:
            self._claimed.discard(chunk.chunk_index)
            self.total = total if not self._claimed else self.total
            raise
        self.accept(chunk.chunk_index, values)

    def result(self) -> np.ndarray:
        """The gradient (float32, 1-D), chunks joined in index order."""
        if self.total is None or not self.complete:
            raise IncompleteStream(len(self._parts), self.total)
        if self.total == 1:
            return np.array(self._parts[0], dtype=np.float32)  # own the memory, writable
        last = self._parts[self.total - 1]
        out, stride = self._out, self._stride
        if out is not None and len(self._placed) == self.total - 1 and last.size <= stride:
            start = (self.total - 1) * stride  # every other chunk is in place already
            out[start : start + last.size] = last
            return out[: start + last.size]
        return np.concatenate([self._parts[i] for i in range(self.total)])


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
                        payload = await _read(stream, header.payload_len, what, partial_ok=False)
                        assert payload is not None
                        chunk = GradientChunk(
                            self.session_id,
                            header.chunk_index,
                            header.total_chunks,
                            payload,
                            header.checksum,
                        )
                        check = _Check(chunk, None)
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
