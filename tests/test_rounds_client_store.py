"""A RoundClient's own store keeps the blocks of its latest rounds only (retention.py); a
store the caller passes in is left alone."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from helpers.net import running
from tensorswap.cid import Cid
from tensorswap.rounds import Coordinator, RoundClient, RoundServer
from tensorswap.rounds.client.retention import ROUNDS_HELD, RoundBlocks
from tensorswap.rounds.core import RoundId, RoundSpec
from tensorswap.store import MemoryStore, ModelUpdate, manifest_closure, put_update

FLOATS = 64 * 1024


def update(round_no: int, peer: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([round_no, peer])
    frozen = np.arange(FLOATS, dtype=np.float32)  # the same in every round and peer
    return {"frozen": frozen, "w": rng.standard_normal(FLOATS, np.float32)}


async def _rounds(
    tmp_path: Path, rounds: int, store: MemoryStore | None = None
) -> tuple[RoundClient, list[Cid], list[Cid]]:
    """``rounds`` FedAvg rounds of peers a (with ``store``) and b; a's client (closed), its
    submitted update CIDs and the results' CIDs."""
    coordinator = Coordinator.open(tmp_path / "c")
    mine, results = [], []
    try:
        async with running(RoundServer(coordinator)) as server:
            a = await RoundClient.connect("127.0.0.1", server.port, peer="a", store=store)
            b = await RoundClient.connect("127.0.0.1", server.port, peer="b")
            async with a, b:
                for r in range(1, rounds + 1):
                    rid = RoundId(r, "keep")
                    await a.start_round(rid, RoundSpec(2))
                    mine.append((await a.submit(rid, update(r, 0), 1)).cid)
                    await b.submit(rid, update(r, 1), 1)
                    got = await a.fetch_result(rid, timeout=30)
                    want = (update(r, 0)["w"] + update(r, 1)["w"]) / np.float32(2)
                    np.testing.assert_allclose(got["w"], want, rtol=1e-6)
                    np.testing.assert_array_equal(got["frozen"], update(r, 0)["frozen"])
                    results.append(await a.result(rid))
    finally:
        coordinator.close()
    return a, mine, results


async def test_the_own_store_holds_the_latest_rounds_only(tmp_path: Path) -> None:
    client, mine, results = await _rounds(tmp_path, 5)
    store = client.store
    kept = set()
    for cid in mine[-ROUNDS_HELD:] + results[-ROUNDS_HELD:]:
        closure = manifest_closure(store, cid)  # whole: nothing of a kept round went
        kept.update(closure)
    assert set(store) == kept
    for cid in mine[:-ROUNDS_HELD] + results[:-ROUNDS_HELD]:
        assert not store.has(cid)
    assert client.retention is not None and client.retention.deleted > 0
    assert client.retention.held_rounds == [RoundId(4, "keep"), RoundId(5, "keep")]


async def test_a_store_the_caller_passed_keeps_everything(tmp_path: Path) -> None:
    mine_store = MemoryStore()
    client, mine, results = await _rounds(tmp_path, 4, store=mine_store)
    assert client.retention is None
    assert all(mine_store.has(cid) for cid in mine + results)


def test_round_blocks_deletes_a_block_once_no_kept_round_lists_it() -> None:
    store = MemoryStore()
    shared, *own = [store.put(bytes([i]) * 10) for i in range(4)]
    blocks = RoundBlocks(store, rounds=2)
    for i, cid in enumerate(own):
        blocks.hold(RoundId(i + 1, "r"), [shared, cid], brought=[shared, cid])
        blocks.hold(RoundId(i + 1, "r"), [cid])  # held twice: counted once
    # rounds 2 and 3 are kept: round 1's own block went, the shared one stays
    assert not store.has(own[0]) and store.has(own[1]) and store.has(own[2])
    assert store.has(shared)
    assert blocks.deleted == 1
    assert blocks.held_rounds == [RoundId(2, "r"), RoundId(3, "r")]
    with pytest.raises(ValueError, match="at least 1"):
        RoundBlocks(store, rounds=0)


def test_a_block_no_round_brought_in_is_never_deleted() -> None:
    store = MemoryStore()
    theirs = store.put(b"a run's global model, put by other code")
    blocks = RoundBlocks(store, rounds=1)
    blocks.begin()
    mine = store.put(b"round 1's own block")
    blocks.hold_new(RoundId(1, "r"), [theirs, mine])  # round 1 lists both, brought one
    blocks.begin()
    blocks.hold_new(RoundId(2, "r"), [store.put(b"round 2's")])
    assert store.has(theirs) and not store.has(mine)


def test_an_older_round_held_late_is_the_one_forgotten() -> None:
    store = MemoryStore()
    blocks = RoundBlocks(store, rounds=2)
    cids = {r: store.put(bytes([r]) * 8) for r in (5, 6, 3)}
    for r, cid in cids.items():  # round 3 comes last (a late fetch of an old round)
        blocks.hold(RoundId(r, "r"), [cid], brought=[cid])
    assert blocks.held_rounds == [RoundId(5, "r"), RoundId(6, "r")]
    assert not store.has(cids[3]) and store.has(cids[5]) and store.has(cids[6])


def test_a_partial_result_in_the_store_is_left_alone() -> None:
    full = MemoryStore()
    root = put_update(full, ModelUpdate({"w": np.ones(FLOATS, np.float32)}))
    store = MemoryStore()
    store.put(full.get(root))  # the root manifest only: what a push cut short may leave
    blocks = RoundBlocks(store)
    blocks.hold_root(RoundId(1, "r"), root)  # the manifests below are missing: no error
    assert blocks.held_rounds == []
