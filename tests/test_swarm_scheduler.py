"""SwarmSchedule over fake sources: who is asked for what, failures, lies, claims, the cap."""

from __future__ import annotations

import asyncio
import contextlib
import os

import pytest

from tensorswap.cid import Cid
from tensorswap.store import MemoryStore
from tensorswap.store.base import BlockStore
from tensorswap.swarm import SwarmSchedule
from tensorswap.swarm.scheduler import HaveNews
from tensorswap.transport import ConnectionFailed


def chunks(n: int) -> dict[Cid, bytes]:
    blocks = [os.urandom(64) for _ in range(n)]
    return {Cid.of(b): b for b in blocks}


class Fake:
    """A source over a dict of blocks; records every Get; optional faults."""

    def __init__(
        self,
        name: str,
        blocks: dict[Cid, bytes],
        *,
        complete: bool = False,
        claimed: frozenset[Cid] = frozenset(),
        corrupt: bool = False,
        fail_after: int | None = None,
        withhold: frozenset[Cid] = frozenset(),
        stall: bool = False,
    ) -> None:
        self.name, self.blocks, self.complete = name, dict(blocks), complete
        self.claimed, self.claims_version = claimed, 1 if claimed else 0
        self.corrupt, self.fail_after, self.withhold = corrupt, fail_after, withhold
        self.stall = stall
        self.gets: list[list[Cid]] = []
        self.busy = self.most_busy = 0
        self.news = asyncio.Event()

    def give(self, blocks: dict[Cid, bytes], claimed: frozenset[Cid] = frozenset()) -> None:
        self.blocks.update(blocks)
        self.claimed, self.claims_version = claimed, self.claims_version + 1
        self.news.set()

    async def have(self, since: int, claims_seen: int, wait: float) -> HaveNews | None:
        told = list(self.blocks)
        if len(told) <= since and claims_seen == self.claims_version and wait > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.news.wait(), wait)
            self.news.clear()
            told = list(self.blocks)
        return HaveNews(len(told), told[since:], self.claimed, self.claims_version)

    async def get(self, cids: list[Cid], into: BlockStore) -> list[Cid]:
        self.busy += 1
        self.most_busy = max(self.most_busy, self.busy)
        try:
            await asyncio.sleep(0)
            self.gets.append(list(cids))
            if self.stall:
                await asyncio.Event().wait()  # a peer that stopped sending: until cancelled
            if self.fail_after is not None and len(self.gets) > self.fail_after:
                raise ConnectionFailed(self.name, "gone")
            missing = []
            for cid in cids:
                data = self.blocks.get(cid)
                if data is None or cid in self.withhold:
                    missing.append(cid)
                    continue
                if self.corrupt:
                    data = bytes([data[0] ^ 1]) + data[1:]
                into.put_verified(cid, data)  # the CID check every real source makes
            return missing
        finally:
            self.busy -= 1

    async def aclose(self) -> None:
        pass

    @property
    def asked(self) -> list[Cid]:
        return [cid for batch in self.gets for cid in batch]


def schedule(blocks: dict[Cid, bytes], store: MemoryStore, **kw: object) -> SwarmSchedule:
    return SwarmSchedule(list(blocks), store, have_wait=0.01, **kw)  # type: ignore[arg-type]


async def test_the_coordinator_alone_gives_every_chunk_once() -> None:
    blocks, store = chunks(9), MemoryStore()
    coord = Fake("coordinator", blocks, complete=True)
    reports = await schedule(blocks, store, batch=2, coordinator_batch=2).run([coord])
    assert sorted(map(str, coord.asked)) == sorted(map(str, blocks))
    assert all(len(batch) <= 2 for batch in coord.gets) and coord.most_busy == 1
    assert reports[0].blocks == 9 and reports[0].nbytes == 9 * 64
    assert all(bytes(store.get(c)) == b for c, b in blocks.items())


async def test_a_peer_that_holds_everything_leaves_the_coordinator_idle() -> None:
    blocks, store = chunks(8), MemoryStore()
    coord, peer = Fake("coordinator", blocks, complete=True), Fake("p", blocks)
    await schedule(blocks, store).run([coord, peer])
    assert coord.gets == [] and len(peer.asked) == 8


async def test_the_coordinator_gives_only_what_no_peer_holds() -> None:
    blocks, store = chunks(10), MemoryStore()
    half = dict(list(blocks.items())[:5])
    coord, peer = Fake("coordinator", blocks, complete=True), Fake("p", half)
    await schedule(blocks, store).run([coord, peer])
    assert set(coord.asked) == set(blocks) - set(half)
    assert set(peer.asked) == set(half)
    assert len(coord.asked) + len(peer.asked) == 10  # nothing fetched twice


async def test_held_chunks_are_not_fetched() -> None:
    blocks, store = chunks(6), MemoryStore()
    first = next(iter(blocks))
    store.put(blocks[first])
    coord = Fake("coordinator", blocks, complete=True)
    await schedule(blocks, store).run([coord])
    assert first not in coord.asked and len(coord.asked) == 5


async def test_a_lying_peer_is_dropped_and_its_chunks_come_from_the_coordinator() -> None:
    blocks, store = chunks(6), MemoryStore()
    coord, liar = Fake("coordinator", blocks, complete=True), Fake("liar", blocks, corrupt=True)
    reports = await schedule(blocks, store).run([coord, liar])
    assert all(bytes(store.get(c)) == b for c, b in blocks.items())  # never a wrong value
    (lied,) = [r for r in reports if r.name == "liar"]
    assert lied.failed is not None and "HashMismatch" in lied.failed and lied.blocks == 0
    assert len(liar.gets) == 1  # one try, then dropped
    assert len(coord.asked) == 6


