"""Stalls without a push to wait for: a participant that never commits, a reducer that never
publishes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np
import pytest

from helpers.collective import KEY, close
from tensorswap.collective import Collective, PeerExcluded, Rendezvous
from tensorswap.collective._progress import STALL_FACTOR, STALL_FLOOR
from tensorswap.collective._state import CallState, GroupState, commit_due, publish_due
from tensorswap.collective.messages import APP, CommitInfo, Member, Reduced, ReducedInfo
from tensorswap.store import MemoryStore
from tensorswap.wire import AppRequest, BlockServer


def watch(
    server: BlockServer, made: Rendezvous, seen: Callable[[Rendezvous], bool]
) -> asyncio.Event:
    """An event set once an answered rendezvous call leaves ``made`` where ``seen`` says."""
    event = asyncio.Event()
    answer = server.handlers[APP]

    async def watched(request: AppRequest) -> bytes:
        reply = await answer(request)
        if seen(made):
            event.set()
        return reply

    server.handlers[APP] = watched
    return event


async def join_three(server: BlockServer) -> list[Collective]:
    """Three peers p0..p2 joined to group ``g`` at the rendezvous ``server``."""
    address = f"127.0.0.1:{server.port}"
    joining = (Collective.join(address, group="g", peer=f"p{i}", size=3, key=KEY) for i in range(3))
    return list(await asyncio.gather(*joining))


def test_a_peer_that_never_commits_is_dropped_once_overdue_against_the_pace() -> None:
    """Three peers finish call 0; in call 1, p0 and p1 commit and p2 never does. Once the
    rendezvous's clock is past the allowance (the commits of call 0 came at one instant of
    that clock: a lag of 0 s, so the floor alone), p2 is dropped, p0 and p1 end with their
    own mean, bit-identical, and p2's call raises PeerExcluded, naming the missing commit."""
    now = [0.0]
    inputs = [np.full(5000, float(i + 1), np.float32) for i in range(3)]

    async def main() -> tuple[list[np.ndarray], list[str], str, list[str]]:
        server = BlockServer(MemoryStore(), key=KEY)
        made = Rendezvous(clock=lambda: now[0]).attach(server)
        await server.start("127.0.0.1", 0)

        def both_committed(made: Rendezvous) -> bool:
            state = made.groups["g"].calls.get(1)
            return state is not None and {"p0", "p1"} <= set(state.commits)

        committed = watch(server, made, both_committed)
        peers = await join_three(server)
        try:
            await asyncio.gather(
                *(p.all_reduce({"w": x}) for p, x in zip(peers, inputs, strict=True))
            )
            calls = [asyncio.ensure_future(peers[i].all_reduce({"w": inputs[i]})) for i in (0, 1)]
            await committed.wait()
            assert "p2" not in made.groups["g"].calls[1].dropped  # not before the allowance
            now[0] += STALL_FLOOR + 1.0
            out = await asyncio.gather(*calls)
            with pytest.raises(PeerExcluded) as excluded:
                await peers[2].all_reduce({"w": inputs[2]})
            return (
                [r["w"] for r in out],
                peers[0].members,
                str(excluded.value),
                sorted(made.groups["g"].roster),
            )
        finally:
            await close(peers, server, made)

    results, members, why, roster = asyncio.run(main())
    want = ((inputs[0] + inputs[1]) / np.float32(2)).astype(np.float32)
    assert results[0].tobytes() == results[1].tobytes() == want.tobytes()
    assert members == ["p0", "p1"]
    assert "no commit to call 1" in why
    assert roster == ["p0", "p1"]


def _call(commits: list[str], opened: float = 10.0) -> CallState:
    members = [Member(p, "127.0.0.1", 1) for p in ("p0", "p1", "p2")]
    state = CallState(5, members, 3, opened)
    for p in commits:
        state.commits[p] = CommitInfo(1.0, b"", [])
    return state


