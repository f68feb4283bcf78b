"""SwarmTracker and the swarm messages: what is listed, bounds, refusals, bad bytes."""

from __future__ import annotations

import asyncio

import pytest

from tensorswap.cid import Cid
from tensorswap.store import MemoryStore
from tensorswap.swarm import BadSwarmMessage, Holdings, SwarmTracker
from tensorswap.swarm.messages import (
    Announce,
    HaveAnswer,
    HaveQuery,
    HoldersAnswer,
    HoldersQuery,
    Leave,
    decode_answer,
    decode_have,
    decode_have_answer,
    encode,
)
from tensorswap.wire import AppRequest


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def request(body: bytes, peer: str = "198.18.0.9:4321") -> AppRequest:
    return AppRequest("swarm", body, peer, 1)


async def ask(tracker: SwarmTracker, call: Announce | HoldersQuery | Leave) -> HoldersAnswer:
    return decode_answer(await tracker.handle(request(encode(call))))


@pytest.fixture
def store() -> MemoryStore:
    return MemoryStore()


async def test_announces_list_holders_in_order_without_the_asker(store: MemoryStore) -> None:
    root = store.put(b"a result")
    tracker = SwarmTracker(store)
    assert (await ask(tracker, Announce(root.to_bytes(), "a", "10.0.0.1", 7000))).holders == []
    before = await ask(tracker, Announce(root.to_bytes(), "b", "", 7001))
    assert [h.peer for h in before.holders] == ["a"]
    listed = await ask(tracker, HoldersQuery(root.to_bytes(), "a"))
    assert [(h.peer, h.host, h.port) for h in listed.holders] == [("b", "198.18.0.9", 7001)]
    await ask(tracker, Leave(root.to_bytes(), "b"))
    assert (await ask(tracker, HoldersQuery(root.to_bytes(), "a"))).holders == []


async def test_an_announce_of_a_root_the_coordinator_lacks_is_refused(store: MemoryStore) -> None:
    tracker = SwarmTracker(store)
    answer = await ask(tracker, Announce(Cid.of(b"unknown").to_bytes(), "a", "h", 1))
    assert answer.error is not None and "does not serve" in answer.error
    assert tracker.refused == 1


async def test_bounds_roots_holders_and_age(store: MemoryStore) -> None:
    clock = Clock()
    tracker = SwarmTracker(store, max_roots=2, max_holders=2, ttl=10, clock=clock)
    roots = [store.put(bytes([i])) for i in range(3)]
    for root in roots:
        tracker.announce(root, "a", "h", 1)
    assert tracker.holders(roots[0]) == []  # the least recently announced root went
    for name in "bcd":
        tracker.announce(roots[2], name, "h", 1)
    assert [h.peer for h in tracker.holders(roots[2])] == ["c", "d"]
    clock.now = 11
    tracker.announce(roots[2], "e", "h", 1)
    assert [h.peer for h in tracker.holders(roots[2])] == ["e"]  # c and d expired


@pytest.mark.parametrize(
    "body",
    [b"\xc1", encode(Announce(b"\x01", "a", "h", 1)), encode(Announce(b"", "a", "h", 70000))],
)
async def test_bad_requests_are_typed_errors(store: MemoryStore, body: bytes) -> None:
    with pytest.raises(BadSwarmMessage):
        await SwarmTracker(store).handle(request(body))


def test_bad_have_messages_are_typed_errors() -> None:
    with pytest.raises(BadSwarmMessage):
        decode_have(encode(HaveQuery(b"x", since=-1)))
    with pytest.raises(BadSwarmMessage):
        decode_have(encode(HaveQuery(b"x", wait=float("nan"))))
    with pytest.raises(BadSwarmMessage):
        decode_have_answer(encode(HaveAnswer(version=-2)))
    with pytest.raises(BadSwarmMessage):
        decode_answer(b"not msgpack at all \xc1")


async def test_holdings_tell_new_chunks_and_claims_and_wake_waiters() -> None:
    holdings = Holdings(keep=1)
    root, a, b = Cid.of(b"root"), Cid.of(b"a"), Cid.of(b"b")
    holdings.serve(root)
    assert (await holdings.have(Cid.of(b"other"), 0, 0)).serving is False
    waiting = asyncio.ensure_future(holdings.have(root, 0, 5.0))
    await asyncio.sleep(0)
    holdings.add(root, [a])
    told = await waiting
    assert told.version == 1 and told.chunks == [a.to_bytes()]
    holdings.claim(root, [b], True)
    news = await holdings.have(root, 1, 5.0)  # claims changed since version 0: at once
    assert news.claimed == [b.to_bytes()] and news.claims_version == 1
    assert holdings.serves(a) and holdings.serves(root) and not holdings.serves(b)
    holdings.serve(Cid.of(b"next root"))  # keep=1: the first root is forgotten
    assert not holdings.serves(a)
