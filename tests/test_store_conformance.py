"""One conformance suite for every BlockStore implementation."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from helpers.store import make_older, make_store
from tensorswap.cid import Cid, HashFunction, Multicodec
from tensorswap.errors import BlockNotFound, HashMismatch, StoreError
from tensorswap.store import BlockStore, StoreSize


@pytest.fixture(params=["memory", "directory", "directory-fsync"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BlockStore]:
    """The shared ``store`` fixture's kinds, and a DirectoryStore that fsyncs."""
    with make_store(request.param, tmp_path / "store") as made:
        yield made


def test_put_get_round_trip(store: BlockStore) -> None:
    cid = store.put(b"hello block")
    assert cid == Cid.of(b"hello block")
    view = store.get(cid)
    assert isinstance(view, memoryview)
    assert view.readonly and view.format == "B" and view.ndim == 1
    assert view == b"hello block"


def test_put_returns_requested_codec_and_hash(store: BlockStore) -> None:
    cid = store.put(b"m", codec=Multicodec.TENSORSWAP_MANIFEST, hash=HashFunction.SHA2_256)
    assert cid == Cid.of(b"m", codec=Multicodec.TENSORSWAP_MANIFEST, hash=HashFunction.SHA2_256)
    assert store.get(cid) == b"m"


def test_put_accepts_any_buffer(store: BlockStore) -> None:
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    cid = store.put(arr)
    assert cid == Cid.of(arr.tobytes())
    assert np.array_equal(np.frombuffer(store.get(cid), dtype=np.float32), arr.reshape(-1))
    assert store.put(bytearray(b"xy")) == Cid.of(b"xy")
    assert store.put(memoryview(b"xyz")[1:]) == Cid.of(b"yz")


def test_put_copies_unless_adopted(store: BlockStore) -> None:
    data = bytearray(b"mutable")
    cid = store.put(data)
    data[0] = ord("M")
    assert store.get(cid) == b"mutable"


def test_put_is_idempotent(store: BlockStore) -> None:
    first = store.put(b"same")
    second = store.put(b"same", adopt=True)
    assert first == second
    assert store.size() == StoreSize(1, 4)
    assert list(store) == [first]


def test_zero_length_block(store: BlockStore) -> None:
    cid = store.put(b"")
    assert store.has(cid)
    view = store.get(cid)
    assert isinstance(view, memoryview) and view.nbytes == 0
    assert store.size() == StoreSize(1, 0)


def test_get_missing_raises_block_not_found(store: BlockStore) -> None:
    cid = Cid.of(b"never stored")
    with pytest.raises(BlockNotFound) as info:
        store.get(cid)
    assert info.value.cid == cid
    assert isinstance(info.value, KeyError) and isinstance(info.value, StoreError)
    assert str(cid) in str(info.value)


def test_has_and_contains(store: BlockStore) -> None:
    cid = store.put(b"here")
    assert store.has(cid) and cid in store
    absent = Cid.of(b"absent")
    assert not store.has(absent) and absent not in store
    assert "not a cid" not in store


def test_size_of(store: BlockStore) -> None:
    cid = store.put(b"12345")
    assert store.size_of(cid) == 5
    assert store.size_of(store.put(b"")) == 0
    with pytest.raises(BlockNotFound):
        store.size_of(Cid.of(b"absent"))


def test_delete(store: BlockStore) -> None:
    cid = store.put(b"doomed")
    keep = store.put(b"kept")
    view = store.get(cid)
    assert store.delete(cid) is True
    assert not store.has(cid)
    assert store.delete(cid) is False
    assert view == b"doomed"  # earlier views stay valid
    with pytest.raises(BlockNotFound):
        store.get(cid)
    assert list(store) == [keep]


def test_iterate_and_size(store: BlockStore) -> None:
    payloads = [bytes([i]) * i for i in range(1, 20)]
    cids = {store.put(p) for p in payloads}
    assert set(store) == cids
    assert set(store.iterate()) == cids
    assert store.size() == StoreSize(len(payloads), sum(len(p) for p in payloads))


def test_missing(store: BlockStore) -> None:
    held = [store.put(bytes([i])) for i in range(3)]
    absent = [Cid.of(b"a"), Cid.of(b"b")]
    query = [absent[0], held[0], absent[1], held[2], absent[0]]
    assert store.missing(query) == absent
    assert store.missing(held) == []
    assert store.missing([]) == []


def test_put_verified(store: BlockStore) -> None:
    cid = Cid.of(b"claimed")
    assert store.put_verified(cid, b"claimed") == cid
    assert store.get(cid) == b"claimed"
    wrong = Cid.of(b"other")
    with pytest.raises(HashMismatch):
        store.put_verified(wrong, b"claimed!")
    assert not store.has(wrong)
    assert store.size().blocks == 1


def test_get_views_are_independent(store: BlockStore) -> None:
    cid = store.put(b"shared")
    store.get(cid).release()
    assert store.get(cid) == b"shared"


def test_concurrent_puts_from_threads(store: BlockStore) -> None:
    payloads = [bytes([i % 7]) * (i % 7 + 1) * 100 for i in range(64)]
    barrier = threading.Barrier(8)
    results: list[list[Cid]] = [[] for _ in range(8)]

    def worker(slot: int) -> None:
        barrier.wait()
        results[slot] = [store.put(p) for p in payloads]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r == results[0] for r in results)
    distinct = {Cid.of(p): p for p in payloads}
    assert set(store) == set(distinct)
    assert store.size() == StoreSize(len(distinct), sum(len(p) for p in distinct.values()))
    for cid, payload in distinct.items():
        assert store.get(cid) == payload


def test_large_block_zero_copy_read(store: BlockStore) -> None:
    arr = np.random.default_rng(1).standard_normal(300_000).astype(np.float32)
    cid = store.put(arr)
    values = np.frombuffer(store.get(cid), dtype=np.float32)
    assert np.array_equal(values, arr)
    assert not values.flags.writeable


# ── ages (for garbage collection with a grace period) ──────────────────────────────────────────
def test_age_starts_at_put_and_restarts_at_touch_or_repeated_put(store: BlockStore) -> None:
    cid = store.put(b"aging block")
    assert 0.0 <= store.age_of(cid) < 60  # type: ignore[operator]
    make_older(store, cid, 1000)
    assert store.age_of(cid) >= 999  # type: ignore[operator]
    store.touch([cid, Cid.of(b"absent")])  # absent CIDs are skipped
    assert store.age_of(cid) < 60  # type: ignore[operator]
    make_older(store, cid, 1000)
    assert store.put(b"aging block") == cid  # already held: its age restarts too
    assert store.age_of(cid) < 60  # type: ignore[operator]
    assert store.get(cid) == b"aging block"


def test_age_of_an_absent_block_is_block_not_found(store: BlockStore) -> None:
    with pytest.raises(BlockNotFound):
        store.age_of(Cid.of(b"never stored"))
    cid = store.put(b"gone soon")
    store.delete(cid)
    with pytest.raises(BlockNotFound):
        store.age_of(cid)


def test_delete_if_older_spares_young_blocks_and_reports_absent_ones(store: BlockStore) -> None:
    cid = store.put(b"maybe old")
    assert store.delete_if_older(cid, 600) is None and store.has(cid)
    make_older(store, cid, 1000)
    assert store.delete_if_older(cid, 600) is True and not store.has(cid)
    assert store.delete_if_older(cid, 600) is False
