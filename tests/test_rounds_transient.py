"""A full disk while the aggregate is stored keeps the round Aggregating, its status naming the
reason, retried with backoff until it succeeds or its time runs out (issue 12, fault 3)."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tensorswap.cid import Cid
from tensorswap.rounds import Coordinator, FakeClock, RoundDatabase
from tensorswap.rounds.core import Aggregating, Complete, Failed, RoundId, RoundSpec
from tensorswap.rounds.engine.retry import RetryPolicy, transient_cause
from tensorswap.store import DirectoryStore, ModelUpdate, get_update, put_update

RID = RoundId(1, "lead")
SIZE = 1 << 18  # 1 MiB of float32


class FlakyDisk(DirectoryStore):
    """A directory store whose writes fail with ENOSPC while ``full`` is set."""

    full = False

    def fault_point(self, point: str, path: str) -> None:
        if point == "write" and self.full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


class Watch:
    """Status changes of RID, seen from the coordinator's listener (no polling, no sleeps)."""

    def __init__(self, coord: Coordinator) -> None:
        self._cond = threading.Condition()
        self.seen: list[object] = []
        coord.subscribe(self._on)

    def _on(self, rid: RoundId, status: object) -> None:
        if rid == RID:
            with self._cond:
                self.seen.append(status)
                self._cond.notify_all()

    def retrying(self, count: int = 1) -> Aggregating:
        """The ``count``-th Aggregating status with a reason."""
        with self._cond:
            assert self._cond.wait_for(lambda: len(self._retrying()) >= count, timeout=60)
            return self._retrying()[count - 1]

    def _retrying(self) -> list[Aggregating]:
        return [s for s in self.seen if isinstance(s, Aggregating) and s.reason]


def _updates(store: DirectoryStore) -> list[Cid]:
    return [put_update(store, ModelUpdate({"w": np.full(SIZE, v, np.float32)}, 1)) for v in (1, 3)]


def test_transient_causes_are_recognised() -> None:
    try:
        raise RuntimeError("storing") from OSError(errno.ENOSPC, "full")
    except RuntimeError as exc:
        assert "ENOSPC" in (transient_cause(exc) or "")
    assert transient_cause(OSError(errno.EIO, "io")) is not None
    assert transient_cause(OSError(errno.EACCES, "denied")) is None
    assert transient_cause(ValueError("x")) is None


def test_a_full_disk_keeps_the_round_aggregating_until_space_returns(tmp_path: Path) -> None:
    clock = FakeClock()
    store = FlakyDisk(tmp_path / "blocks", trust_own_writes=True)
    journal = RoundDatabase(tmp_path / "rounds.sqlite3")
    with Coordinator(store, journal=journal, clock=clock, owns=True) as coord:
        watch = Watch(coord)
        coord.start_round(RID, RoundSpec(2, timeout_s=60))
        a, b = _updates(store)
        store.full = True
        coord.submit(RID, "a", a)
        coord.submit(RID, "b", b)
        first = watch.retrying()
        assert "No space left on device" in first.reason and "ENOSPC" in first.reason
        status = coord.status(RID)
        assert isinstance(status, Aggregating) and status.reason == first.reason
        assert status.to_dict()["reason"] == first.reason  # what `status` shows
        clock.advance(1.0)  # the retry is due; the disk is still full
        second = watch.retrying(2)
        assert "attempt 2 failed" in second.reason
        store.full = False
        clock.advance(5.0)
        done = coord.wait(RID, timeout=60)
        assert isinstance(done, Complete)
        values = get_update(store, Cid.parse(done.cid)).tensors["w"]
        np.testing.assert_array_equal(values, np.full(SIZE, 2.0, np.float32))
        assert len(coord.contributions(RID)) == 2
        assert coord.stats().aggregation_retries == 2


def test_retries_stop_at_the_deadline_and_the_round_fails_with_the_reason(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    store = FlakyDisk(tmp_path / "blocks")
    policy = RetryPolicy(first=1.0, window=10.0)
    with Coordinator(store, clock=clock, retry=policy) as coord:
        watch = Watch(coord)
        coord.start_round(RID, RoundSpec(1, timeout_s=30))
        (a, _) = _updates(store)
        store.full = True
        coord.submit(RID, "a", a)
        watch.retrying()
        clock.advance(31.0)  # past the round's deadline (later than the retry window)
        done = coord.wait(RID, timeout=60)
        assert isinstance(done, Failed)
        assert "aggregation failed" in done.reason and "No space left" in done.reason


@contextlib.contextmanager
def _tmpfs(where: Path, size: str) -> Iterator[Path]:
    where.mkdir()
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
            check=True,
            capture_output=True,
        )
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {exc}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False, capture_output=True)


def _fill(directory: Path) -> Path:
    """A file that takes all the space left on ``directory``'s file system."""
    filler = directory / "filler"
    chunk = b"\0" * (1 << 16)
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(chunk)
                f.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return filler


@pytest.mark.skipif(shutil.which("mount") is None, reason="no mount command")
def test_enospc_on_a_small_tmpfs_is_retried_after_space_is_freed(tmp_path: Path) -> None:
    clock = FakeClock()
    with _tmpfs(tmp_path / "disk", "6m") as disk:
        store = DirectoryStore(disk / "blocks", trust_own_writes=True)
        journal = RoundDatabase(tmp_path / "rounds.sqlite3")  # on the big disk: the journal fits
        with Coordinator(store, journal=journal, clock=clock, owns=True) as coord:
            watch = Watch(coord)
            coord.start_round(RID, RoundSpec(2, timeout_s=60))
            a, b = _updates(store)
            filler = _fill(disk)
            coord.submit(RID, "a", a)
            coord.submit(RID, "b", b)
            assert "No space left on device" in watch.retrying().reason
            filler.unlink()
            clock.advance(1.0)
            done = coord.wait(RID, timeout=60)
            assert isinstance(done, Complete), done
            values = get_update(store, Cid.parse(done.cid)).tensors["w"]
            np.testing.assert_array_equal(values, np.full(SIZE, 2.0, np.float32))
