"""DirectoryStore's direct I/O of large blocks (store/_direct.py): exact bytes either way,
the page cache left out where the file system allows it, and a clean fallback where not."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tensorswap._pool import receive_buffers
from tensorswap.cid import Cid
from tensorswap.errors import CorruptBlock
from tensorswap.store import DirectoryStore
from tensorswap.store._direct import DIRECT_MIN_BYTES

# sizes around the 4 KiB alignment and the 4 MiB staging step: aligned, a partial last page,
# one byte past a step
SIZES = [DIRECT_MIN_BYTES, DIRECT_MIN_BYTES + 123, (4 << 20) + 1, (9 << 20) - 4095]


def payload(nbytes: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def direct_works(tmp_path: Path) -> bool:
    """Whether this test's file system takes O_DIRECT (tmpfs does not)."""
    store = DirectoryStore(tmp_path / "probe")
    store.put(payload(DIRECT_MIN_BYTES))
    return store.direct.supported


@pytest.mark.parametrize("nbytes", SIZES)
def test_large_blocks_round_trip_exactly(tmp_path: Path, nbytes: int) -> None:
    data = payload(nbytes)
    store = DirectoryStore(tmp_path / "s")
    cid = store.put(data)
    assert os.path.getsize(store.path_of(cid)) == nbytes
    view = store.get(cid)
    assert view.readonly and view.nbytes == nbytes
    assert bytes(view) == data
    assert Path(store.path_of(cid)).read_bytes() == data  # what another process reads
    if store.direct.supported:
        assert (store.direct.writes, store.direct.reads) == (1, 1)


def test_a_page_aligned_buffer_is_written_from_where_it_lies(tmp_path: Path) -> None:
    data = payload((2 << 20) + 77, seed=1)
    slab = receive_buffers().take(len(data))  # what the wire receives a payload into
    slab[:] = data
    store = DirectoryStore(tmp_path / "s")
    cid = store.put(slab, adopt=True)
    assert bytes(store.get(cid)) == data
    other = DirectoryStore(tmp_path / "t")  # an unaligned source goes through the stage
    unaligned = memoryview(b"x" + data)[1:]
    assert other.put(unaligned) == cid
    assert Path(other.path_of(cid)).read_bytes() == data


def test_small_blocks_stay_buffered(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path / "s")
    cid = store.put(payload(DIRECT_MIN_BYTES - 1))
    assert bytes(store.get(cid)) == payload(DIRECT_MIN_BYTES - 1)
    assert (store.direct.writes, store.direct.reads) == (0, 0)


def test_direct_io_can_be_turned_off(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path / "s", direct_io=False)
    data = payload(DIRECT_MIN_BYTES + 5)
    cid = store.put(data)
    assert bytes(store.get(cid)) == data
    assert not store.direct.supported and store.direct.writes == 0


def _refuse_direct(monkeypatch: pytest.MonkeyPatch) -> None:
    real = fcntl.fcntl

    def fake(fd: int, cmd: int, arg: Any = 0) -> Any:
        if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, cmd, arg)

    monkeypatch.setattr(fcntl, "fcntl", fake)


def test_a_file_system_that_refuses_o_direct_gets_buffered_io(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _refuse_direct(monkeypatch)
    store = DirectoryStore(tmp_path / "s")
    data = payload(DIRECT_MIN_BYTES + 9)
    cid = store.put(data)
    assert not store.direct.supported
    assert bytes(store.get(cid)) == data and store.direct.writes == 0


def test_a_direct_write_refused_midway_is_written_again_buffered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = os.pwrite
    refused: list[int] = []

    def fake(fd: int, data: Any, offset: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT and offset > 0:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", fake)
    store = DirectoryStore(tmp_path / "s")
    data = payload((8 << 20) + 3)
    cid = store.put(data)
    monkeypatch.setattr(os, "pwrite", real)
    assert Path(store.path_of(cid)).read_bytes() == data
    assert bytes(store.get(cid)) == data
    assert not store.direct.supported
    assert refused or not direct_works(tmp_path)


def test_damage_to_a_directly_read_block_is_caught_and_quarantined(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path / "s")
    data = payload(DIRECT_MIN_BYTES * 2)
    cid = store.put(data)
    path = store.path_of(cid)
    with open(path, "r+b") as f:  # through the page cache: a direct read must still see it
        f.seek(DIRECT_MIN_BYTES + 1)
        f.write(b"\xff\x00\xff")
    with pytest.raises(CorruptBlock) as caught:
        store.get(cid)
    assert str(cid) in str(caught.value)
    assert not store.has(cid) and not os.path.exists(path)
    assert store.put(data) == cid  # put again after the quarantine
    assert Cid.of(store.get(cid)) == cid
