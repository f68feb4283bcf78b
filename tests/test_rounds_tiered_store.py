"""The coordinator's store keeps inline blocks as SQLite rows: one store to every reader
(get, has, listing, ages, retention), corruption caught on read, and it survives a reopen."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import numpy as np
import pytest

from tensorswap.cid import Cid
from tensorswap.errors import BlockNotFound, CorruptBlock
from tensorswap.rounds.core import Collecting, Complete, RoundId, RoundSpec
from tensorswap.rounds.engine import Coordinator
from tensorswap.rounds.protocol.inline import intake_batch
from tensorswap.rounds.storage._tiered import SMALL_DB, CoordinatorStore
from tensorswap.store import MemoryStore, ModelUpdate, get_update, manifest_closure, put_update

RID = RoundId(5, "tiered")


def test_small_blocks_are_one_store_with_the_files(tmp_path: Path) -> None:
    store = CoordinatorStore(tmp_path / "s")
    filed = store.put(b"in a file")
    small = Cid.of(b"in a row")
    store.put_small([(small, b"in a row")])
    assert not Path(store.path_of(small)).exists()  # no file for it
    assert bytes(store.get(small)) == b"in a row" and bytes(store.get(filed)) == b"in a file"
    assert store.has(small) and store.size_of(small) == 8
    assert store.missing([small, filed, Cid.of(b"no")]) == [Cid.of(b"no")]
    assert sorted(map(str, store)) == sorted(map(str, [small, filed]))
    assert store.size().blocks == 2 and store.size().nbytes == 8 + 9
    assert store.age_of(small) < 60
    assert store.delete_if_older(small, 3600) is None  # young: spared
    assert store.delete_if_older(small, 0) is True
    assert not store.has(small) and store.delete(small) is False
    with pytest.raises(BlockNotFound):
        store.get(small)
    store.close()


def test_a_small_block_that_rots_is_caught_and_dropped(tmp_path: Path) -> None:
    store = CoordinatorStore(tmp_path / "s")
    cid = Cid.of(b"payload")
    store.put_small([(cid, b"payload")])
    store.close()
    with sqlite3.connect(tmp_path / "s" / SMALL_DB) as db:
        db.execute("UPDATE small_blocks SET data = ?", (b"paylOad",))
    again = CoordinatorStore(tmp_path / "s")
    assert bytes(again.get(cid, verify=False)) == b"paylOad"  # verification off: as asked
    with pytest.raises(CorruptBlock):
        again.get(cid)
    assert not again.has(cid)  # so it can be pushed again
    again.close()


def test_inline_blocks_land_in_rows_and_the_round_survives_a_reopen(tmp_path: Path) -> None:
    updates = [ModelUpdate({"w": np.full(16, float(k), np.float32)}, k) for k in (1, 2, 3)]
    items = []
    for k, update in enumerate(updates):
        store = MemoryStore()
        cid = put_update(store, update)
        blocks = [(c, bytes(store.get(c))) for c in reversed(manifest_closure(store, cid))]
        items.append((f"p{k}", cid, blocks))
    with Coordinator.open(tmp_path, run_timer=False) as coord:
        coord.start_round(RID, RoundSpec(4))
        assert intake_batch(coord, RID, items) == [Collecting(i, 4) for i in (1, 2, 3)]
        store = coord.store
        assert isinstance(store, CoordinatorStore)
        for _, _, blocks in items:
            assert all(not Path(store.path_of(c)).exists() for c, _ in blocks)
    with Coordinator.open(tmp_path, run_timer=False) as again:  # blocks and journal are back
        assert [c.peer for c in again.contributions(RID)] == ["p0", "p1", "p2"]
        last = ModelUpdate({"w": np.full(16, 4.0, np.float32)}, 4)
        again.submit(RID, "p3", put_update(again.store, last))
        done = again.wait(RID, timeout=30)
        assert isinstance(done, Complete)
        result = get_update(again.store, Cid.parse(done.cid)).tensors["w"]
    np.testing.assert_allclose(result, (1 + 4 + 9 + 16) / 10)
