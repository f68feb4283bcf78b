"""Cut-through pacing (rounds.engine._cut_pace): a peer far ahead of the folds waits on its
sink thread, driven without a network (``on_stored`` called as the block service calls it)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import numpy as np
import pytest

from tensorswap.cid import Cid, Multicodec
from tensorswap.errors import NotSelected
from tensorswap.rounds import Coordinator
from tensorswap.rounds.client._updates import children_first
from tensorswap.rounds.core import RoundId, RoundSpec
from tensorswap.rounds.engine._cut_pace import Pacer
from tensorswap.rounds.engine.hooks import Admission, CoordinatorHooks
from tensorswap.store import MemoryStore, ModelUpdate, put_update

RID = RoundId(1, "lead")
CHUNK = 64 * 1024


class Clock:
    """A clock the test moves; ``asked`` is set whenever the pacer reads it."""

    def __init__(self) -> None:
        self.now = 0.0
        self.asked = threading.Event()

    def __call__(self) -> float:
        self.asked.set()
        return self.now


def round_of_two(
    clock: Callable[[], float], patience: float = 30.0
) -> tuple[Coordinator, list[Peer]]:
    coord = Coordinator(MemoryStore(), run_timer=False)
    coord.result_chunk_bytes = CHUNK
    coord.cut.pacer = Pacer(window_bytes=1, min_patience=patience, clock=clock)
    coord.start_round(RID, RoundSpec(2))
    rng = np.random.default_rng(7)
    peers = [Peer(f"p{i}", rng.standard_normal(3 * CHUNK // 4, np.float32)) for i in range(2)]
    for peer in peers:
        assert coord.cut.announce(RID, peer.name, peer.cid, peer.manifests).ok
    return coord, peers


class Peer:
    def __init__(self, name: str, values: np.ndarray) -> None:
        self.name = name
        self.store = MemoryStore()
        self.cid = put_update(self.store, ModelUpdate({"w": values}, 10), chunk_bytes=CHUNK)
        closure = children_first(self.store, self.cid)
        manifest = Multicodec.TENSORSWAP_MANIFEST
        self.manifests = {c: bytes(self.store.get(c)) for c in closure if c.codec is manifest}
        self.chunks = [c for c in closure if c.codec is not Multicodec.TENSORSWAP_MANIFEST]
        assert len(self.chunks) == 3

    def deliver(self, coord: Coordinator, k: int) -> None:
        """Chunk ``k`` stored at the coordinator and handed to its cut-through, as a sink."""
        cid: Cid = self.chunks[k]
        data = bytes(self.store.get(cid))
        coord.store.put_verified(cid, data)
        coord.cut.on_stored(cid, memoryview(data))


def in_thread(fn: object) -> threading.Thread:
    thread = threading.Thread(target=fn, daemon=True)  # type: ignore[arg-type]
    thread.start()
    return thread


def test_a_peer_ahead_waits_until_the_piece_before_it_folds() -> None:
    clock = Clock()
    coord, (a, b) = round_of_two(clock)
    with coord:
        a.deliver(coord, 0)  # the next piece to fold: it goes on
        assert coord.cut.pacer.waits == 0
        clock.asked.clear()
        ahead = in_thread(lambda: a.deliver(coord, 1))
        assert clock.asked.wait(30)  # a's second chunk is waiting on its sink thread
        assert coord.cut.pacer.waits == 1 and ahead.is_alive()
        assert coord.cut.stats()["cut_held_bytes"] == CHUNK  # a's first chunk only
        b.deliver(coord, 0)  # piece 0 folds: a's second chunk goes on
        ahead.join(30)
        assert not ahead.is_alive()
        assert coord.cut.folded == 1
        b.deliver(coord, 1)
        assert coord.cut.folded == 2
        assert coord.cut.stats()["cut_paced_waits"] == 1
        assert coord.cut.stats()["cut_pacing_off"] == 0


def test_pacing_is_given_up_when_no_piece_folds_for_its_patience() -> None:
    clock = Jumping([0.0, 5.0])  # the wait begins at 0; when it looks again, it is 5
    coord, (a, b) = round_of_two(clock, patience=1.0)
    with coord:
        a.deliver(coord, 0)
        a.deliver(coord, 1)  # ahead; b silent past the patience: it goes on, pacing off
        assert coord.cut.stats()["cut_pacing_off"] == 1
        a.deliver(coord, 2)  # no pacing in this round any more: no wait
        assert coord.cut.pacer.waits == 1
        for k in range(3):
            b.deliver(coord, k)
        assert coord.cut.folded == 3  # every piece folded all the same


class Jumping:
    """A clock that reads ``times`` one after the other, then stays at the last."""

    def __init__(self, times: list[float]) -> None:
        self.times = list(times)

    def __call__(self) -> float:
        return self.times.pop(0) if len(self.times) > 1 else self.times[0]


def test_an_abandoned_round_lets_a_waiting_sink_go() -> None:
    clock = Clock()
    coord, (a, _) = round_of_two(clock)
    with coord:
        a.deliver(coord, 0)
        clock.asked.clear()
        ahead = in_thread(lambda: a.deliver(coord, 1))
        assert clock.asked.wait(30)
        coord.cut.abandon(RID, "a test gives the round up")
        ahead.join(30)
        assert not ahead.is_alive()
        assert coord.cut.stats()["cut_held_bytes"] == 0


async def test_a_block_stored_on_the_event_loop_never_waits() -> None:
    coord, (a, _) = round_of_two(Clock())
    with coord:
        a.deliver(coord, 0)
        a.deliver(coord, 1)  # ahead, but on the loop: blocking here would stall the server
        a.deliver(coord, 2)
        await asyncio.sleep(0)
        assert coord.cut.pacer.waits == 0


def test_small_chunks_run_ahead_within_the_window() -> None:
    coord, (a, _) = round_of_two(Clock())
    with coord:
        coord.cut.pacer.window_bytes = 3 * CHUNK  # every chunk of the update fits
        for k in range(3):
            a.deliver(coord, k)
        assert coord.cut.pacer.waits == 0


def test_a_window_must_be_positive() -> None:
    with pytest.raises(ValueError, match="window_bytes"):
        Pacer(window_bytes=0)


def test_announced_manifests_are_capped_over_all_rounds() -> None:
    rid2 = RoundId(2, "lead")
    coord, (a, b) = round_of_two(Clock())
    with coord:
        held = coord.cut.announced_bytes
        assert held == sum(len(d) for p in (a, b) for d in p.manifests.values())
        coord.cut.max_announced_bytes = held + 1  # no room for another round's
        coord.start_round(rid2, RoundSpec(2))
        refused = coord.cut.announce(rid2, a.name, a.cid, a.manifests)
        assert not refused.ok and "bytes of announcements" in refused.reason
        assert coord.cut.announced_bytes == held  # the refused one's reservation went back
        for k in range(3):  # in step: the round's pacing holds a chunk far ahead
            a.deliver(coord, k)
            b.deliver(coord, k)
        for peer in (a, b):  # round 1 ends: its announcements may now be forgotten
            for cid, data in peer.manifests.items():  # pushed after its chunks
                coord.store.put_verified(cid, data)
            coord.submit(RID, peer.name, peer.cid)
        assert coord.wait(RID, timeout=30).is_terminal
        taken = coord.cut.announce(rid2, a.name, a.cid, a.manifests)
        assert taken.ok  # the ended round was forgotten to make room
        assert coord.cut.announced_bytes == sum(len(d) for d in a.manifests.values())
        again = coord.cut.announce(rid2, a.name, a.cid, a.manifests)  # the same, once more
        assert again.ok and coord.cut.announced_bytes == sum(len(d) for d in a.manifests.values())


class Refusing(CoordinatorHooks):
    """Admits no submit of ``peer`` (as a run's sampler refuses a peer not selected)."""

    def __init__(self, peer: str) -> None:
        self.peer = peer

    def admit(self, admission: Admission) -> None:
        if admission.peer == self.peer:
            raise NotSelected("run", admission.round_id.round, admission.peer, 1)


def test_an_announcement_is_admitted_by_the_hooks_as_its_submit_would_be() -> None:
    coord = Coordinator(MemoryStore(), run_timer=False, hooks=[Refusing("p1")])
    with coord:
        coord.result_chunk_bytes = CHUNK
        coord.start_round(RID, RoundSpec(2))
        rng = np.random.default_rng(9)
        a, b = (Peer(f"p{i}", rng.standard_normal(3 * CHUNK // 4, np.float32)) for i in range(2))
        assert coord.cut.announce(RID, a.name, a.cid, a.manifests).ok
        refused = coord.cut.announce(RID, b.name, b.cid, b.manifests)
        assert not refused.ok and "was not selected" in refused.reason
        assert coord.cut.announced_bytes == sum(len(d) for d in a.manifests.values())
