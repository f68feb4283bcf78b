"""SwarmSeeder: a peer's read-only block server for the results it holds (or is fetching)."""

from __future__ import annotations

import asyncio
import ssl as ssl_module
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import Self

from tensorswap.cid import Cid
from tensorswap.errors import BlockNotFound
from tensorswap.store.base import BlockStore, StoreSize
from tensorswap.swarm.errors import SwarmReadOnly
from tensorswap.swarm.messages import (
    HAVE_APP,
    MAX_WAIT,
    HaveAnswer,
    decode_have,
    encode,
    parse_root,
)
from tensorswap.wire import AppRequest, BlockServer, Timeouts, WireLimits
from tensorswap.wire.messages import MAX_CIDS_PER_MESSAGE, wire_cids

__all__ = ["Holdings", "ReadOnlyView", "SwarmSeeder"]


class _Root:
    __slots__ = ("changed", "chunks", "claimed", "claims_version", "served")

    def __init__(self) -> None:
        self.chunks: list[Cid] = []  # in the order they were stored: what have answers tell
        self.served: set[Cid] = set()  # chunks and manifests
        self.claimed: set[Cid] = set()  # being fetched from the coordinator
        self.claims_version = 0
        self.changed = asyncio.Event()

    def wake(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()


class Holdings:
    """The blocks a seeder serves, per root: its manifests and the chunks held so far.

    ``add`` is called by the fetcher as chunks are stored (after their CID check); waiters
    of a have query are woken then. At most ``keep`` roots (the oldest is forgotten). Used
    on one event loop.
    """

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self._roots: OrderedDict[Cid, _Root] = OrderedDict()
        self._index: dict[Cid, int] = {}  # block -> how many roots serve it

    def serve(self, root: Cid, manifests: Iterable[Cid] = ()) -> None:
        """Start serving ``root`` with ``manifests`` (blocks the fetcher already holds)."""
        entry = self._roots.get(root)
        if entry is None:
            entry = self._roots[root] = _Root()
            self._allow(entry, [root])
            while len(self._roots) > self.keep:
                self.forget(next(iter(self._roots)))
        self._allow(entry, manifests)

    def add(self, root: Cid, chunks: Iterable[Cid]) -> None:
        """Chunks of ``root`` now held (and verified) in the store."""
        entry = self._roots.get(root)
        if entry is None:
            return
        fresh = [c for c in dict.fromkeys(chunks) if c not in entry.served]
        if fresh:
            entry.chunks.extend(fresh)
            self._allow(entry, fresh)
            entry.wake()

    def claim(self, root: Cid, chunks: Iterable[Cid], claimed: bool) -> None:
        """Chunks of ``root`` now being fetched from the coordinator (``claimed``), or no
        longer: other fetchers then leave them to this peer instead of asking for them too."""
        entry = self._roots.get(root)
        if entry is None:
            return
        if claimed:
            entry.claimed.update(chunks)
        else:
            entry.claimed.difference_update(chunks)
        entry.claims_version += 1
        entry.wake()

    def forget(self, root: Cid) -> None:
        entry = self._roots.pop(root, None)
        if entry is None:
            return
        for cid in entry.served:
            left = self._index[cid] - 1
            if left:
                self._index[cid] = left
            else:
                del self._index[cid]
        entry.changed.set()

    def serves(self, cid: Cid) -> bool:
        return cid in self._index

    @property
    def roots(self) -> list[Cid]:
        return list(self._roots)

    def _allow(self, entry: _Root, cids: Iterable[Cid]) -> None:
        for cid in cids:
            if cid not in entry.served:
                entry.served.add(cid)
                self._index[cid] = self._index.get(cid, 0) + 1

    async def have(self, root: Cid, since: int, wait: float, claims_seen: int = 0) -> HaveAnswer:
        """The chunks told from position ``since`` on and the claims, waiting up to ``wait``
        s for news (a chunk beyond ``since``, claims past version ``claims_seen``)."""
        entry = self._roots.get(root)
        if entry is None:
            return HaveAnswer(version=0, serving=False)
        if len(entry.chunks) <= since and entry.claims_version == claims_seen and wait > 0:
            changed = entry.changed
            try:
                async with asyncio.timeout(min(wait, MAX_WAIT)):
                    await changed.wait()
            except TimeoutError:
                pass
            if self._roots.get(root) is not entry:
                return HaveAnswer(version=0, serving=False)
        told = entry.chunks[since : since + MAX_CIDS_PER_MESSAGE]
        return HaveAnswer(
            version=since + len(told),
            chunks=wire_cids(told),
            claimed=wire_cids(list(entry.claimed)[:MAX_CIDS_PER_MESSAGE]),
            claims_version=entry.claims_version,
        )


class ReadOnlyView(BlockStore):
    """``store`` seen through ``holdings``: only the blocks served are visible, and nothing
    can be stored (SwarmReadOnly). A peer's own submitted update, or anything else its
    store holds, is never served to other peers."""

    def __init__(self, store: BlockStore, holdings: Holdings) -> None:
        self.inner = store
        self.holdings = holdings

    def _store(self, cid: Cid, data: memoryview, adopt: bool) -> None:
        raise SwarmReadOnly(f"block {cid} ({len(data)} bytes)")

    def get(self, cid: Cid, *, verify: bool | None = None) -> memoryview:
        if not self.holdings.serves(cid):
            raise BlockNotFound(cid)
        return self.inner.get(cid, verify=verify)

    def has(self, cid: Cid) -> bool:
        return self.holdings.serves(cid) and self.inner.has(cid)

    def size_of(self, cid: Cid) -> int:
        if not self.holdings.serves(cid):
            raise BlockNotFound(cid)
        return self.inner.size_of(cid)

    def delete(self, cid: Cid) -> bool:
        raise SwarmReadOnly(f"deleting {cid}")

    def __iter__(self) -> Iterator[Cid]:
        return (cid for cid in self.inner if self.holdings.serves(cid))

    def size(self) -> StoreSize:
        count = total = 0
        for cid in self:
            count += 1
            total += self.inner.size_of(cid)
        return StoreSize(count, total)


class SwarmSeeder:
    """A read-only ``BlockServer`` on a peer's own port, serving ``holdings`` from ``store``.

    Other peers (authenticated with ``key``, over TLS with ``ssl`` as for the coordinator)
    send Get (every block sent is one it holds, as stored after its CID check) and the
    ``"swarm-have"`` app's have queries. A push (blocks sent to it) is refused with ERROR
    ``store_error`` and the connection closed. ``max_connections`` caps the fetchers served
    at once. Serving needs an address other peers can reach: a peer behind NAT that no one
    can dial simply is not used (fetchers fall back to other sources).
    """

    def __init__(
        self,
        store: BlockStore,
        *,
        key: bytes | None = None,
        holdings: Holdings | None = None,
        limits: WireLimits | None = None,
        timeouts: Timeouts | None = None,
        max_connections: int = 32,
        name: str = "tensorswap-seeder",
    ) -> None:
        self.holdings = holdings if holdings is not None else Holdings()
        self.server = BlockServer(
            ReadOnlyView(store, self.holdings),
            key=key,
            limits=limits,
            timeouts=timeouts,
            name=name,
            handlers={HAVE_APP: self._have},
            max_connections=max_connections,
        )

    async def start(
        self, host: str = "127.0.0.1", port: int = 0, *, ssl: ssl_module.SSLContext | None = None
    ) -> Self:
        await self.server.start(host, port, ssl=ssl)
        return self

    @property
    def port(self) -> int:
        return self.server.port

    async def aclose(self) -> None:
        await self.server.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def _have(self, request: AppRequest) -> bytes:
        query = decode_have(request.body, request.peer)
        root = parse_root(query.root, request.peer)
        answer = await self.holdings.have(root, query.since, query.wait, query.claims_seen)
        return encode(answer)
