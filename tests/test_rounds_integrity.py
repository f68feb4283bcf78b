"""No unverified bytes in an aggregate: a block damaged on disk after it was accepted is caught
on the read that feeds the aggregate, quarantined, and its contribution dropped (recorded) or
refused; never folded in (issue 12, fault 2)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from helpers.net import running
from tensorswap.cid import Cid
from tensorswap.rounds import Coordinator, FakeClock, RoundDatabase
from tensorswap.rounds.core import Complete, Failed, RoundId, RoundSpec, UnknownUpdate
from tensorswap.store import DirectoryStore, ModelUpdate, get_update, put_update
from tensorswap.store.manifest import TensorManifest, UpdateManifest, read_manifest

RID = RoundId(1, "lead")
SIZE = 1 << 18  # 1 MiB of float32 per contribution: one chunk


def _update(store: DirectoryStore, value: float, samples: int = 10) -> Cid:
    values = {"w": np.full(SIZE, value, dtype=np.float32)}
    return put_update(store, ModelUpdate(values, samples))


def _chunk_path(store: DirectoryStore, update: Cid) -> str:
    manifest = read_manifest(store, update)
    assert isinstance(manifest, UpdateManifest)
    tensor = read_manifest(store, manifest.tensors[0].cid)
    assert isinstance(tensor, TensorManifest)
    return store.path_of(tensor.chunks[0].cid)


def _damage(path: str) -> None:
    """Overwrite 4 KB in the middle of the file in place with huge floats, restore its mtime."""
    before = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(before.st_size // 2)
        f.write(np.full(1024, 3e38, dtype=np.float32).tobytes())
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def _open(root: Path, clock: FakeClock) -> Coordinator:
    return Coordinator(
        DirectoryStore(root / "blocks", trust_own_writes=True),
        journal=RoundDatabase(root / "rounds.sqlite3"),
        clock=clock,
        owns=True,
    )


@pytest.mark.parametrize("strategy", ["median", "trimmed_mean", "fedavg"])
def test_a_block_damaged_after_acceptance_is_dropped_not_aggregated(
    tmp_path: Path, strategy: str
) -> None:
    params = {"trim_fraction": 0.2} if strategy == "trimmed_mean" else {}
    clock = FakeClock()
    coord = _open(tmp_path, clock)
    try:
        spec = RoundSpec(3, quorum=1, timeout_s=60, strategy=strategy, params=params)
        coord.start_round(RID, spec)
        cids = {peer: _update(coord.store, v) for peer, v in [("a", 1.0), ("b", 2.0)]}
        for peer, cid in cids.items():
            coord.submit(RID, peer, cid)
        if strategy == "fedavg":
            # folded at submit time (verified then): restart so the aggregate reads them again
            coord.close()
            coord = _open(tmp_path, clock)
        damaged = _chunk_path(coord.store, cids["b"])  # type: ignore[arg-type]
        _damage(damaged)
        clock.advance(61)  # deadline at quorum: aggregate what is there
        status = coord.wait(RID, timeout=60)
        assert isinstance(status, Complete), status
        result = get_update(coord.store, Cid.parse(status.cid)).tensors["w"]
        np.testing.assert_array_equal(result, np.full(SIZE, 1.0, dtype=np.float32))  # a's alone
        info = coord.info(RID)
        assert info is not None
        assert [peer for peer, _ in info.dropped] == ["b"]
        reason = dict(info.dropped)["b"]
        assert "corrupt block" in reason and Path(damaged).name in reason
        assert not os.path.exists(damaged)  # quarantined
        assert os.listdir(tmp_path / "blocks" / "quarantine")
        assert coord.stats().contributions_dropped == 1
    finally:
        coord.close()
    # the drop is journaled: a restarted coordinator still names it
    again = _open(tmp_path, clock)
    try:
        info = again.info(RID)
        assert info is not None and [peer for peer, _ in info.dropped] == ["b"]
    finally:
        again.close()


def test_too_few_readable_contributions_fail_the_round_naming_the_block(tmp_path: Path) -> None:
    clock = FakeClock()
    with _open(tmp_path, clock) as coord:
        coord.start_round(RID, RoundSpec(3, quorum=2, timeout_s=60, strategy="median"))
        a, b = _update(coord.store, 1.0), _update(coord.store, 2.0)  # type: ignore[arg-type]
        coord.submit(RID, "a", a)
        coord.submit(RID, "b", b)
        damaged = _chunk_path(coord.store, b)  # type: ignore[arg-type]
        _damage(damaged)
        clock.advance(61)
        status = coord.wait(RID, timeout=60)
        assert isinstance(status, Failed)
        assert "peer 'b'" in status.reason and Path(damaged).name in status.reason
        assert "quorum 2" in status.reason


def test_a_block_damaged_before_submit_is_refused_and_can_be_pushed_again(
    tmp_path: Path,
) -> None:
    with _open(tmp_path, FakeClock()) as coord:
        store = coord.store
        assert isinstance(store, DirectoryStore)
        coord.start_round(RID, RoundSpec(1))
        cid = _update(store, 1.0)
        path = _chunk_path(store, cid)
        _damage(path)
        with pytest.raises(UnknownUpdate, match="push it again"):
            coord.submit(RID, "a", cid)
        assert not os.path.exists(path)  # quarantined: the store lacks it, so a push sends it
        assert _update(store, 1.0) == cid  # the peer's retry puts the block again
        coord.submit(RID, "a", cid)
        status = coord.wait(RID, timeout=60)
        assert isinstance(status, Complete)
        result = get_update(store, Cid.parse(status.cid)).tensors["w"]
        np.testing.assert_array_equal(result, np.full(SIZE, 1.0, dtype=np.float32))


def test_status_shows_the_dropped_contribution_and_a_retry_reason() -> None:
    from rich.console import Console

    from tensorswap.cli.status_cmd import render
    from tensorswap.rounds.client import ServerStatus
    from tensorswap.rounds.core import Aggregating, RoundInfo
    from tensorswap.rounds.protocol.codec import RoundAnswer, decode_answer, encode_answer, row_of

    why = "unreadable: corrupt block bafkxyz (quarantined)"
    info = RoundInfo(
        RID, RoundSpec(2), Aggregating("retrying in 1.0 s: No space left on device"),
        ("a", "b"), 10, 0.0, None, None, (("b", why),),
    )  # fmt: skip
    row = decode_answer(encode_answer(RoundAnswer(rounds=[row_of(info)]))).rounds
    assert row is not None and row[0].dropped == [("b", why)]
    console = Console(width=200, record=True)
    render(ServerStatus(row, {}), console, now=0.0)
    text = console.export_text()
    assert "dropped b: unreadable: corrupt block bafkxyz" in text
    assert "Aggregating retrying in 1.0 s: No space left on device" in text


async def test_a_client_pushes_again_a_block_the_coordinator_quarantined(tmp_path: Path) -> None:
    from tensorswap.rounds.client import RoundClient
    from tensorswap.rounds.core import Collecting
    from tensorswap.rounds.server import RoundServer

    key = b"integrity-key"
    with Coordinator.open(tmp_path, clock=FakeClock(), run_timer=False, durable=False) as coord:
        async with (
            running(RoundServer(coord, key=key)) as server,
            await RoundClient.connect("127.0.0.1", server.port, peer="a", key=key) as client,
        ):
            first, second = RoundId(1, "lead"), RoundId(2, "lead")
            for rid in (first, second):
                await client.start_round(rid, RoundSpec(2))
            values = {"w": np.full(SIZE, 1.0, np.float32)}
            done = await client.submit(first, values, 5)
            assert done.push.sent_blocks >= 1
            store = coord.store
            assert isinstance(store, DirectoryStore)
            _damage(_chunk_path(store, done.cid))  # the coordinator's copy rots on its disk
            again = await client.submit(second, values, 5)  # the same update, already "held"
            assert again.cid == done.cid
            assert again.push.sent_blocks == 1  # the quarantined chunk, pushed again
            assert isinstance(again.status, Collecting)
