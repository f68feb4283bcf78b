"""BlockServer's answers to Commit (the roots' closure check), Get and application Requests."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tensorswap.cid import Cid, Multicodec
from tensorswap.errors import BlockNotFound, StoreError
from tensorswap.store.base import BlockStore
from tensorswap.store.manifest import manifest_closure, read_manifest
from tensorswap.wire._pipeline import prefetched
from tensorswap.wire.connection import FrameConnection, PreparedBlock, prepare_block
from tensorswap.wire.errors import ProtocolViolation
from tensorswap.wire.frames import Compression
from tensorswap.wire.messages import Got, Reply, Request, wire_cids

if TYPE_CHECKING:
    from tensorswap.wire._server_stats import ServerStats

__all__ = ["AppRequest", "BlocksReply", "FailedConnection", "RequestHandler", "ServerHandlers"]


@dataclass(frozen=True, slots=True)
class AppRequest:
    """An application request (a REQUEST frame) as its handler receives it."""

    app: str
    """The application name the client addressed (the key in ``BlockServer.handlers``)."""
    body: bytes
    """The request body, opaque to the wire layer (untrusted: the handler validates it)."""
    peer: str
    """The client's address, for logs and errors."""
    stream_id: int
    operator: bool = False
    """Whether the connection proved the operator key (``BlockServer(operator_key=...)``):
    an application may show the operator what it hides from peers."""


@dataclass(frozen=True, slots=True)
class FailedConnection:
    """A connection that ended in a failure, as ``BlockServer(on_failure=...)`` is told."""

    peer: str
    """The client's address."""
    client: str
    """The name the client gave in its handshake (``BlockClient.connect(name=...)``); empty
    when the connection failed before the handshake. Claimed by the client: with a shared
    key it proves membership, not this name."""
    error: BaseException
    """What ended it (a BlockHashMismatch for a block that does not hash to its CID)."""


class BlocksReply(bytes):
    """A reply body that a handler follows with blocks: the REPLY (these bytes), then
    ``roots`` and every block they link to but ``have``, as the answer to a Get with
    ``closure`` (BLOCK frames, then Got; just Got when ``roots`` is empty). Only for
    applications whose clients expect it (``BlockClient.request_blocks``). A ``bytes``, so
    code that relays reply bodies takes it as one."""

    roots: list[Cid]
    have: list[Cid]

    def __new__(cls, body: bytes, roots: list[Cid], have: list[Cid]) -> BlocksReply:
        reply = super().__new__(cls, body)
        reply.roots, reply.have = list(roots), list(have)
        return reply


RequestHandler = Callable[[AppRequest], Awaitable[bytes]]
"""``async handler(request) -> reply body`` (a BlocksReply to follow it with blocks). A
TensorSwapError it raises fails the connection (ERROR frame, then closed); answer refusals
the client should survive inside the reply body."""


class ServerHandlers:
    """The answers of BlockServer (which sets the state below) to Commit, Get and Request."""

    store: BlockStore
    compression: Compression
    handlers: dict[str, RequestHandler]

    if TYPE_CHECKING:  # BlockServer's property, declared here for the type checker

        @property
        def stats(self) -> ServerStats: ...

    async def _answer_request(
        self, message: Request, peer: str, stream_id: int, *, operator: bool = False
    ) -> tuple[Reply, BlocksReply | None]:
        """The handler's Reply, and the blocks to send after it (a BlocksReply) if any."""
        self.stats.requests += 1
        handler = self.handlers.get(message.app)
        if handler is None:
            return Reply(app=message.app, body=b"", handled=False), None
        body = await handler(AppRequest(message.app, message.body, peer, stream_id, operator))
        then = body if isinstance(body, BlocksReply) else None
        return Reply(app=message.app, body=bytes(body)), then

    def _check_roots(self, roots: list[Cid]) -> None:
        """Check that each root's closure is held: one walk over all of them, so a block
        (and a manifest's decoding) shared by several roots is visited once."""
        seen: set[Cid] = set()
        for root in roots:
            try:  # the part of root's closure not checked for an earlier root
                added = manifest_closure(self.store, root, seen=seen)
            except BlockNotFound as exc:
                msg = f"committed root {root} lacks block {exc.cid}"
                raise ProtocolViolation(msg) from exc
            lacking = self.store.missing(added)
            if lacking:
                raise ProtocolViolation(
                    f"committed root {root} lacks {len(lacking)} blocks, first {lacking[0]}"
                )

    async def _answer_get(
        self,
        conn: FrameConnection,
        cids: list[Cid],
        stream_id: int,
        *,
        below: str = "",
        have: list[Cid] | None = None,
    ) -> None:
        """The requested blocks, then Got; with ``below`` "manifests" or "closure" (Get's
        flags), the blocks linked below them first (unlisted in Got), except ``have``."""
        missing: list[Cid] = []
        crc = not conn.send_lean

        def load(cid: Cid) -> PreparedBlock | None:
            try:
                data = self.store.get(cid)
            except BlockNotFound:
                return None
            return prepare_block(cid, data, self.compression, stream_id, crc=crc)

        async with contextlib.aclosing(prefetched(cids, load, 2)) as blocks:
            index = 0
            async for block in blocks:
                if block is None:
                    missing.append(cids[index])
                else:
                    await conn.send_prepared(block)
                    self.stats.blocks_served += 1
                index += 1
        if below:
            chunks, skip = below == "closure", set(have or ())
            linked = await asyncio.to_thread(linked_blocks, self.store, cids, chunks, skip)
            async with contextlib.aclosing(prefetched(linked, load, 2)) as blocks:
                async for block in blocks:
                    if block is not None:
                        await conn.send_prepared(block)
                        self.stats.blocks_served += 1
        await conn.send_message(Got(missing=wire_cids(missing)), stream_id)


def linked_blocks(
    store: BlockStore, cids: list[Cid], chunks: bool = False, skip: set[Cid] | None = None
) -> list[Cid]:
    """The blocks that manifests among ``cids`` link to, recursively: manifests only, or
    chunks too with ``chunks``; parents before children, each once, none of ``cids`` or
    ``skip``. A manifest the store lacks (or cannot read) is listed but not followed."""
    seen = set(cids) | (skip or set())
    order: list[Cid] = []
    frontier = [cid for cid in dict.fromkeys(cids) if cid.codec is Multicodec.TENSORSWAP_MANIFEST]
    while frontier:
        below: list[Cid] = []
        for cid in frontier:
            try:
                links = read_manifest(store, cid).links()
            except StoreError:
                continue
            for link in links:
                manifest = link.codec is Multicodec.TENSORSWAP_MANIFEST
                if link in seen or not (manifest or chunks):
                    continue
                seen.add(link)
                order.append(link)
                if manifest:
                    below.append(link)
        frontier = below
    return order
