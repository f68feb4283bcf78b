"""Swarm distribution on shaped links (the network lab): the coordinator's link is spared.

A coordinator host (a BlockServer with a SwarmTracker, as a RoundServer holds one) and four
peers, each on a 100 Mbit/s link of its own. Asserts on the coordinator's byte counter and
on the values fetched, never on times.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

import numpy as np
import pytest

from tensorswap.cid import Cid
from tensorswap.netlab import Host, Lab
from tensorswap.store import MemoryStore, ModelUpdate, get_update, put_update
from tensorswap.swarm import SwarmFetch, SwarmPeer, SwarmTracker
from tensorswap.wire import BlockClient, BlockServer

pytestmark = pytest.mark.timeout(180)

KEY = b"netlab-swarm-key"
PORT = 7200
MODEL = 4 * 1024 * 1024  # bytes of float32 values, in 32 chunks
CHUNK = 128 * 1024


@dataclass
class Coordinator:
    store: MemoryStore = field(default_factory=MemoryStore)
    server: BlockServer | None = None
    ready: threading.Event = field(default_factory=threading.Event)
    stop: threading.Event = field(default_factory=threading.Event)

    async def serve(self, host: Host) -> None:
        server = BlockServer(self.store, key=KEY)
        SwarmTracker(self.store).attach(server)
        await server.start(host.address, PORT)
        self.server = server
        self.ready.set()
        try:
            await asyncio.to_thread(self.stop.wait)
        finally:
            await server.aclose()

    @property
    def bytes_out(self) -> int:
        assert self.server is not None
        return int(self.server.stats.bytes_out)


@dataclass
class Fetch:
    """One peer's fetch in its host: done once fetched; it serves on until ``stay``."""

    fetched: threading.Event = field(default_factory=threading.Event)
    report: SwarmFetch | None = None
    future: asyncio.Future[None] | None = None

    async def done(self) -> SwarmFetch:
        while not await asyncio.to_thread(self.fetched.wait, 0.5):
            assert self.future is not None
            if self.future.done():
                self.future.result()  # the fetch failed: raise its error
                raise AssertionError("the fetch ended without a report")
        assert self.report is not None
        return self.report


def fetch_in(
    host: Host, coord: Host, root: Cid, values: np.ndarray, stay: threading.Event
) -> Fetch:
    """Fetch ``root`` through the swarm inside ``host``, then serve it until ``stay``."""
    fetch = Fetch()

    async def body() -> None:
        store = MemoryStore()
        async with SwarmPeer(store, peer=host.name, key=KEY, listen=(host.address, 0)) as node:
            async with await BlockClient.connect(coord.address, PORT, key=KEY) as client:
                fetch.report = await node.fetch(client, root)
            assert np.array_equal(get_update(store, root).tensors["w"], values)
            fetch.fetched.set()
            await asyncio.to_thread(stay.wait)

    fetch.future = asyncio.wrap_future(host.start_async(body))
    return fetch


@pytest.mark.slow
async def test_peers_on_shaped_links_fetch_mostly_from_each_other(lab: Lab) -> None:
    coord = lab.add_host("coord", mbit=100)
    peers = [lab.add_host(f"peer{i}", mbit=100) for i in range(4)]
    rng = np.random.default_rng(3)
    first, second = (rng.standard_normal(MODEL // 4, np.float32) for _ in range(2))
    box = Coordinator()
    roots = [
        put_update(box.store, ModelUpdate({"w": v}, 1), chunk_bytes=CHUNK) for v in (first, second)
    ]
    serving = coord.start_async(lambda: box.serve(coord))
    assert await asyncio.to_thread(box.ready.wait, 30)
    stay, fetches = threading.Event(), []
    try:
        # one peer fetches alone: every chunk from the coordinator, once
        seed = fetch_in(peers[0], coord, roots[0], first, stay)
        fetches.append(seed)
        alone = await seed.done()
        # the three others, at once, with that seed listed: every chunk from a peer
        later = [fetch_in(p, coord, roots[0], first, stay) for p in peers[1:]]
        fetches += later
        after_seed = [await f.done() for f in later]
        # then all four fetch the second model at once: the coordinator's link carries it
        # fewer than three times (a star sends it four times)
        before = box.bytes_out
        together = [fetch_in(p, coord, roots[1], second, stay) for p in peers]
        fetches += together
        at_once = [await f.done() for f in together]
        sent_together = box.bytes_out - before
    finally:
        stay.set()
        for fetch in fetches:
            if fetch.future is not None:
                await asyncio.gather(fetch.future, return_exceptions=True)
        box.stop.set()
        await asyncio.wrap_future(serving)
    assert alone.from_coordinator >= MODEL and alone.from_peers == 0
    assert all(r.from_coordinator == 0 and r.from_peers >= MODEL for r in after_seed)
    print(f"coordinator sent {sent_together / MODEL:.2f} models for four peers at once")
    assert sent_together < 3 * MODEL
    assert sum(r.from_peers for r in at_once) > MODEL
