"""The collective's faults beyond a death: a forged block, a peer that commits and stalls."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest

from helpers.collective import close, group
from tensorswap.cid import Cid
from tensorswap.collective import Collective, PeerExcluded
from tensorswap.collective._progress import STALL_FACTOR, STALL_FLOOR, Progress
from tensorswap.collective.messages import PEER_APP, Commit, decode_slice
from tensorswap.wire import AppRequest


def _forge_after_commit(forger: Collective) -> None:
    """From its commit on, ``forger`` sends each committed chunk with one bit flipped under
    the chunk's true CID (its store hands out other bytes than the CID names)."""

    def forge(committed: list[Cid]) -> list[Cid]:
        held = forger.store.get
        mine = set(committed)

        def corrupted(cid: Cid, *, verify: bool | None = None) -> memoryview:
            data = held(cid, verify=verify)
            if cid not in mine:
                return data
            body = bytearray(data)
            body[0] ^= 1
            return memoryview(bytes(body))

        forger.store.get = corrupted  # type: ignore[method-assign]
        return committed

    forger.tamper = forge


def test_a_forged_block_is_a_mismatch_and_the_forger_is_excluded() -> None:
    """p1 pushes blocks that do not hash to their CIDs: each reducer's server refuses the
    connection and accuses p1 of a mismatch; p1's call raises PeerExcluded, and the others
    end with their own mean, bit-identical, p1 named in ``liars`` and ``dropped``."""
    inputs = [{"w": np.full(3000, float(i), np.float32)} for i in range(3)]

    async def main() -> tuple[list[Any], dict[str, str], list[str]]:
        peers, server, rendezvous = await group(3)
        _forge_after_commit(peers[1])
        try:
            out = await asyncio.gather(
                *(p.all_reduce(inputs[i]) for i, p in enumerate(peers)), return_exceptions=True
            )
            view = peers[0].view(0)
            assert view is not None
            return list(out), dict(peers[0].stats.dropped), list(view.liars)
        finally:
            await close(peers, server, rendezvous)

    results, dropped, liars = asyncio.run(main())
    assert isinstance(results[1], PeerExcluded) and results[1].peer == "p1"
    assert liars == ["p1"]
    assert "does not hash to its CID" in dropped["p1"]
    np.testing.assert_array_equal(results[0]["w"], np.full(3000, 1.0, np.float32))
    assert results[0]["w"].tobytes() == results[2]["w"].tobytes()


def _note_arrivals(peer: Collective, sender: str) -> asyncio.Event:
    """An event set once ``peer`` has taken ``sender``'s notice of a pushed slice."""
    arrived = asyncio.Event()
    inner = peer.server.handlers[PEER_APP]

    async def noted(request: AppRequest) -> bytes:
        reply = await inner(request)
        if decode_slice(request.body).peer == sender:
            arrived.set()
        return reply

    peer.server.handlers[PEER_APP] = noted
    return arrived


def test_a_peer_that_commits_and_never_pushes_is_dropped_as_stalled() -> None:
    """p2 commits, keeps polling, and never pushes: once the honest peers' pushes are all
    measured (every notice of them taken), their clock moves an hour on, far past what those
    pushes explain; they accuse p2 of a stall, the rendezvous drops it, and they end with
    their own mean; p2's call raises PeerExcluded."""
    inputs = [{"w": np.full(4096, float(i), np.float32)} for i in range(3)]

    async def main() -> tuple[list[dict[str, np.ndarray]], dict[str, str], BaseException]:
        peers, server, rendezvous = await group(3)
        skew = [0.0]  # the honest peers' clock: their own time, moved on by the test
        for p in peers:
            p.clock = lambda: time.monotonic() + skew[0]
        stalled, committed = peers[2], asyncio.Event()
        ask = stalled.ask

        async def ask_and_note(message: Any) -> Any:
            answer = await ask(message)
            if isinstance(message, Commit):
                committed.set()
            return answer

        async def never_dials(member: Any) -> Any:
            await asyncio.Event().wait()

        stalled.ask = ask_and_note  # type: ignore[method-assign]
        stalled.client_of = never_dials  # type: ignore[method-assign]
        arrived = [
            _note_arrivals(peers[0], "p1"),
            _note_arrivals(peers[1], "p0"),
            *(_note_arrivals(peers[2], f"p{i}") for i in (0, 1)),
        ]
        stalling = asyncio.ensure_future(stalled.all_reduce(inputs[2]))
        try:
            await committed.wait()  # the honest peers see p2's commit from their first view
            honest = asyncio.gather(*(p.all_reduce(inputs[i]) for i, p in enumerate(peers[:2])))
            for event in arrived:
                await event.wait()
            skew[0] += 3600.0  # an hour on: far past what the measured pushes explain
            for p in peers[:2]:
                p.wake.set()
            out = await honest
            with pytest.raises(PeerExcluded) as excluded:
                await stalling
            return list(out), dict(peers[0].stats.dropped), excluded.value
        finally:
            stalling.cancel()
            await close(peers, server, rendezvous)

    results, dropped, error = asyncio.run(main())
    assert "p2" in dropped and dropped["p2"].startswith("made no progress")
    assert isinstance(error, PeerExcluded) and error.peer == "p2"
    np.testing.assert_array_equal(results[0]["w"], np.full(4096, 0.5, np.float32))
    assert results[0]["w"].tobytes() == results[1]["w"].tobytes()


def test_the_no_progress_rule_waits_for_a_measure_then_scales_by_the_slowest() -> None:
    now = [100.0]
    progress = Progress(lambda: now[0], earlier={})
    assert progress.due(0, "p2", 1000) is None  # nothing measured: never a guess
    assert progress.due(0, "p1", 1000) is None  # the wait for p1 starts at 100.0
    progress.arrived(0, "p1", 1000, 100.5)  # waited 0.5 s: 2000 values/s
    progress.arrived(0, "p3", 1000, 100.0)  # here before the wait began: instant
    progress.pushed(1000, 0.25)  # this peer's own push: 4000 values/s
    assert progress.due(0, "p2", 1000) == 100.0 + STALL_FLOOR + STALL_FACTOR * 0.5
    fresh = Progress(lambda: now[0], earlier=progress.earlier)
    assert fresh.due(1, "p1", 4000) == 100.0 + STALL_FLOOR + STALL_FACTOR * 2.0  # p1's last
    assert fresh.due(1, "p9", 4000) is None  # no push of p9 ever measured
    fresh.pushed(4000, 0.5)  # a measure of this call replaces the earlier calls'
    assert fresh.due(1, "p1", 4000) == 100.0 + STALL_FLOOR + STALL_FACTOR * 0.5


def test_concurrent_pushes_to_one_member_share_one_connection() -> None:
    """Two tasks of a call that reach the same member at once (two slices it reduces after a
    drop, or a push and a fetch) get one connection: a second dial would leave the first
    client unowned, its socket for the garbage collector."""

    async def main() -> bool:
        peers, server, rendezvous = await group(2)
        try:
            other = next(m for m in peers[0].roster if m.peer == "p1")
            first, second = await asyncio.gather(*(peers[0].client_of(other) for _ in "ab"))
            return first is second
        finally:
            await close(peers, server, rendezvous)

    assert asyncio.run(main())
