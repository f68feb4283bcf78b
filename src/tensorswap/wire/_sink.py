"""BlockSink: verify and store received blocks on one worker thread, in arrival order, bounded."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from tensorswap.cid import Cid
from tensorswap.errors import HashMismatch
from tensorswap.store.base import BlockStore
from tensorswap.wire._budget import Tie
from tensorswap.wire.connection import BlockFrame
from tensorswap.wire.errors import BlockHashMismatch

__all__ = ["SMALL_BLOCK", "BlockSink"]

SMALL_BLOCK = 16 * 1024
"""Blocks up to this size arriving with none queued are stored on the event loop itself."""


class BlockSink:
    """Stores blocks received from a peer while the next frames are read.

    Guarantees: each block's frame CRC32C (when still due) and its hash are checked before
    it is stored (a mismatch raises ChecksumMismatch / BlockHashMismatch and stores nothing
    of that block); blocks are stored in the order submitted (one worker thread), so a
    manifest sent after its chunks is never visible before them; at most ``depth`` blocks
    wait in memory. ``drain`` waits for everything submitted and raises the first failure.
    ``close`` waits for blocks already submitted, even on error or cancel, so that what
    arrived whole is kept (resume relies on it). ``failed`` is set as soon as a block fails
    its checks, for a caller that must not wait for its next ``submit`` to find out. A
    block's budget share (a ``Tie`` to its bytes), if it came with one, is released once the
    block is stored (the store holds the bytes from then on); a block that fails, or whose
    submit is cancelled, gives its share back when its bytes are freed, never before.
    """

    def __init__(
        self,
        store: BlockStore,
        depth: int = 4,
        on_stored: Callable[[Cid, memoryview], None] | None = None,
    ) -> None:
        self.store = store
        self.depth = depth
        self.on_stored = on_stored
        """Called ``(cid, bytes)`` after each block is checked and stored (must not raise)."""
        self.blocks = 0
        self.nbytes = 0
        self.failed = asyncio.Event()
        """Set once a submitted block failed to be checked or stored (``drain`` raises it)."""
        self._pending: deque[tuple[Cid, asyncio.Future[int]]] = deque()
        # made at the first block that needs it: most connections (inline submits, status,
        # tasks) never push one (an executor is ~3 us and a few objects per connection)
        self._pool: ThreadPoolExecutor | None = None

    def _put(self, block: BlockFrame) -> int:
        block.check_crc()  # a frame whose CRC32C is still due is checked first
        try:
            # one hashing thread: each connection has its own sink, and blake3's own threads
            # only add CPU on a busy server (a 1 MiB block: 0.21 ms either way here, and
            # the spare cores are the other connections')
            self.store.put_verified(block.cid, block.data, adopt=True, threads=1)
        except HashMismatch as exc:
            raise BlockHashMismatch(block.cid, exc.actual) from exc
        if self.on_stored is not None:
            self.on_stored(block.cid, block.data)
        return block.data.nbytes

    async def submit(self, block: BlockFrame, share: Tie | None = None) -> None:
        """Queue ``block`` to be checked and stored; waits while ``depth`` blocks are queued.

        A block whose frame CRC32C is still due (``block.frame``) is checked here too: a
        mismatch raises ChecksumMismatch and stores nothing of it. ``share`` (the budget bytes
        ``block`` holds, tied to them) is released here once the block is stored.
        """
        try:
            while len(self._pending) >= self.depth:
                await self._settle_oldest()
            loop = asyncio.get_running_loop()
            if not self._pending and block.data.nbytes <= SMALL_BLOCK:
                # nothing queued before it, and checking and writing it costs less than a
                # thread hop: stored here and now, still in arrival order
                future: asyncio.Future[int] = loop.create_future()
                try:
                    nbytes = self._put(block)
                except Exception as exc:
                    # its traceback holds this frame, which holds the future: no cycle
                    future.set_exception(exc.with_traceback(None))
                else:
                    if share is not None:
                        share.release()
                    self.blocks += 1
                    self.nbytes += nbytes
                    return
            else:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(1, thread_name_prefix="tensorswap-sink")
                future = loop.run_in_executor(self._pool, self._put, block)
        except BaseException:
            del block  # a traceback keeps this frame: the bytes go with the caller's reference
            raise
        future.add_done_callback(self._settled)
        if share is not None:
            future.add_done_callback(partial(_stored, share))
        self._pending.append((block.cid, future))

    def _settled(self, future: asyncio.Future[int]) -> None:
        if not future.cancelled() and future.exception() is not None:
            self.failed.set()

    @property
    def queued(self) -> set[Cid]:
        """CIDs submitted and not yet stored (they will be, or the connection fails)."""
        return {cid for cid, _ in self._pending}

    async def _settle_oldest(self) -> None:
        _, future = self._pending[0]
        try:
            nbytes = await asyncio.shield(future)
        finally:
            if future.done():
                self._pending.popleft()
            del future  # a failure's traceback holds this frame: it must not hold the future
        self.blocks += 1
        self.nbytes += nbytes

    async def drain(self) -> None:
        """Wait until every submitted block is stored; raise the first failure."""
        while self._pending:
            await self._settle_oldest()

    async def close(self) -> None:
        """Finish the blocks already submitted (their errors are dropped) and stop the worker."""
        try:
            while self._pending:
                _, future = self._pending.popleft()
                try:
                    nbytes = await asyncio.shield(future)
                except asyncio.CancelledError:
                    await asyncio.wait([future])
                    raise
                except Exception:  # reported by drain, or superseded by the caller's error
                    del future  # its error's traceback holds this frame: no cycle
                    continue
                self.blocks += 1
                self.nbytes += nbytes
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=False)


def _stored(share: Tie, future: asyncio.Future[int]) -> None:
    """A block's store finished: its share goes back if it was stored (the store has the bytes
    now); if it failed, the share goes back when the bytes are freed."""
    if not future.cancelled() and future.exception() is None:
        share.release()
