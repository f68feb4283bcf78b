"""BlockClient's push path: offer/want dedup, blocks sent one offer ahead, commit of roots."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from tensorswap.cid import Cid, HashFunction
from tensorswap.codec import TensorBlock
from tensorswap.store.base import BlockStore
from tensorswap.store.manifest import DEFAULT_CHUNK_BYTES, ChunkRef, manifest_closure
from tensorswap.store.tensors import ModelUpdate
from tensorswap.wire._chunks import PreparedChunk, TensorChunker, update_manifest_chunk
from tensorswap.wire._client_base import _CIDS_PER_MESSAGE, ClientBase
from tensorswap.wire._pipeline import cpu_workers, prefetched
from tensorswap.wire.connection import PreparedBlock, prepare_block
from tensorswap.wire.errors import FrameTooLarge, ProtocolViolation
from tensorswap.wire.frames import Compression, CompressionChoice, FrameKind, choose_compression
from tensorswap.wire.messages import Commit, Committed, Offer, Want, parse_cids, wire_cids

__all__ = ["Progress", "PushPath", "PushResult"]

T = TypeVar("T")

Progress = Callable[[int, int], None]
"""Called as ``progress(bytes_done, bytes_total)`` after each block is handed to the socket."""


@dataclass(frozen=True, slots=True)
class PushResult:
    """What a push did: of ``offered`` blocks the server lacked ``sent_blocks``."""

    roots: tuple[Cid, ...]
    offered: int
    sent_blocks: int
    sent_bytes: int
    """Block bytes sent (uncompressed)."""
    wire_bytes: int
    """Every byte this push put on the connection: frames, headers, control messages."""
    seconds: float


@dataclass
class _Tally:
    """Counters of one push in progress."""

    start: float
    wire_start: int
    offered: int = 0
    sent_blocks: int = 0
    sent_bytes: int = 0

    def __post_init__(self) -> None:
        self.seen: set[Cid] = set()

    def result(self, roots: list[Cid], wire_now: int) -> PushResult:
        return PushResult(
            roots=tuple(roots),
            offered=self.offered,
            sent_blocks=self.sent_blocks,
            sent_bytes=self.sent_bytes,
            wire_bytes=wire_now - self.wire_start,
            seconds=time.perf_counter() - self.start,
        )


class PushPath(ClientBase):
    """BlockClient's push requests: missing, push, push_tensor, push_update, put_blocks, commit."""

    # ── dedup ────────────────────────────────────────────────────────────────
    async def missing(self, cids: Sequence[Cid]) -> list[Cid]:
        """The CIDs of ``cids`` the server lacks, in order (sent in batches as Offers)."""
        async with self._exchange():
            return await self._missing(cids)

    async def _missing(self, cids: Sequence[Cid]) -> list[Cid]:
        lacking: list[Cid] = []
        ex = self.exchanges
        for start in range(0, len(cids), _CIDS_PER_MESSAGE):
            batch = cids[start : start + _CIDS_PER_MESSAGE]
            stream = ex.next_stream()
            await self.conn.send_message(Offer(cids=wire_cids(batch)), stream)
            ex.expect(stream, FrameKind.WANT)
            want = await ex.message(Want)
            answer = parse_cids(want.cids, "Want")
            if not set(answer) <= set(batch):
                raise ProtocolViolation("Want names CIDs that were not offered")
            lacking.extend(answer)
        return lacking

    # ── sending ──────────────────────────────────────────────────────────────
    async def push(
        self,
        store: BlockStore,
        roots: Cid | Sequence[Cid],
        *,
        compression: CompressionChoice = Compression.NONE,
        progress: Progress | None = None,
        prefetch: int = 2,
    ) -> PushResult:
        """Make the server hold every block of ``roots`` (manifests and their chunks).

        Learns which blocks of the closure the server lacks, sends only those (children
        before the manifests that list them), then commits the roots; returns once the server
        confirms they are complete and stored. Idempotent: after a broken connection, calling
        it again on a new client sends only the blocks still missing (resume).
        """
        root_list = [roots] if isinstance(roots, Cid) else list(roots)
        start = time.perf_counter()
        wire_start = self.bytes_sent
        async with self._exchange():
            closure = await asyncio.to_thread(_closure, store, root_list)
            lacking = await self._missing(closure)
            sent_bytes = await self._send_blocks(store, lacking, compression, progress, prefetch)
            await self._commit(root_list, len(lacking), sent_bytes)
        return PushResult(
            roots=tuple(root_list),
            offered=len(closure),
            sent_blocks=len(lacking),
            sent_bytes=sent_bytes,
            wire_bytes=self.bytes_sent - wire_start,
            seconds=time.perf_counter() - start,
        )

    async def push_tensor(
        self,
        tensor: TensorBlock,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        hash: HashFunction = HashFunction.BLAKE3,
        compression: CompressionChoice = Compression.NONE,
        progress: Progress | None = None,
        prefetch: int = 16,
        batch: int = 8,
    ) -> PushResult:
        """Chunk, hash and send ``tensor`` in one pipeline, then commit its manifest.

        Chunks are hashed and checksummed in worker threads, at most ``prefetch`` chunks
        ahead of the socket (they are views of the tensor, so this costs no memory unless
        they are compressed), and sent straight from the tensor's memory. Every ``batch``
        chunks are offered and only those the server lacks are sent; the next batch is
        offered before this one's blocks go out, so no round trip stalls the stream.
        Calling this again after a broken connection resumes the transfer. The root CID
        equals ``put_tensor(store, tensor, chunk_bytes=..., hash=...)``. The tensor must not
        be modified until this returns.
        """
        async with self._exchange():
            tally = _Tally(time.perf_counter(), self.bytes_sent)
            offers = _Offers(self, tally, progress, tensor.nbytes)
            root = await self._stream_tensor(
                tensor, offers, chunk_bytes, hash, compression, prefetch, batch
            )
            await offers.flush()
            await self._commit([root], tally.sent_blocks, tally.sent_bytes)
        return tally.result([root], self.bytes_sent)

    async def push_update(
        self,
        update: ModelUpdate,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        hash: HashFunction = HashFunction.BLAKE3,
        compression: CompressionChoice = Compression.NONE,
        progress: Progress | None = None,
        prefetch: int = 16,
        batch: int = 8,
    ) -> PushResult:
        """``push_tensor`` for every tensor of ``update``, then its update manifest; commit.

        The root equals ``put_update(store, update, chunk_bytes=..., hash=...)``.
        """
        async with self._exchange():
            tally = _Tally(time.perf_counter(), self.bytes_sent)
            total = sum(int(values.nbytes) for values in update.tensors.values())
            offers = _Offers(self, tally, progress, total)
            tensors: list[tuple[str, Cid]] = []
            for name, values in update.tensors.items():
                cid = await self._stream_tensor(
                    TensorBlock(name, values),
                    offers,
                    chunk_bytes,
                    hash,
                    compression,
                    prefetch,
                    batch,
                )
                tensors.append((name, cid))
            manifest = update_manifest_chunk(
                update.name, update.num_samples, tensors, dict(update.metadata), hash
            )
            await offers.offer([manifest])
            await offers.flush()
            await self._commit([manifest.cid], tally.sent_blocks, tally.sent_bytes)
        return tally.result([manifest.cid], self.bytes_sent)

    async def _stream_tensor(
        self,
        tensor: TensorBlock,
        offers: _Offers,
        chunk_bytes: int,
        hash: HashFunction,
        compression: CompressionChoice,
        prefetch: int,
        batch: int,
    ) -> Cid:
        """Offer (and send what is wanted of) the tensor's chunks, then its manifest.

        Blocks of the last offers may still be unsent when this returns: ``offers.flush``.
        """
        chunker = await asyncio.to_thread(
            TensorChunker,
            tensor,
            chunk_bytes=chunk_bytes,
            hash=hash,
            compression=compression,
            crc=not self.conn.send_lean,
        )
        refs: list[ChunkRef] = []
        waiting: list[PreparedChunk] = []
        hashed = prefetched(chunker.starts, chunker.prepare, prefetch, cpu_workers())
        async with contextlib.aclosing(hashed) as chunks:
            async for chunk in chunks:
                assert chunk.ref is not None  # chunks always have one
                refs.append(chunk.ref)
                waiting.append(chunk)
                if len(waiting) >= batch:
                    await offers.offer(waiting)
                    waiting = []
        if waiting:
            await offers.offer(waiting)
        manifest = chunker.manifest(refs)
        await offers.offer([manifest])
        return manifest.cid

    async def put_blocks(
        self,
        store: BlockStore,
        cids: Sequence[Cid],
        *,
        compression: CompressionChoice = Compression.NONE,
        progress: Progress | None = None,
        before: Callable[[Cid], Awaitable[None]] | None = None,
    ) -> int:
        """Send these blocks from ``store`` as they are (no offer, no commit); their bytes.

        ``before(cid)``, when given, is awaited before each block goes out (pacing: the
        blocks after it wait meanwhile, at most two of them read ahead)."""
        async with self._exchange():
            return await self._send_blocks(store, cids, compression, progress, 2, before)

    async def commit(self, roots: Sequence[Cid], blocks: int = 0, nbytes: int = 0) -> Committed:
        """Ask the server to confirm everything sent is stored and ``roots`` are complete."""
        async with self._exchange():
            return await self._commit(list(roots), blocks, nbytes)

    async def _commit(self, roots: list[Cid], blocks: int, nbytes: int) -> Committed:
        ex = self.exchanges
        stream = ex.next_stream()
        commit = Commit(roots=wire_cids(roots), blocks=blocks, nbytes=nbytes)
        await self.conn.send_message(commit, stream)
        ex.expect(stream, FrameKind.COMMITTED)
        return await ex.message(Committed)

    async def _send_blocks(
        self,
        store: BlockStore,
        cids: Sequence[Cid],
        compression: CompressionChoice,
        progress: Progress | None,
        prefetch: int,
        before: Callable[[Cid], Awaitable[None]] | None = None,
    ) -> int:
        limit = self.welcome.max_block_bytes
        crc = not self.conn.send_lean

        def load(cid: Cid) -> PreparedBlock:
            data = store.get(cid)
            if data.nbytes > limit:
                raise FrameTooLarge(f"block {cid}", data.nbytes, limit)
            return prepare_block(cid, data, choose_compression(data, compression), crc=crc)

        total = sum(await asyncio.to_thread(_sizes, store, cids)) if progress else 0
        done = 0
        async with contextlib.aclosing(prefetched(cids, load, prefetch)) as blocks:
            async for i, block in _numbered(blocks):
                if before is not None:
                    await before(cids[i])  # blocks come in the order of ``cids``
                await self.conn.send_prepared(block)
                done += block.raw_len
                if progress is not None:
                    progress(done, total)
        return done


