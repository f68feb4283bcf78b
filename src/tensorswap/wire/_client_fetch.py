"""BlockClient's fetch path: get_blocks and pull, every block hash-checked before it is stored."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from tensorswap.cid import Cid, Multicodec
from tensorswap.errors import HashMismatch
from tensorswap.store.base import BlockStore
from tensorswap.store.manifest import decode_manifest, read_manifest
from tensorswap.wire._client_base import _CIDS_PER_MESSAGE, ClientBase
from tensorswap.wire._sink import BlockSink
from tensorswap.wire.connection import BlockFrame
from tensorswap.wire.errors import BlockHashMismatch, ProtocolViolation, RemoteError
from tensorswap.wire.frames import FrameKind
from tensorswap.wire.messages import Get, Got, parse_cids, wire_cids

__all__ = ["FetchPath", "PullResult"]


@dataclass(frozen=True, slots=True)
class PullResult:
    """What a pull did: ``fetched`` blocks (``fetched_bytes``) of a closure of ``blocks``."""

    root: Cid
    blocks: int
    fetched: int
    fetched_bytes: int
    seconds: float


class FetchPath(ClientBase):
    """The fetch requests of BlockClient: get_blocks and pull."""

    # ── fetching ─────────────────────────────────────────────────────────────
    async def get_blocks(self, cids: Sequence[Cid], into: BlockStore) -> list[Cid]:
        """Fetch blocks into ``into`` (each hash-checked before it is stored).

        Returns the CIDs the server does not hold (each CID is asked for once, however often
        ``cids`` names it). Raises ProtocolViolation if the server sends a block that was not
        asked for or sends one twice, or if its Got does not name exactly the requested
        blocks it did not send.
        """
        async with self._exchange():
            missing, _, _ = await self._get(cids, into)
            return missing

    async def _get(
        self,
        cids: Sequence[Cid],
        into: BlockStore,
        *,
        manifests: bool = False,
        have: Sequence[Cid] | None = None,
    ) -> tuple[list[Cid], int, int]:
        """Get ``cids``; with ``manifests``, also accept the manifests they link to, and
        with ``have`` (Get ``closure``) every block they link to, except ``have`` (the server
        sends them after the requested blocks when it knows the flags). Returns the CIDs the
        server lacks, and the bytes and blocks received."""
        missing: list[Cid] = []
        unique = list(dict.fromkeys(cids))  # each block asked for (and accepted) once
        sink = BlockSink(into)
        closure = have is not None
        below = _Below(chunks=closure) if manifests or closure else None
        held = wire_cids(list(dict.fromkeys(have or ()))[:_CIDS_PER_MESSAGE])
        try:
            for start in range(0, len(unique), _CIDS_PER_MESSAGE):
                batch = unique[start : start + _CIDS_PER_MESSAGE]
                wanted = set(batch)  # asked for and not received yet
                if below is not None:  # each batch's answer may bring a linked block once
                    below.received.clear()
                get = Get(cids=wire_cids(batch), manifests=manifests, closure=closure, have=held)
                stream = self.exchanges.next_stream()
                await self.conn.send_message(get, stream)
                self.exchanges.expect(stream, FrameKind.GOT)
                missing += await self._receive_answer(batch, wanted, below, sink)
            await sink.drain()
        finally:
            await sink.close()
        return missing, sink.nbytes, sink.blocks

    async def _receive_answer(
        self, batch: list[Cid], wanted: set[Cid], below: _Below | None, sink: BlockSink
    ) -> list[Cid]:
        """The BLOCK frames and the Got answering a Get of ``batch`` (``wanted``: those not
        received yet), each block into ``sink``; the CIDs the server said it lacks."""
        while True:
            frame = await self.exchanges.receive(defer_block_crc=True)
            if frame.header.kind is not FrameKind.BLOCK:
                got = self.conn.expect(frame, Got)
                assert isinstance(got, Got)  # expect() checked the type
                return _check_got(parse_cids(got.missing, "Got"), wanted)
            block = self.conn.parse_block(frame)
            if block.cid in wanted:
                wanted.discard(block.cid)
                if below is not None:
                    below.learn(block)
            elif below is None or not below.accept(block):
                block.check_crc()  # a corrupted CID is a checksum mismatch
                again = "again" if block.cid in batch else "not asked for"
                raise ProtocolViolation(f"server sent block {block.cid} {again}")
            await sink.submit(block)

    async def request_blocks(
        self,
        app: str,
        body: bytes,
        into: BlockStore,
        roots_of: Callable[[bytes], list[Cid]],
        *,
        timeout: float | Literal["read"] | None = "read",
    ) -> tuple[bytes, PullResult]:
        """``request``, for an application that follows its reply with blocks (a handler
        returning a ``BlocksReply``): the reply body, then the closure of the roots that
        ``roots_of(body)`` names (the server leaves out what it knows this client holds),
        every block hash-checked into ``into``, as a Get with ``closure`` would bring them.
        The same errors as ``request`` (``unsupported``: no such application there, and
        nothing follows), and as ``get_blocks`` for the blocks."""
        start = time.perf_counter()
        async with self._exchange():
            reply = await self._request(app, body, timeout, then_blocks=True)
            roots = list(dict.fromkeys(roots_of(reply)))
            sink = BlockSink(into)
            try:
                await self._receive_answer(roots, set(roots), _Below(chunks=True), sink)
                await sink.drain()
            finally:
                await sink.close()
        root = roots[0] if roots else Cid.of(b"")
        pulled = PullResult(
            root, sink.blocks, sink.blocks, sink.nbytes, time.perf_counter() - start
        )
        return reply, pulled

    async def pull(
        self, root: Cid, into: BlockStore, *, have: Sequence[Cid] | None = None
    ) -> PullResult:
        """Fetch whatever ``into`` lacks of the closure of ``root``, level by level.

        Each Get asks for the manifests below the requested ones too: a server that sends
        them (Get ``manifests``) makes a pull of an update two round trips (its manifests,
        then the chunks lacking), whatever its depth. With ``have`` (the blocks of the
        closure ``into`` may already hold, e.g. those of an update this peer submitted),
        the first Get asks for the whole closure but those (Get ``closure``): one round
        trip, at the price of resending any block ``into`` holds that ``have`` omits.
        Either way, what did not come is asked for level by level, so the result is the
        same.

        Raises RemoteError (code ``not_found``) if the server lacks a block of the closure.
        """
        start = time.perf_counter()
        frontier = [root]
        blocks = fetched = fetched_bytes = 0
        async with self._exchange():
            while frontier:
                blocks += len(frontier)
                lacking = await asyncio.to_thread(into.missing, frontier)
                if lacking:
                    absent, nbytes, count = await self._get(
                        lacking, into, manifests=True, have=have
                    )
                    have = None  # only the first Get asks for the closure
                    if absent:
                        msg = f"server lacks {len(absent)} blocks of {root}, first {absent[0]}"
                        raise RemoteError("not_found", msg, self.conn.peer)
                    fetched += count
                    fetched_bytes += nbytes
                frontier = await asyncio.to_thread(_links, into, frontier)
        return PullResult(root, blocks, fetched, fetched_bytes, time.perf_counter() - start)


class _Below:
    """The blocks a Get with ``manifests`` (or ``closure``: ``chunks``) may bring unasked:
    manifests (and chunks) linked from a manifest received in it, each once. A manifest is
    checked (CRC32C, hash) before its links are trusted."""

    def __init__(self, chunks: bool = False) -> None:
        self.chunks = chunks
        self.allowed: set[Cid] = set()
        self.received: set[Cid] = set()

    def learn(self, block: BlockFrame) -> None:
        """Note the links of ``block`` if it is a manifest (it is checked first)."""
        if block.cid.codec is not Multicodec.TENSORSWAP_MANIFEST:
            return
        block.check_crc()
        try:
            block.cid.verify(block.data, "a manifest received")
        except HashMismatch as exc:
            raise BlockHashMismatch(block.cid, exc.actual) from exc
        links = decode_manifest(block.data, block.cid).links()
        if self.chunks:
            self.allowed.update(links)
        else:
            self.allowed.update(c for c in links if c.codec is Multicodec.TENSORSWAP_MANIFEST)

    def accept(self, block: BlockFrame) -> bool:
        """Whether an unrequested ``block`` is a linked one not received yet."""
        cid = block.cid
        if cid not in self.allowed or cid in self.received:
            return False
        self.received.add(cid)
        self.learn(block)
        return True


def _check_got(missing: list[Cid], unanswered: set[Cid]) -> list[Cid]:
    """A Got's ``missing``, which must name exactly the requested blocks not sent."""
    named = set(missing)
    if len(named) != len(missing) or named != unanswered:
        claimed = len(named - unanswered)
        unsent = len(unanswered - named)
        raise ProtocolViolation(
            f"Got does not match the blocks sent: {unsent} requested blocks neither sent nor "
            f"listed missing, {claimed} listed missing that were sent or not requested, "
            f"{len(missing) - len(named)} listed twice"
        )
    return missing


def _links(store: BlockStore, cids: Sequence[Cid]) -> list[Cid]:
    links: list[Cid] = []
    for cid in cids:
        if cid.codec is Multicodec.TENSORSWAP_MANIFEST:
            links.extend(read_manifest(store, cid).links())
    return links
