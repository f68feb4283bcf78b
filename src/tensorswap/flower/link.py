"""BlockLink: one process's connection to a block service, called from Flower's synchronous code
(a ClientApp mod, a Strategy) and run on an event loop thread of its own."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import socket
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from tensorswap._netaddr import split_host_port
from tensorswap.cid import Cid
from tensorswap.errors import TensorSwapError
from tensorswap.errors.flower import ArraysUnavailable
from tensorswap.flower.node_store import NodeStore
from tensorswap.flower.prefetch import RoundPrefetch
from tensorswap.store import BlockStore, MemoryStore, ModelUpdate, get_update, put_update
from tensorswap.store.gc import collect_garbage
from tensorswap.swarm import SwarmPeer
from tensorswap.wire import BlockClient, RemoteError, Timeouts, TransportError
from tensorswap.wire.errors import ConnectionBroken, PeerTimeout

if TYPE_CHECKING:
    from tensorswap.rounds.core import RoundId

__all__ = ["BlockLink", "LinkCounters"]

_T = TypeVar("_T")
_RETRIED = (TransportError, ConnectionBroken, PeerTimeout, OSError)
"""Failures of a connection (not of the data): the call is made again on a fresh one."""
_ids = itertools.count()


@dataclass
class LinkCounters:
    """What a link moved: pushes and fetches made, blocks and bytes sent, attempts retried,
    aggregates the service computed for it (``aggregate``; their fetches count as fetches)."""

    pushes: int = 0
    fetches: int = 0
    sent_blocks: int = 0
    sent_bytes: int = 0
    fetched_bytes: int = 0
    from_peers: int = 0
    retries: int = 0
    aggregates: int = 0


class BlockLink:
    """Pushes arrays to, and fetches them from, the block service at ``address`` (HOST:PORT).

    Thread-safe: calls from any thread run one at a time on the link's own event loop (a
    daemon thread), over one authenticated connection (``key``) that is redialled after a
    failure. A push or fetch whose connection fails is made again, up to ``attempts`` times;
    a push made again sends only the blocks the service still lacks (offer/want), a fetch
    asks only for what the local ``store`` lacks. ``swarm``-marked fetches go through a
    ``SwarmPeer``: chunks from the service and from peers that hold them, this process
    serving what it holds on a read-only seeder (on the address it reaches the service from).
    The store keeps the arrays of the last ``keep`` roots (the rest collected); a
    ``NodeStore`` keeps them on disk for every process of a Flower node, its roots shared.
    """

    def __init__(
        self,
        address: str,
        *,
        key: bytes | None = None,
        store: BlockStore | NodeStore | None = None,
        attempts: int = 5,
        keep: int = 4,
        timeouts: Timeouts | None = None,
    ) -> None:
        self.address = address
        self.host, self.port = split_host_port(address)
        self.key = key
        self.node = store if isinstance(store, NodeStore) else None
        """The node's store on disk, shared with its other processes (None: this link's own)."""
        if isinstance(store, NodeStore):
            store = store.store
        self.store = store if store is not None else MemoryStore()
        self.attempts = attempts
        self.keep = keep
        self.timeouts = timeouts or Timeouts(connect=5.0)
        self.counters = LinkCounters()
        self._roots: OrderedDict[Cid, None] = OrderedDict()
        self._client: BlockClient | None = None
        self._peer: SwarmPeer | None = None
        self._loop = asyncio.new_event_loop()
        self._lock = asyncio.Lock()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"tensorswap-flower-{address}", daemon=True
        )
        self._thread.start()
        self._closed = False
        self._prefetches: set[RoundPrefetch] = set()

    # ── synchronous API ──────────────────────────────────────────────────────
    def push(
        self, arrays: Mapping[str, np.ndarray], *, hold: bool = False, samples: int = 0
    ) -> Cid:
        """Make the service hold ``arrays`` as one update (its ``num_samples``: ``samples``);
        its root CID. ``hold``: also keep them in the local store (so that later fetches of
        equal chunks are not made)."""
        root = self._run(lambda: self._push(arrays, hold, samples), "push arrays")
        if hold and self.node is not None:
            self.node.remember(root)
        return root

    def fetch(self, root: Cid, *, swarm: bool = False) -> dict[str, np.ndarray]:
        """The arrays of the update ``root``, fetched into the local store (what it lacks),
        every block CID-checked; read-only views of the store's blocks where a tensor is one
        chunk, else one array per tensor."""
        reading = self.node.reading() if self.node is not None else contextlib.nullcontext()
        with reading:  # no collection by another process of the node until they are read
            self._run(lambda: self._fetch(root, swarm), f"fetch {root}")
            update = get_update(self.store, root)
        if self.node is not None:
            self.node.remember(root)
        return dict(update.tensors)

    def aggregate(
        self, round_id: RoundId, entries: Sequence[tuple[str, Cid]], *, timeout: float = 300.0
    ) -> tuple[Cid, dict[str, np.ndarray]]:
        """The FedAvg aggregate of updates the service already holds (``entries``: peer name,
        root; weights their ``num_samples``), computed by the service's coordinator in round
        ``round_id`` (``coordinated.aggregate_held``: nothing but the request crosses the
        link) and then fetched: its CID and arrays. AggregateUnavailable when the service
        does not aggregate them; ArraysUnavailable when the link fails on every attempt."""
        from tensorswap.flower.coordinated import aggregate_held  # the rounds client, lazily

        async def call() -> Cid:
            client = await self._connected()
            return await aggregate_held(
                client, round_id, entries, timeout=timeout, address=self.address
            )

        cid = self._run(call, f"aggregate round {round_id.as_key()}")
        self.counters.aggregates += 1
        return cid, self.fetch(cid)

    def open_round(self, round_id: RoundId, expected: int, *, timeout: float) -> None:
        """Start round ``round_id`` on the service's coordinator for ``expected`` peers
        (``coordinated.open_round``: deterministic, failed ``timeout`` s from now unless
        every peer has submitted). AggregateUnavailable when the service refuses it."""
        from tensorswap.flower.coordinated import open_round

        async def call() -> None:
            client = await self._connected()
            await open_round(client, round_id, expected, timeout=timeout, address=self.address)

        self._run(call, f"open round {round_id.as_key()}")

    def submit_held(self, round_id: RoundId, peer: str, root: Cid) -> str | None:
        """Submit the update ``root`` (pushed before) to round ``round_id`` as ``peer``'s
        contribution: None once the round holds exactly that, else why it does not
        (``coordinated.submit_held``)."""
        from tensorswap.flower.coordinated import submit_held

        async def call() -> str | None:
            client = await self._connected()
            return await submit_held(client, round_id, peer, root, address=self.address)

        return self._run(call, f"submit to round {round_id.as_key()}")

    def round_aggregate(
        self,
        round_id: RoundId,
        *,
        timeout: float = 300.0,
        prefetched: RoundPrefetch | None = None,
    ) -> tuple[Cid, dict[str, np.ndarray]]:
        """The aggregate of round ``round_id`` once it is Complete, fetched: its CID and
        arrays. AggregateUnavailable when it fails or times out. ``prefetched``: that
        round's ``prefetch_round``; where it brought the aggregate (waited for, ``timeout``
        s at most) its blocks are read from the store, else (it failed, or was for another
        round) the round is awaited and fetched here as without it."""
        from tensorswap.flower.coordinated import await_round

        async def call() -> Cid:
            client = await self._connected()
            return await await_round(client, round_id, timeout=timeout, address=self.address)

        cid = None
        if prefetched is not None:
            cid = prefetched.take(timeout) if prefetched.round_id == round_id else None
            prefetched.cancel()
        if cid is None:
            cid = self._run(call, f"await round {round_id.as_key()}")
        self.counters.aggregates += 1
        return cid, self.fetch(cid)

    def prefetch_round(self, round_id: RoundId, *, timeout: float) -> RoundPrefetch:
        """Start awaiting round ``round_id``'s aggregate (``timeout`` s at most) on a
        connection of its own and, once the round is Complete, fetching it into the store
        (through this link's connection, one call at a time with the others); returned at
        once. Pass it to ``round_aggregate``, or ``cancel`` it (``close`` cancels those
        still running)."""
        if self._closed:
            raise ArraysUnavailable(f"prefetch round {round_id.as_key()}", self.address, 0,
                                    "the link is closed")  # fmt: skip
        prefetch = RoundPrefetch(round_id, self._loop)
        self._prefetches.add(prefetch)

        def start() -> None:
            task = self._loop.create_task(self._prefetch(round_id, timeout))
            task.add_done_callback(lambda _: self._prefetches.discard(prefetch))
            prefetch.started(task)

        self._loop.call_soon_threadsafe(start)
        return prefetch

    @property
    def prefetching(self) -> int:
        """Prefetches (``prefetch_round``) not ended yet."""
        return sum(1 for p in list(self._prefetches) if not p.done())

    def close(self) -> None:
        """Close the connection and the seeder, stop the loop thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for prefetch in list(self._prefetches):
            prefetch.cancel()
        with contextlib.suppress(Exception):
            self._submit(self._aclose()).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> BlockLink:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ── on the loop ──────────────────────────────────────────────────────────
    def _submit(self, coro: Awaitable[_T]) -> Future[_T]:
        async def wrapped() -> _T:
            return await coro

        return asyncio.run_coroutine_threadsafe(wrapped(), self._loop)

    def _run(self, call: Callable[[], Awaitable[_T]], what: str) -> _T:
        if self._closed:
            raise ArraysUnavailable(what, self.address, 0, "the link is closed")
        return self._submit(self._retrying(call, what)).result()

    async def _retrying(self, call: Callable[[], Awaitable[_T]], what: str) -> _T:
        async with self._lock:
            for attempt in range(1, self.attempts + 1):
                try:
                    return await call()
                except _RETRIED as exc:
                    await self._drop_client()
                    if attempt == self.attempts:
                        raise ArraysUnavailable(what, self.address, attempt, str(exc)) from exc
                    self.counters.retries += 1
                    await asyncio.sleep(min(2.0, 0.05 * 2**attempt))
                except RemoteError as exc:
                    raise ArraysUnavailable(what, self.address, attempt, str(exc)) from exc
                except asyncio.CancelledError:  # a request may be half made: dial afresh
                    await self._drop_client()
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    async def _connected(self) -> BlockClient:
        if self._client is None:
            self._client = await BlockClient.connect(
                self.host, self.port, key=self.key, timeouts=self.timeouts
            )
        return self._client

    async def _drop_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(TensorSwapError, OSError):
                await client.aclose()

    async def _push(self, arrays: Mapping[str, np.ndarray], hold: bool, samples: int) -> Cid:
        client = await self._connected()
        update = ModelUpdate(arrays, samples)
        if hold:
            root = await asyncio.to_thread(put_update, self.store, update)
            result = await client.push(self.store, root)
            self._remember(root)
        else:
            result = await client.push_update(update)
            root = result.roots[0]
        self.counters.pushes += 1
        self.counters.sent_blocks += result.sent_blocks
        self.counters.sent_bytes += result.sent_bytes
        return root

    async def _fetch(self, root: Cid, swarm: bool) -> None:
        client = await self._connected()
        if swarm:
            peer = await self._swarm_peer()
            report = await peer.fetch(client, root)
            self.counters.fetched_bytes += report.from_coordinator + report.from_peers
            self.counters.from_peers += report.from_peers
        else:
            pulled = await client.pull(root, self.store)
            self.counters.fetched_bytes += pulled.fetched_bytes
        self.counters.fetches += 1
        self._remember(root)

    async def _prefetch(self, round_id: RoundId, timeout: float) -> Cid:
        """``prefetch_round``'s work: the round awaited apart, its aggregate fetched."""
        from tensorswap.flower.coordinated import await_round

        waiting = await BlockClient.connect(
            self.host, self.port, key=self.key, timeouts=self.timeouts
        )
        async with waiting:  # closed after (aborted where cancelled)
            cid = await await_round(waiting, round_id, timeout=timeout, address=self.address)
        if self.node is None:  # a node's fetch reads under its lock: left to the caller
            await self._retrying(lambda: self._fetch(cid, False), f"prefetch {cid}")
        return cid

    async def _swarm_peer(self) -> SwarmPeer:
        if self._peer is None:
            host = _local_host(self.host, self.port)
            name = f"flower-{socket.gethostname()}-{os.getpid()}-{next(_ids)}"
            peer = SwarmPeer(self.store, peer=name, key=self.key, listen=(host, 0))
            self._peer = await peer.start()
        return self._peer

    def _remember(self, root: Cid) -> None:
        self._roots[root] = None
        self._roots.move_to_end(root)
        trimmed = len(self._roots) > self.keep
        while len(self._roots) > self.keep:
            old, _ = self._roots.popitem(last=False)
            if self._peer is not None and self._peer.seeder is not None:
                self._peer.seeder.holdings.forget(old)
        if self.node is None and trimmed:  # a node's roots are remembered by fetch / push
            collect_garbage(self.store, list(self._roots))

    async def _aclose(self) -> None:
        await self._drop_client()
        if self._peer is not None:
            await self._peer.aclose()
            self._peer = None


def _local_host(host: str, port: int) -> str:
    """The address this process reaches ``host`` from (where peers can reach it too): the
    kernel's route for a UDP socket, which sends nothing."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, port))
            return str(probe.getsockname()[0])
        except OSError:
            return "127.0.0.1"
