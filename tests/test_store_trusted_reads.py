"""DirectoryStore(trust_own_writes=True): no re-hash of blocks it wrote, unless they changed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tensorswap.cid import Cid
from tensorswap.errors import CorruptBlock
from tensorswap.store import DirectoryStore

DATA = bytes(range(256)) * 1024


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> list[Cid]:
    """Every CID whose bytes a read re-hashes."""
    seen: list[Cid] = []
    original = Cid.matches

    def spy(self: Cid, data: object) -> bool:
        seen.append(self)
        return original(self, data)  # type: ignore[arg-type]

    monkeypatch.setattr(Cid, "matches", spy)
    return seen


def test_a_block_this_store_wrote_is_read_without_rehashing(
    tmp_path: Path, hashed: list[Cid]
) -> None:
    store = DirectoryStore(tmp_path, trust_own_writes=True)
    cid = store.put(DATA)
    assert bytes(store.get(cid)) == DATA
    assert hashed == []
    store.get(cid, verify=True)  # an explicit request still hashes
    assert hashed == [cid]


def test_blocks_of_other_writers_and_of_earlier_runs_are_rehashed(
    tmp_path: Path, hashed: list[Cid]
) -> None:
    cid = DirectoryStore(tmp_path, trust_own_writes=True).put(DATA)
    reopened = DirectoryStore(tmp_path, trust_own_writes=True)
    reopened.get(cid)
    assert hashed == [cid]
    assert reopened.put(DATA) == cid  # already held: not written, so still not trusted
    reopened.get(cid)
    assert hashed == [cid, cid]


def test_a_file_changed_behind_the_store_is_rehashed_and_caught(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path, trust_own_writes=True)
    cid = store.put(DATA)
    path = store.path_of(cid)
    damaged = bytearray(DATA)
    damaged[7] ^= 1
    os.unlink(path)
    Path(path).write_bytes(bytes(damaged))  # another file now (inode, mtime differ)
    with pytest.raises(CorruptBlock):
        store.get(cid)


def test_without_the_option_every_read_rehashes(tmp_path: Path, hashed: list[Cid]) -> None:
    store = DirectoryStore(tmp_path)
    cid = store.put(DATA)
    store.get(cid)
    assert hashed == [cid]


def test_a_touched_block_is_rehashed_and_a_file_changed_before_is_caught(
    tmp_path: Path, hashed: list[Cid]
) -> None:
    store = DirectoryStore(tmp_path, trust_own_writes=True)
    cid = store.put(DATA)
    store.touch([cid])  # nothing proves the file unchanged across the new time: no more trust
    store.get(cid)
    assert hashed == [cid]
    other = store.put(DATA[::-1])
    assert store.put(DATA[::-1]) == other  # a repeated put touches as well
    store.get(other)
    assert hashed == [cid, other]
    path = store.path_of(cid)
    with open(path, "r+b") as file:  # same size, one bit flipped, behind the store's back
        file.seek(3)
        file.write(bytes([DATA[3] ^ 1]))
    # a write within the clock's granularity may keep the modification time: make it differ
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns - 10**9))
    store.touch([cid])  # the touch must not bless the damaged file
    with pytest.raises(CorruptBlock):
        store.get(cid)


def test_a_file_rewritten_in_place_with_its_mtime_restored_is_rehashed(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path, trust_own_writes=True)
    cid = store.put(DATA)
    path = store.path_of(cid)
    before = os.stat(path)
    with open(path, "r+b") as f:  # same inode, same size
        f.seek(4096)
        f.write(b"\xff" * 4096)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    with pytest.raises(CorruptBlock):
        store.get(cid)
    assert not store.has(cid)  # quarantined