class _Offers:
    """Offers batches of prepared blocks and sends the wanted ones, one offer ahead.

    The next batch's Offer goes out before the previous batch's blocks, so its Want is
    already back when those are sent: the stream never waits a round trip. Blocks leave in
    offer order (a manifest offered after its chunks is sent after them). Each CID is
    offered once per push.
    """

    def __init__(self, client: PushPath, tally: _Tally, progress: Progress | None, total: int):
        self.client = client
        self.tally = tally
        self.progress = progress
        self.total = total
        self.pending: deque[tuple[list[PreparedChunk], int]] = deque()

    async def offer(self, chunks: list[PreparedChunk]) -> None:
        tally = self.tally
        fresh = []
        for chunk in chunks:  # equal chunks of one push are offered and sent once
            if chunk.cid not in tally.seen:
                tally.seen.add(chunk.cid)
                fresh.append(chunk)
        tally.offered += len(fresh)
        if not fresh:
            return
        limit = self.client.welcome.max_block_bytes
        for chunk in fresh:
            if chunk.frame.raw_len > limit:
                raise FrameTooLarge(f"block {chunk.cid}", chunk.frame.raw_len, limit)
        ex = self.client.exchanges
        stream = ex.next_stream()
        offer = Offer(cids=wire_cids([c.cid for c in fresh]))
        await self.client.conn.send_message(offer, stream)
        ex.expect(stream, FrameKind.WANT)
        self.pending.append((fresh, stream))
        while len(self.pending) > 1:
            await self._send_oldest()

    async def flush(self) -> None:
        """Send the wanted blocks of every batch offered so far."""
        while self.pending:
            await self._send_oldest()

    async def _send_oldest(self) -> None:
        chunks, _stream = self.pending.popleft()  # the exchanges check the Want's stream
        conn = self.client.conn
        want = await self.client.exchanges.message(Want)
        wanted = set(parse_cids(want.cids, "Want"))
        if not wanted <= {c.cid for c in chunks}:
            raise ProtocolViolation("Want names CIDs that were not offered")
        tally = self.tally
        for chunk in chunks:
            if chunk.cid in wanted:
                await conn.send_prepared(chunk.frame)
                tally.sent_blocks += 1
                tally.sent_bytes += chunk.frame.raw_len
                if self.progress is not None and chunk.ref is not None:
                    self.progress(tally.sent_bytes, self.total)


def _closure(store: BlockStore, roots: Iterable[Cid]) -> list[Cid]:
    """Children before parents, each CID once (reversed depth-first pre-order per root)."""
    order: list[Cid] = []
    seen: set[Cid] = set()
    for root in roots:
        for cid in reversed(manifest_closure(store, root)):
            if cid not in seen:
                seen.add(cid)
                order.append(cid)
    return order


def _sizes(store: BlockStore, cids: Sequence[Cid]) -> list[int]:
    return [store.get(cid, verify=False).nbytes for cid in cids]


async def _numbered(items: AsyncIterator[T]) -> AsyncIterator[tuple[int, T]]:
    i = 0
    async for item in items:
        yield i, item
        i += 1