async def test_a_peer_that_lacks_an_announced_chunk_is_not_asked_again() -> None:
    blocks, store = chunks(6), MemoryStore()
    gone = next(iter(blocks))
    coord = Fake("coordinator", blocks, complete=True)
    peer = Fake("p", blocks, withhold=frozenset({gone}))
    reports = await schedule(blocks, store, batch=1).run([coord, peer])
    assert peer.asked.count(gone) == 1 and coord.asked == [gone]
    (report,) = [r for r in reports if r.name == "p"]
    assert report.failed is None and report.lacked == 1 and report.blocks == 5


async def test_a_peer_that_goes_away_mid_fetch() -> None:
    blocks, store = chunks(8), MemoryStore()
    coord = Fake("coordinator", blocks, complete=True)
    leaver, other = Fake("leaver", blocks, fail_after=1), Fake("other", {})
    reports = await schedule(blocks, store, batch=2).run([coord, leaver, other])
    assert len(leaver.gets) == 2 and len(store.missing(blocks)) == 0
    (left,) = [r for r in reports if r.name == "leaver"]
    assert left.failed is not None and "ConnectionFailed" in left.failed and left.blocks == 2
    assert len(coord.asked) == 6  # the rest, once the leaver was dropped


async def test_chunks_a_peer_claims_are_left_to_it() -> None:
    blocks, store = chunks(6), MemoryStore()
    items = list(blocks.items())
    claimed = dict(items[:3])
    coord = Fake("coordinator", blocks, complete=True)
    peer = Fake("p", {}, claimed=frozenset(claimed))
    run = asyncio.ensure_future(schedule(blocks, store).run([coord, peer]))
    while len(coord.asked) < 3:  # the coordinator gives the unclaimed ones, then waits
        await asyncio.sleep(0)
    assert not run.done() and set(coord.asked) == set(blocks) - set(claimed)
    peer.give(claimed)  # the claims became chunks held
    await run
    assert set(peer.asked) == set(claimed) and len(coord.asked) == 3


async def test_a_claimer_that_goes_away_releases_its_claims() -> None:
    blocks, store = chunks(4), MemoryStore()
    coord = Fake("coordinator", blocks, complete=True)
    claimer = Fake("p", dict(list(blocks.items())[:1]), claimed=frozenset(blocks), fail_after=0)
    await schedule(blocks, store).run([coord, claimer])
    # it claimed all four: the coordinator waited, then gave all once the claimer failed
    assert len(claimer.gets) == 1 and len(store.missing(blocks)) == 0
    assert sorted(map(str, coord.asked)) == sorted(map(str, blocks))


async def test_sources_added_while_running_are_used() -> None:
    blocks, store = chunks(6), MemoryStore()
    peer = Fake("late", blocks)
    sched = schedule(blocks, store)
    coord = Fake("coordinator", {}, complete=True)  # a coordinator that lacks them all
    run = asyncio.ensure_future(sched.run([coord, Fake("early", {})]))
    await asyncio.sleep(0)
    await sched.add(peer)
    await run
    assert len(peer.asked) == 6 and len(store.missing(blocks)) == 0


async def test_when_every_source_fails_the_rest_is_reported_lacking() -> None:
    blocks, store = chunks(4), MemoryStore()
    coord = Fake("coordinator", blocks, complete=True, fail_after=0)
    sched = schedule(blocks, store, patience=0.05)
    reports = await sched.run([coord, Fake("useless", {})])  # a peer that never gets any
    assert len(sched.lacking) == 4 and reports[0].failed is not None


def test_batch_must_be_positive() -> None:
    with pytest.raises(ValueError, match="batch"):
        SwarmSchedule([], MemoryStore(), batch=0)


async def test_claims_held_too_long_are_ignored() -> None:
    blocks, store = chunks(4), MemoryStore()
    coord = Fake("coordinator", blocks, complete=True)
    squatter = Fake("squatter", {}, claimed=frozenset(blocks))  # claims all, fetches none
    await schedule(blocks, store, claim_patience=0.05).run([coord, squatter])
    assert len(store.missing(blocks)) == 0 and len(coord.asked) == 4


async def test_a_stalled_peer_costs_the_straggler_time_not_the_fetch() -> None:
    blocks, store = chunks(6), MemoryStore()
    coord = Fake("coordinator", blocks, complete=True)
    stalled = Fake("stalled", blocks, stall=True)  # holds everything, sends nothing
    await schedule(blocks, store, straggler=0.05).run([coord, stalled])
    assert len(store.missing(blocks)) == 0
    assert len(stalled.gets) == 1  # its first Get never ended; nothing more was asked of it
    assert len(coord.asked) == 6  # its two in flight as twins, the rest as stranded


async def test_a_fast_peer_twins_a_stalled_peers_chunks() -> None:
    blocks, store = chunks(4), MemoryStore()
    coord = Fake("coordinator", blocks, complete=True)
    stalled, fast = Fake("stalled", blocks, stall=True), Fake("fast", {})
    sched = schedule(blocks, store, straggler=0.05, batch=4)
    run = asyncio.ensure_future(sched.run([coord, stalled, fast]))
    while not stalled.gets:
        await asyncio.sleep(0)
    fast.give(blocks)  # it holds them too, once the stalled one has them all in flight
    await run
    assert len(store.missing(blocks)) == 0 and coord.asked == []
    assert sorted(map(str, fast.asked)) == sorted(map(str, blocks))
