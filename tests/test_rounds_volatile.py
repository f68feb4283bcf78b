"""The coordinator's in-memory tier for SecAgg+ masked vectors (``rounds.storage._volatile``):
blocks of the ``tensorswap-masked`` codec are held in memory up to a budget, then in files; the
store's every view (get, has, listing, sizes, ages, retention) sees them; a restart forgets
them; a secure round's masked vectors never reach a file and are gone once folded."""

from __future__ import annotations

import numpy as np
import pytest

from tensorswap.cid import Cid, Multicodec
from tensorswap.errors import BlockNotFound
from tensorswap.rounds.storage import CoordinatorStore
from tensorswap.rounds.storage._volatile import VolatileBlocks

MASKED = Multicodec.TENSORSWAP_MASKED


def _block(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def test_blocks_are_held_up_to_the_budget_adopted_or_copied() -> None:
    tier = VolatileBlocks(limit_bytes=100)
    mine = np.frombuffer(bytearray(_block(60)), np.uint8)
    a = Cid.of(mine.data, codec=MASKED)
    assert tier.put(a, memoryview(mine), adopt=True)
    held = tier.get(a)
    assert held is not None and held.readonly
    assert np.shares_memory(np.frombuffer(held, np.uint8), mine)  # adopted: no copy
    b_data = _block(40, 1)
    b = Cid.of(b_data, codec=MASKED)
    source = bytearray(b_data)
    assert tier.put(b, memoryview(source), adopt=False)
    source[0] ^= 0xFF  # a copy: the caller's later writes do not reach it
    assert bytes(tier.get(b) or b"") == b_data
    assert tier.nbytes == 100 and len(tier) == 2
    c = Cid.of(b"x", codec=MASKED)
    assert not tier.put(c, memoryview(b"x"), adopt=False)  # over the budget: refused
    assert c not in tier and tier.nbytes == 100
    assert tier.put(a, memoryview(mine), adopt=True)  # held already: fine, counted once
    assert tier.nbytes == 100
    assert tier.delete(a) and not tier.delete(a)
    assert tier.nbytes == 40
    assert tier.put(c, memoryview(b"x"), adopt=False)
    assert sorted(map(str, tier.cids())) == sorted([str(b), str(c)])


def test_ages_touch_and_delete_if_older(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr("tensorswap.rounds.storage._volatile.time.time", lambda: now[0])
    tier = VolatileBlocks()
    cid = Cid.of(b"masked", codec=MASKED)
    tier.put(cid, memoryview(b"masked"), adopt=False)
    now[0] += 5
    assert tier.age_of(cid) == 5
    assert tier.delete_if_older(cid, 10) is None  # young: spared
    tier.touch([cid])
    assert tier.age_of(cid) == 0
    now[0] += 11
    assert tier.delete_if_older(cid, 10) is True
    assert tier.delete_if_older(cid, 10) is False and tier.age_of(cid) is None
    with pytest.raises(ValueError):
        VolatileBlocks(-1)


def test_the_coordinator_store_holds_masked_blocks_in_memory_only(tmp_path) -> None:
    store = CoordinatorStore(tmp_path / "blocks")
    data = _block(4096)
    cid = store.put(data, codec=MASKED)
    assert cid.codec is MASKED
    assert not (tmp_path / "blocks").joinpath(store.path_of(cid)).exists()
    assert store.has(cid) and cid in store and store.missing([cid]) == []
    assert bytes(store.get(cid)) == data and store.size_of(cid) == 4096
    assert cid in set(store) and store.size().blocks == 1 and store.size().nbytes == 4096
    assert store.age_of(cid) < 60
    assert store.delete_if_older(cid, 3600) is None
    raw = store.put(data)  # the same bytes as a raw block: a file, as ever
    assert raw != cid and (tmp_path / "blocks").joinpath(store.path_of(raw)).exists()
    assert store.delete(cid) and not store.has(cid) and store.has(raw)
    with pytest.raises(BlockNotFound):
        store.get(cid)
    kept = store.put(data, codec=MASKED)
    store.close()
    reopened = CoordinatorStore(tmp_path / "blocks")  # a restart forgets them
    assert not reopened.has(kept) and reopened.has(raw)
    assert reopened.delete_if_older(kept, 0) is False
    reopened.close()


def test_beyond_the_budget_masked_blocks_go_to_files(tmp_path) -> None:
    store = CoordinatorStore(tmp_path / "blocks", volatile_bytes=5000)
    first = store.put(_block(4096, 1), codec=MASKED)
    second = store.put(_block(4096, 2), codec=MASKED)  # does not fit: a file
    assert first in store.volatile and second not in store.volatile
    assert (tmp_path / "blocks").joinpath(store.path_of(second)).exists()
    assert store.has(second) and bytes(store.get(second)) == _block(4096, 2)
    assert store.size().blocks == 2
    assert store.delete(second) and not store.has(second)
    assert store.delete_if_older(first, 0) is True and not store.has(first)
    assert store.volatile.nbytes == 0
    store.close()
