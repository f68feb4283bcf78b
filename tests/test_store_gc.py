"""Garbage collection keeps what roots reach and removes the rest."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from helpers.store import make_older
from tensorswap.cid import Cid, Multicodec
from tensorswap.codec import TensorBlock
from tensorswap.errors import BlockNotFound
from tensorswap.store import (
    BlockStore,
    DirectoryStore,
    GcResult,
    MemoryStore,
    ModelUpdate,
    StoreSize,
    collect_garbage,
    get_update,
    manifest_closure,
    put_tensor,
    put_update,
    reachable,
)

CHUNK = 64


def _update(seed: int, shared: np.ndarray) -> ModelUpdate:
    own = np.random.default_rng(seed).standard_normal(40).astype(np.float32)
    return ModelUpdate({"shared": shared, "own": own}, num_samples=seed)


def test_gc_keeps_reachable_and_removes_the_rest(store: BlockStore) -> None:
    shared = np.arange(64, dtype=np.float32)
    keep = put_update(store, _update(1, shared), chunk_bytes=CHUNK)
    drop = put_update(store, _update(2, shared), chunk_bytes=CHUNK)
    loose = store.put(b"unreferenced leaf")
    kept_set = set(manifest_closure(store, keep))
    dropped = set(manifest_closure(store, drop)) - kept_set
    total = store.size()

    preview = collect_garbage(store, [keep], dry_run=True)
    assert store.size() == total
    result = collect_garbage(store, [keep])
    assert result == preview
    assert result.removed == len(dropped) + 1
    assert result.kept == len(kept_set)
    assert result.removed_bytes + result.kept_bytes == total.nbytes
    assert set(store) == kept_set
    assert not store.has(loose)
    assert get_update(store, keep).num_samples == 1
    assert collect_garbage(store, [keep]) == GcResult(0, 0, result.kept, result.kept_bytes)


def test_gc_with_no_roots_empties_the_store(store: BlockStore) -> None:
    put_tensor(store, TensorBlock("t", np.ones(100, np.int8)), chunk_bytes=CHUNK)
    result = collect_garbage(store, [])
    assert result.kept == 0 and result.removed > 0
    assert store.size() == StoreSize(0, 0)


def test_raw_and_missing_roots(store: BlockStore) -> None:
    leaf = store.put(b"raw root")
    other = store.put(b"other")
    ghost = Cid.of(b"never stored", codec=Multicodec.TENSORSWAP_MANIFEST)
    assert reachable(store, [leaf, ghost]) == {leaf}
    collect_garbage(store, [leaf, ghost])
    assert set(store) == {leaf}
    assert not store.has(other)


def test_missing_linked_manifest_aborts_without_deleting(store: BlockStore) -> None:
    root = put_update(store, _update(3, np.zeros(8, np.float32)), chunk_bytes=CHUNK)
    tensor_manifest = manifest_closure(store, root)[1]
    assert tensor_manifest.codec is Multicodec.TENSORSWAP_MANIFEST
    loose = store.put(b"loose")
    store.delete(tensor_manifest)
    before = store.size()
    with pytest.raises(BlockNotFound):
        collect_garbage(store, [root])
    assert store.size() == before and store.has(loose)


def test_gc_removes_stale_temp_files(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path)
    cid = store.put(b"kept")
    tmp = os.path.join(os.path.dirname(store.path_of(cid)), f".{cid}.0123.tmp")
    Path(tmp).write_bytes(b"partial")
    old = os.stat(tmp).st_mtime - 7200
    os.utime(tmp, (old, old))
    result = collect_garbage(store, [cid])
    assert result.temp_files_removed == 1 and result.kept == 1
    assert store.temp_files() == []


def test_min_age_spares_young_unreachable_blocks(store: BlockStore) -> None:
    old = store.put(b"old and unreferenced")
    young = store.put(b"young and unreferenced")
    make_older(store, old, 1000)
    result = collect_garbage(store, [], min_age=600)
    assert (result.removed, result.spared, result.kept) == (1, 1, 1)
    assert not store.has(old) and store.has(young)
    result = collect_garbage(store, [])  # no grace: everything unreachable goes
    assert result.removed == 1 and not store.has(young)


def test_min_age_with_a_store_that_keeps_no_ages_spares_everything_unreachable() -> None:
    class Ageless(MemoryStore):
        def age_of(self, cid: Cid) -> None:  # type: ignore[override]
            return None

    store = Ageless()
    cid = store.put(b"unknown age")
    assert collect_garbage(store, [], min_age=1).spared == 1 and store.has(cid)
    with pytest.raises(ValueError, match="min_age"):
        collect_garbage(store, [], min_age=-1)
