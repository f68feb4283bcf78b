"""Something other than a block file at a DirectoryStore path: never waited on, never followed."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tensorswap.cid import Cid
from tensorswap.errors import BlockNotFound, CorruptBlock, StoreError
from tensorswap.store import (
    DirectoryStore,
    collect_garbage,
)
from tensorswap.store.directory import FORMAT_LINE


# ── DirectoryStore: something other than a block file at a block's path ──────────
def _store_with_block(tmp_path: Path) -> tuple[DirectoryStore, Cid, bytes, str]:
    store = DirectoryStore(tmp_path / "store")
    data = b"block bytes " * 100
    cid = store.put(data)
    return store, cid, data, store.path_of(cid)


def _expect_not_a_block_then_repair(store: DirectoryStore, cid: Cid, data: bytes) -> None:
    assert not store.has(cid)
    assert cid not in list(store)
    with pytest.raises(BlockNotFound):
        store.size_of(cid)
    with pytest.raises(BlockNotFound):
        store.age_of(cid)
    with pytest.raises(CorruptBlock, match="not a regular file"):
        store.get(cid)
    assert not store.has(cid)
    assert store.put(data) == cid  # the block can be stored (fetched) again
    assert bytes(store.get(cid)) == data
    assert store.size().blocks == 1


@pytest.mark.timeout(10)  # a regression hangs in open(2); fail instead of waiting 120 s
def test_fifo_at_a_block_path_does_not_hang_reads(tmp_path: Path) -> None:
    # open(2) of a FIFO for reading waits for a writer: get() hung forever.
    store, cid, data, path = _store_with_block(tmp_path)
    os.unlink(path)
    os.mkfifo(path)
    _expect_not_a_block_then_repair(store, cid, data)


def test_directory_at_a_block_path_is_moved_aside(tmp_path: Path) -> None:
    # get() raised "cannot map ... No such device", size_of() gave the directory's size, and
    # every put() of the block failed (os.replace cannot replace a directory): never storable.
    store, cid, data, path = _store_with_block(tmp_path)
    os.unlink(path)
    os.mkdir(path)
    (Path(path) / "inner").write_bytes(b"x")
    # put first: it must move the directory aside by itself
    assert store.put(data) == cid
    assert bytes(store.get(cid)) == data
    os.unlink(path)
    os.mkdir(path)
    _expect_not_a_block_then_repair(store, cid, data)
    assert len(os.listdir(tmp_path / "store" / "quarantine")) == 2  # both kept, not deleted


def test_symlink_at_a_block_path_is_never_followed(tmp_path: Path) -> None:
    # The store writes regular files only, and its listings already skipped symlinks; but
    # has() and get() followed one (to anywhere), and put() of the block touched the target's
    # modification time outside the store and then trusted the link.
    store, cid, data, path = _store_with_block(tmp_path)
    outside = tmp_path / "outside"
    outside.write_bytes(data)  # the right bytes even
    os.utime(outside, (1_000_000, 1_000_000))
    os.unlink(path)
    os.symlink(outside, path)
    _expect_not_a_block_then_repair(store, cid, data)
    assert os.stat(outside).st_mtime == 1_000_000
    assert outside.read_bytes() == data
    os.unlink(path)
    os.symlink(outside, path)
    assert store.put(data) == cid
    assert not os.path.islink(path)
    assert os.stat(outside).st_mtime == 1_000_000


def test_directory_named_like_a_temp_file_does_not_break_collection(tmp_path: Path) -> None:
    # remove_temp_files unlinked every ".*.tmp" entry of a shard: a directory there made
    # collect_garbage fail with a raw IsADirectoryError after it had deleted the blocks.
    store, cid, data, path = _store_with_block(tmp_path)
    shard = os.path.dirname(path)
    odd = os.path.join(shard, ".odd.tmp")
    os.mkdir(odd)
    os.utime(odd, (1_000_000, 1_000_000))
    stale = os.path.join(shard, f".{cid}.0123.tmp")
    Path(stale).write_bytes(b"partial")
    os.utime(stale, (1_000_000, 1_000_000))
    result = collect_garbage(store, [cid])
    assert result.temp_files_removed == 1
    assert not os.path.exists(stale)
    assert os.path.isdir(odd)  # not ours to remove
    assert bytes(store.get(cid)) == data


def test_a_fresh_copy_written_while_a_corrupt_one_is_quarantined_stays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # get() finds the file corrupt and moves it aside; another process's put() may replace it
    # with a good copy between the identity check and the move. That copy (whose put had
    # returned) went to quarantine with the bad one: the stored block was lost.
    store, cid, data, path = _store_with_block(tmp_path)
    Path(path).write_bytes(b"short")  # truncated in place
    real_makedirs = os.makedirs

    def writer_races(name: Any, *args: Any, **kwargs: Any) -> None:  # runs inside the window
        fresh = path + ".other-process"
        Path(fresh).write_bytes(data)
        os.replace(fresh, path)
        real_makedirs(name, *args, **kwargs)

    monkeypatch.setattr(os, "makedirs", writer_races)
    with pytest.raises(CorruptBlock):
        store.get(cid)
    monkeypatch.setattr(os, "makedirs", real_makedirs)
    assert store.has(cid)
    assert bytes(store.get(cid)) == data


@pytest.mark.timeout(10)  # a regression hangs in open(2)
def test_fifo_as_format_file_is_refused_without_waiting(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "FORMAT")
    with pytest.raises(StoreError, match="not a tensorswap block store"):
        DirectoryStore(tmp_path)


def test_format_file_is_read_no_further_than_its_line(tmp_path: Path) -> None:
    # Any content other than the line is refused; the store reads one byte past it at most.
    with open(tmp_path / "FORMAT", "wb") as f:
        f.write(FORMAT_LINE)
        f.truncate(1 << 40)  # sparse: a 1 TiB FORMAT file read whole would exhaust memory
    with pytest.raises(StoreError, match="not a tensorswap block store"):
        DirectoryStore(tmp_path)
