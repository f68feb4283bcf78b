"""Chunk sources over the block protocol: the coordinator's connection, or a dialled seeder."""

from __future__ import annotations

import asyncio
import ssl as ssl_module

from tensorswap.cid import Cid
from tensorswap.errors import TensorSwapError
from tensorswap.store.base import BlockStore
from tensorswap.swarm.errors import BadSwarmMessage
from tensorswap.swarm.messages import HAVE_APP, HaveQuery, decode_have_answer, encode
from tensorswap.swarm.scheduler import HaveNews
from tensorswap.wire import BlockClient, Timeouts, WireLimits

__all__ = ["BlockSource", "dial_seeder"]


class BlockSource:
    """A ChunkSource on a BlockClient: Get for chunks (each block CID-checked before it is
    stored, by the client), the seeder's have app for what it holds (peers only).

    ``owned``: the connection is this source's (a dialled seeder), closed by ``aclose``;
    the coordinator's connection is borrowed and left open.
    """

    def __init__(
        self, client: BlockClient, root: Cid, name: str, *, complete: bool, owned: bool
    ) -> None:
        self.client = client
        self.root = root
        self.name = name
        self.complete = complete
        self.owned = owned

    async def have(self, since: int, claims_seen: int, wait: float) -> HaveNews | None:
        query = HaveQuery(self.root.to_bytes(), since, wait, claims_seen)
        read = self.client.conn.timeouts.read
        body = await self.client.request(
            HAVE_APP, encode(query), timeout=None if read is None else read + wait
        )
        answer = decode_have_answer(body, self.client.conn.peer)
        if not answer.serving:
            return None
        if answer.version != since + len(answer.chunks):
            msg = f"have version {answer.version} after {since} with {len(answer.chunks)} chunks"
            raise BadSwarmMessage(msg, self.client.conn.peer)
        return HaveNews(
            answer.version,
            [Cid.parse(raw) for raw in answer.chunks],
            frozenset(Cid.parse(raw) for raw in answer.claimed),
            answer.claims_version,
        )

    async def get(self, cids: list[Cid], into: BlockStore) -> list[Cid]:
        return await self.client.get_blocks(cids, into)

    async def aclose(self) -> None:
        """Close a dialled seeder's connection (FIN, not a reset the seeder would log)."""
        if not self.owned:
            return
        try:
            async with asyncio.timeout(1.0):
                await self.client.aclose()
        except (TimeoutError, TensorSwapError, OSError):
            self.client.transport.abort()


async def dial_seeder(
    host: str,
    port: int,
    root: Cid,
    name: str,
    *,
    key: bytes | None,
    ssl: ssl_module.SSLContext | None = None,
    limits: WireLimits | None = None,
    timeouts: Timeouts | None = None,
) -> BlockSource:
    """Connect to a peer's seeder and authenticate (as to the coordinator: same key, TLS)."""
    client = await BlockClient.connect(
        host, port, key=key, ssl=ssl, limits=limits, timeouts=timeouts
    )
    return BlockSource(client, root, name, complete=False, owned=True)
