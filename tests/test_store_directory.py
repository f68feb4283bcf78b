"""DirectoryStore specifics: on-disk layout, corruption, atomicity, reopening."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from tensorswap.cid import Cid
from tensorswap.errors import CorruptBlock, StoreError
from tensorswap.store import DirectoryStore, MemoryStore, StoreSize
from tensorswap.store.directory import EMPTY_SHARD_AGE, FORMAT_LINE


def _flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def test_layout_is_sharded_by_digest(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path)
    cid = store.put(b"layout")
    d = cid.digest
    expected = tmp_path / "blocks" / f"{d[0]:02x}" / f"{d[1]:02x}" / str(cid)
    assert store.path_of(cid) == str(expected)
    assert expected.read_bytes() == b"layout"
    assert (tmp_path / "FORMAT").read_bytes() == FORMAT_LINE
    assert store.temp_files() == []


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "append"])
def test_corrupt_file_raises_naming_cid_and_path(tmp_path: Path, damage: str) -> None:
    store = DirectoryStore(tmp_path)
    cid = store.put(np.arange(1000, dtype=np.int32))
    path = store.path_of(cid)
    if damage == "flip":
        _flip_byte(path, 1234)
    elif damage == "append":
        with open(path, "ab") as f:
            f.write(b"\x00")
    else:
        os.truncate(path, 0 if damage == "empty" else 3999)
    with pytest.raises(CorruptBlock) as info:
        store.get(cid)
    err = info.value
    assert err.cid == cid and err.path == path
    assert str(cid) in str(err) and path in str(err)
    # quarantined: the store now reports the block missing, so it can be fetched again
    assert not store.has(cid)
    assert store.missing([cid]) == [cid]
    assert len(os.listdir(tmp_path / "quarantine")) == 1
    store.put(np.arange(1000, dtype=np.int32))
    assert np.array_equal(np.frombuffer(store.get(cid), np.int32), np.arange(1000))


def test_verification_can_be_turned_off(tmp_path: Path) -> None:
    trusting = DirectoryStore(tmp_path, verify_reads=False)
    cid = trusting.put(b"abcdef")
    _flip_byte(trusting.path_of(cid), 0)
    assert trusting.get(cid) == b"`bcdef"
    with pytest.raises(CorruptBlock):
        trusting.get(cid, verify=True)
    checking = DirectoryStore(tmp_path)
    cid2 = checking.put(b"ghijk")
    _flip_byte(checking.path_of(cid2), 0)
    assert checking.get(cid2, verify=False) == b"fhijk"
    with pytest.raises(CorruptBlock):
        checking.get(cid2)


def test_leftover_temp_file_is_invisible_and_cleaned(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path)
    kept = store.put(b"complete")
    # A crash between write and rename leaves only the temp file of the block.
    ghost = Cid.of(b"half written")
    path = store.path_of(ghost)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = os.path.join(os.path.dirname(path), f".{ghost}.deadbeef.tmp")
    with open(tmp, "wb") as f:
        f.write(b"half wri")
    assert not store.has(ghost)
    assert list(store) == [kept]
    assert store.size() == StoreSize(1, len(b"complete"))
    assert store.temp_files() == [tmp]
    assert store.remove_temp_files(older_than=3600) == 0  # might be a write in progress
    assert store.remove_temp_files(older_than=0) == 1
    assert store.temp_files() == []
    assert store.put(b"half written") == ghost
    assert store.get(ghost) == b"half written"


def test_failed_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = DirectoryStore(tmp_path)

    def fail(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(StoreError, match="No space left"):
        store.put(b"never lands")
    monkeypatch.undo()
    assert store.temp_files() == []
    assert store.size() == StoreSize(0, 0)


def test_reopen_reads_back(tmp_path: Path) -> None:
    payloads = [b"", b"one", np.arange(5000, dtype=np.float64).tobytes()]
    with DirectoryStore(tmp_path, fsync=True) as store:
        cids = [store.put(p) for p in payloads]
    reopened = DirectoryStore(tmp_path, create=False)
    assert sorted(reopened) == sorted(cids)
    for cid, payload in zip(cids, payloads, strict=True):
        assert reopened.get(cid) == payload


def test_refuses_foreign_or_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="create=False"):
        DirectoryStore(tmp_path / "nope", create=False)
    (tmp_path / "FORMAT").write_bytes(b"something else\n")
    with pytest.raises(StoreError, match="not a tensorswap block store"):
        DirectoryStore(tmp_path)


def test_foreign_files_are_ignored(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path)
    cid = store.put(b"real")
    shard = os.path.dirname(store.path_of(cid))
    Path(shard, "notes.txt").write_bytes(b"x")
    other = Cid.of(b"misplaced")
    Path(shard, str(other)).write_bytes(b"misplaced")  # wrong shard for its digest
    (tmp_path / "blocks" / "zz").mkdir()
    assert list(store) == [cid]


def test_view_outlives_delete(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path)
    arr = np.arange(100_000, dtype=np.float32)
    cid = store.put(arr)
    values = np.frombuffer(store.get(cid), dtype=np.float32)
    store.delete(cid)
    del store
    assert np.array_equal(values, arr)


def test_memory_store_adopts_without_copy_and_detects_broken_promise() -> None:
    store = MemoryStore()
    buf = bytearray(b"adopted")
    cid = store.put(buf, adopt=True)
    assert (
        np.frombuffer(store.get(cid), np.uint8).ctypes.data
        == np.frombuffer(buf, np.uint8).ctypes.data
    )
    buf[0] = ord("A")  # a caller breaking its promise
    with pytest.raises(CorruptBlock):
        store.get(cid, verify=True)


def test_a_repeated_put_rewrites_a_block_that_vanished_meanwhile(tmp_path: Path) -> None:
    """A put that finds the block held touches it; if a collection deletes the file between
    the check and the touch, the put writes it again instead of returning without it."""

    class Racing(DirectoryStore):
        race = False

        def fault_point(self, point: str, path: str) -> None:
            if point == "touch" and self.race:
                self.race = False
                os.unlink(path)  # a concurrent delete lands here

    store = Racing(tmp_path)
    cid = store.put(b"block")
    store.race = True
    assert store.put(b"block") == cid
    assert store.has(cid) and store.get(cid) == b"block"


def test_a_delete_leaves_its_shard_and_a_rescan_removes_it_once_long_empty(
    tmp_path: Path,
) -> None:
    store = DirectoryStore(tmp_path)
    cid = store.put(b"alone in its shard")
    shard = Path(store.path_of(cid)).parent
    assert store.delete(cid) and shard.is_dir()  # the next block there needs no mkdir
    assert store.inventory(rescan=True) == [] and shard.is_dir()  # emptied just now: kept
    old = time.time() - EMPTY_SHARD_AGE - 5
    os.utime(shard, (old, old))
    assert store.inventory(rescan=True) == [] and not shard.exists()
    assert shard.parent.is_dir()  # the first level stays (256 at most)
    assert store.put(b"alone in its shard") == cid and store.get(cid) == b"alone in its shard"


def test_a_rescan_never_removes_a_shard_holding_a_block(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path)
    cid = store.put(b"kept")
    shard = Path(store.path_of(cid)).parent
    old = time.time() - EMPTY_SHARD_AGE - 5
    os.utime(shard, (old, old))
    assert store.inventory(rescan=True) == [cid] and store.get(cid) == b"kept"


class Counted(DirectoryStore):
    """A directory store that counts its walks of the shards."""

    walks: list[int]

    def fault_point(self, point: str, path: str) -> None:
        if point == "walked":
            self.walks.append(1)


def test_the_inventory_follows_own_puts_and_deletes_without_a_walk(tmp_path: Path) -> None:
    store = Counted(tmp_path)
    before = store.put(b"before the first listing")
    store.walks = []
    assert store.inventory() == [before] and store.walks == [1]  # the first call walks
    store.walks = walks = []
    added = store.put(b"put later")
    assert store.put(b"put later") == added  # held already: still one entry
    assert store.delete(before)
    assert store.inventory() == [added] and walks == []
    other = DirectoryStore(tmp_path)  # another process, as far as this object knows
    foreign = other.put(b"from elsewhere")
    assert store.inventory() == [added]  # unseen until a walk
    assert sorted(store.inventory(rescan=True), key=str) == sorted([added, foreign], key=str)
    assert walks == [1]
    assert other.delete(foreign)
    assert foreign in store.inventory()  # a stale entry: harmless to a collection
    assert store.delete(foreign) is False and store.inventory() == [added]


def test_puts_and_deletes_during_a_rescan_are_kept_in_the_account(tmp_path: Path) -> None:
    late: list[Cid] = []

    class Racing(DirectoryStore):
        race = False

        def fault_point(self, point: str, path: str) -> None:
            if point == "walked" and self.race:  # the walk has seen the files...
                self.race = False
                late.append(self.put(b"put after the walk saw its shard"))  # ...then these
                self.delete(doomed)

    store = Racing(tmp_path)
    doomed = store.put(b"deleted while the walk runs")
    store.race = True
    assert store.inventory(rescan=True) == late and len(late) == 1
    assert store.inventory() == late == list(store)


def test_a_write_whose_shard_goes_meanwhile_makes_it_again(tmp_path: Path) -> None:
    """A rescan (a shard long empty) or another process may remove the shard between a
    writer's check of it and its file's creation; the writer makes it again."""
    gone: list[str] = []

    class ShardRemovedFirst(DirectoryStore):
        armed = False  # not for FORMAT, written as the store opens

        def fault_point(self, point: str, path: str) -> None:
            if point == "write" and self.armed and not gone:
                os.rmdir(os.path.dirname(path))  # as a rescan pruning it would
                gone.append(path)

    store = ShardRemovedFirst(tmp_path)
    store.armed = True
    cid = store.put(b"written anyway")
    assert gone and store.get(cid) == b"written anyway"


def test_an_account_past_its_limit_is_dropped_and_the_store_walked(tmp_path: Path) -> None:
    store = Counted(tmp_path, inventory_limit=2)
    first, second = store.put(b"one"), store.put(b"two")
    store.walks = []
    assert sorted(store.inventory(), key=str) == sorted([first, second], key=str)
    assert store.inventory() and store.walks == [1]  # the second call reads the account
    third = store.put(b"three")  # past the limit: no account kept
    assert sorted(store.inventory(), key=str) == sorted([first, second, third], key=str)
    assert store.walks == [1, 1]
    assert store.inventory() and store.walks == [1, 1, 1]  # the walk found too many to keep
    assert store.delete(third) and store.inventory() and store.walks == [1, 1, 1, 1]
    assert store.inventory() and store.walks == [1, 1, 1, 1]  # two: an account again
