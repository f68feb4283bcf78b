"""The pipelined all-reduce: reduced chunks move on while later inputs still arrive."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

from helpers.collective import close, group, hold_push, mean_in_order, noted, stored
from tensorswap.cid import Cid
from tensorswap.collective import Collective
from tensorswap.collective._layout import MIN_PIPELINE_ELEMS, chunk_bounds
from tensorswap.collective.messages import PEER_APP, decode_slice
from tensorswap.wire import AppRequest

CHUNKS_PER_SLICE = 4
ELEMS = 3 * CHUNKS_PER_SLICE * MIN_PIPELINE_ELEMS
"""Three peers' slices of four chunks each."""


def _inputs(n: int, seed: int = 11) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(ELEMS).astype(np.float32) for _ in range(n)]


def _reduced_cid(inputs: list[np.ndarray], weights: list[float], k: int) -> Cid:
    """The CID of reduced chunk ``k`` over ``inputs`` (what its reducer stores)."""
    start, stop = chunk_bounds(ELEMS, 3)[k]
    return Cid.of(mean_in_order([x[start:stop] for x in inputs], weights))


def test_the_slices_are_cut_for_the_pipeline() -> None:
    bounds = chunk_bounds(ELEMS, 3)
    assert len(bounds) == 3 * CHUNKS_PER_SLICE
    assert {stop - start for start, stop in bounds} == {MIN_PIPELINE_ELEMS}
    assert len(chunk_bounds(40_000, 4)) == 4  # small inputs: about one chunk a peer


def test_a_reduced_chunk_reaches_the_others_before_its_slice_is_complete() -> None:
    """p2's push of slice 0 to p0 stops after its first chunk: p0 folds chunk 0 and pushes
    it to p1 while the rest of the slice is missing (nothing published yet); once the push
    goes on, every member ends with the same bits, those of the fold in member order."""
    inputs, weights = _inputs(3), [1.0, 2.0, 0.5]

    async def main() -> tuple[list[Any], list[int]]:
        peers, server, rendezvous = await group(3)
        gate = hold_push(peers[2], "p0")
        first = stored(peers[1], _reduced_cid(inputs, weights, 0))
        second = _reduced_cid(inputs, weights, 1)
        try:
            calls = asyncio.gather(
                *(p.all_reduce({"w": inputs[i]}, weights[i]) for i, p in enumerate(peers))
            )
            await first.wait()
            view = peers[0].view(0)
            assert view is not None and 0 not in view.reduced
            assert not peers[1].store.has(second)
            gate.set()
            out = await calls
            return [r["w"] for r in out], [p.stats.bytes_received for p in peers]
        finally:
            await close(peers, server, rendezvous)

    results, received = asyncio.run(main())
    want = mean_in_order(inputs, weights)
    for result in results:
        assert result.tobytes() == want.tobytes()
    assert received == [2 * ELEMS // 3 * 4] * 3  # two reduced slices each, pushed or fetched


def test_a_peer_cut_in_the_middle_of_the_pipeline() -> None:
    """p0 has folded chunk 0 over all three and pushed it on when p2 (its push of slice 0
    held after one chunk) is cut: the survivors fold again over themselves and end with
    their own weighted mean, bit-identical, p2 dropped; the chunk folded over three is
    deleted with the call's other blocks (at the end of the next call)."""
    inputs, weights = _inputs(3, seed=12), [1.0, 3.0, 2.0]
    stale = _reduced_cid(inputs, weights, 0)

    async def main() -> tuple[list[Any], dict[str, str], list[str]]:
        peers, server, rendezvous = await group(3)
        hold_push(peers[2], "p0")
        first = stored(peers[1], stale)
        victim = asyncio.ensure_future(peers[2].all_reduce({"w": inputs[2]}, weights[2]))
        honest = asyncio.gather(
            *(p.all_reduce({"w": inputs[i]}, weights[i]) for i, p in enumerate(peers[:2]))
        )
        try:
            await first.wait()
            victim.cancel()
            await peers[2].aclose()
            out = await honest
            dropped = dict(peers[0].stats.dropped)
            assert all(p.store.has(stale) for p in peers[:2])
            await asyncio.gather(*(p.all_reduce({"w": inputs[i]}) for i, p in enumerate(peers[:2])))
            assert not any(p.store.has(stale) for p in peers[:2])
            return [r["w"] for r in out], dropped, list(peers[1].members)
        finally:
            victim.cancel()
            await close(peers[:2], server, rendezvous)

    results, dropped, members = asyncio.run(main())
    assert "p2" in dropped and members == ["p0", "p1"]
    want = mean_in_order(inputs[:2], weights[:2])
    assert results[0].tobytes() == want.tobytes()
    assert results[1].tobytes() == want.tobytes()


def _never_answers_reduced(peer: Collective) -> None:
    """``peer`` stores every pushed block but never answers a notice of reduced chunks."""
    inner = peer.server.handlers[PEER_APP]

    async def handler(request: AppRequest) -> bytes:
        if decode_slice(request.body).reduced:
            await asyncio.Event().wait()
        return await inner(request)

    peer.server.handlers[PEER_APP] = handler


def test_a_member_that_never_takes_the_reduced_pushes_does_not_hold_the_seal() -> None:
    """p2 never answers the notices of the reduced chunks pushed to it: p0 and p1 publish
    their slices once the no-progress rule's patience for them has run out on their clock
    (moved an hour on once everything else is in), and the call ends with all three."""
    inputs, weights = _inputs(3, seed=13), [1.0, 1.0, 1.0]

    async def main() -> tuple[list[Any], list[list[str]]]:
        peers, server, rendezvous = await group(3)
        skew = [0.0]
        for p in peers[:2]:
            p.clock = lambda: time.monotonic() + skew[0]
        _never_answers_reduced(peers[2])
        events = [
            noted(peers[0], "p1", reduced=True),
            noted(peers[1], "p0", reduced=True),
            *(noted(peers[i], f"p{k}", reduced=False) for i in (0, 1) for k in range(3) if k != i),
        ]
        try:
            calls = asyncio.gather(
                *(p.all_reduce({"w": inputs[i]}, weights[i]) for i, p in enumerate(peers))
            )
            for event in events:
                await event.wait()
            skew[0] += 3600.0
            for p in peers[:2]:
                p.wake.set()
            out = await calls
            return [r["w"] for r in out], [list(p.members) for p in peers]
        finally:
            await close(peers, server, rendezvous)

    results, members = asyncio.run(main())
    assert members == [["p0", "p1", "p2"]] * 3
    want = mean_in_order(inputs, weights)
    for result in results:
        assert result.tobytes() == want.tobytes()