def test_the_commit_rule_waits_for_a_measure_then_scales_by_the_longest_lag() -> None:
    assert commit_due(_call(["p0"]), None) is None  # the group's first call: never
    assert commit_due(_call([]), 1.0) is None  # nobody waits yet
    assert commit_due(_call(["p0"]), 1.5) == 10.0 + STALL_FLOOR + STALL_FACTOR * 1.5
    group = GroupState("g", 3, formed=True)
    first = group.open_call(0, now=0.0)
    assert first is not None and group.pace is None
    first.lag = 4.0  # its last commit came 4 s after its first
    second = group.open_call(1, now=20.0)
    assert second is not None and group.pace == 4.0
    second.lag = 1.0
    group.open_call(2, now=30.0)
    assert group.pace == 4.0  # the longest lag so far


def test_a_reducer_that_never_publishes_is_dropped_once_every_push_is_in() -> None:
    """p0 takes every push of slice 0 and never publishes it (its ``Reduced`` never leaves).
    Once p1 and p2 said p0 took their pushes (and published their own slices), moving the
    rendezvous's clock past the allowance (the pushes took 0 s on it: the floor) drops p0;
    p1 reduces slice 0 in its place, p1 and p2 end with their own mean, bit-identical, and
    p0's call raises PeerExcluded."""
    now = [0.0]
    inputs = [np.full(40_000, float(i + 1), np.float32) for i in range(3)]

    async def main() -> tuple[list[np.ndarray], list[str], str]:
        server = BlockServer(MemoryStore(), key=KEY)
        made = Rendezvous(clock=lambda: now[0]).attach(server)
        await server.start("127.0.0.1", 0)

        def pushes_taken(made: Rendezvous) -> bool:
            state = made.groups["g"].calls.get(0)
            took = {} if state is None else state.delivered.get((0, "p0"), {})
            return state is not None and {1, 2} <= set(state.reduced) and {"p1", "p2"} <= set(took)

        ready = watch(server, made, pushes_taken)
        peers = await join_three(server)
        ask = peers[0].ask

        async def never_publish(message):  # type: ignore[no-untyped-def]
            if isinstance(message, Reduced):
                await asyncio.Event().wait()
            return await ask(message)

        peers[0].ask = never_publish  # type: ignore[method-assign]
        try:
            calls = [
                asyncio.ensure_future(p.all_reduce({"w": inputs[i]})) for i, p in enumerate(peers)
            ]
            await ready.wait()
            assert not made.groups["g"].calls[0].dropped  # not before the allowance
            now[0] += STALL_FLOOR + 1.0
            out = await asyncio.gather(calls[1], calls[2])
            with pytest.raises(PeerExcluded) as excluded:
                await calls[0]
            return [r["w"] for r in out], peers[1].members, str(excluded.value)
        finally:
            await close(peers, server, made)

    results, members, why = asyncio.run(main())
    want = ((inputs[1] + inputs[2]) / np.float32(2)).astype(np.float32)
    assert results[0].tobytes() == results[1].tobytes() == want.tobytes()
    assert members == ["p1", "p2"]
    assert "published nothing" in why


def test_the_publish_rule_waits_for_every_push_and_scales_by_their_time() -> None:
    state = _call(["p0", "p1", "p2"], opened=10.0)
    state.committed = {"p0": 10.0, "p1": 10.0, "p2": 10.0}
    assert publish_due(state, 0) is None  # no push said to be in
    state.delivered[(0, "p0")] = {"p1": 13.0}
    assert publish_due(state, 0) is None  # p2's is not
    state.delivered[(0, "p0")]["p2"] = 14.0
    assert publish_due(state, 0) == 14.0 + STALL_FLOOR + STALL_FACTOR * 4.0
    state.changed = 20.0  # a drop since: the wait starts over
    assert publish_due(state, 0) == 20.0 + STALL_FLOOR + STALL_FACTOR * 4.0
    state.reduced[0] = ReducedInfo("p0", ["p0", "p1", "p2"], [])
    assert publish_due(state, 0) is None  # published over the live participants
    del state.committed["p0"]
    state.reduced.clear()
    assert publish_due(state, 0) is None  # a reducer that has not committed: the commit rule's
