"""BlockClient's fetch path: get_blocks and pull, every block hash-checked before it is stored."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

from tensorswap.cid import Cid, Multicodec
from tensorswap.store.base import BlockStore
from tensorswap.store.manifest import read_manifest
from tensorswap.wire._client_base import _CIDS_PER_MESSAGE, ClientBase
from tensorswap.wire._sink import BlockSink
from tensorswap.wire.errors import ProtocolViolation, RemoteError
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
        async with self._lock:
            missing, _ = await self._get(cids, into)
            return missing

    async def _get(self, cids: Sequence[Cid], into: BlockStore) -> tuple[list[Cid], int]:
        missing: list[Cid] = []
        unique = list(dict.fromkeys(cids))  # each block asked for (and accepted) once
        sink = BlockSink(into)
        try:
            for start in range(0, len(unique), _CIDS_PER_MESSAGE):
                batch = unique[start : start + _CIDS_PER_MESSAGE]
                wanted = set(batch)  # asked for and not received yet
                await self.conn.send_message(Get(cids=wire_cids(batch)), self._next_stream())
                while True:
                    frame = await self.conn.receive_frame(defer_block_crc=True)
                    if frame.header.kind is not FrameKind.BLOCK:
                        got = self.conn.expect(frame, Got)
                        assert isinstance(got, Got)  # expect() checked the type
                        missing.extend(_check_got(parse_cids(got.missing, "Got"), wanted))
                        break
                    block = self.conn.parse_block(frame)
                    if block.cid not in wanted:
                        block.check_crc()  # a corrupted CID is a checksum mismatch
                        again = "again" if block.cid in batch else "not asked for"
                        raise ProtocolViolation(f"server sent block {block.cid} {again}")
                    wanted.discard(block.cid)
                    await sink.submit(block)
            await sink.drain()
        finally:
            await sink.close()
        return missing, sink.nbytes

    async def pull(self, root: Cid, into: BlockStore) -> PullResult:
        """Fetch whatever ``into`` lacks of the closure of ``root``, level by level.

        Raises RemoteError (code ``not_found``) if the server lacks a block of the closure.
        """
        start = time.perf_counter()
        frontier = [root]
        blocks = fetched = fetched_bytes = 0
        async with self._lock:
            while frontier:
                blocks += len(frontier)
                lacking = await asyncio.to_thread(into.missing, frontier)
                if lacking:
                    absent, nbytes = await self._get(lacking, into)
                    if absent:
                        msg = f"server lacks {len(absent)} blocks of {root}, first {absent[0]}"
                        raise RemoteError("not_found", msg, self.conn.peer)
                    fetched += len(lacking)
                    fetched_bytes += nbytes
                frontier = await asyncio.to_thread(_links, into, frontier)
        return PullResult(root, blocks, fetched, fetched_bytes, time.perf_counter() - start)


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
