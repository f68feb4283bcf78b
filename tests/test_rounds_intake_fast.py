"""The intake's fast paths for tiny contributions: one journal write per batch (one failing
row refuses itself only), inline blocks screened from memory, small chunks decoded through
their remembered layout. Each gives what the slow path gives."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import numpy as np
import pytest

from tensorswap.cid import Cid
from tensorswap.errors import BlockNotFound, RoundsError
from tensorswap.rounds.core import Collecting, Complete, Contribution, RoundId, RoundSpec
from tensorswap.rounds.engine import Coordinator
from tensorswap.rounds.engine._chunks import ChunkDecoder
from tensorswap.rounds.engine.fold import CHUNKS
from tensorswap.rounds.journal import RoundDatabase
from tensorswap.rounds.protocol.inline import intake_batch
from tensorswap.rounds.server._queue import IntakeQueue
from tensorswap.rounds.storage._fresh import FreshBlocks
from tensorswap.store import (
    MemoryStore,
    ModelUpdate,
    decode_chunk,
    get_update,
    manifest_closure,
    put_update,
    read_manifest,
)
from tensorswap.store.manifest import TensorManifest, UpdateManifest

RID = RoundId(3, "fast")


def _blocks(update: ModelUpdate) -> tuple[Cid, list[tuple[Cid, bytes]]]:
    store = MemoryStore()
    cid = put_update(store, update)
    return cid, [(c, bytes(store.get(c))) for c in reversed(manifest_closure(store, cid))]


def test_a_batch_is_one_journal_write_and_a_failing_row_refuses_only_itself(
    tmp_path: Path,
) -> None:
    with Coordinator.open(tmp_path, run_timer=False) as coord:
        coord.start_round(RID, RoundSpec(4))
        journal = coord.journal
        assert isinstance(journal, RoundDatabase)

        def row(peer: str, seq: int) -> tuple[Contribution, Collecting, None, int]:
            return Contribution(RID, peer, f"bafk{peer}", 1, 4, 0.0), Collecting(seq, 4), None, seq

        before = journal.commits
        assert journal.add_contributions([row("a", 1), row("b", 2)]) == [None, None]
        assert journal.commits[1] - before[1] == 1  # the two rows in one write
        errors = journal.add_contributions([row("c", 3), row("a", 4), row("d", 4)])
        assert errors[0] is None and errors[2] is None
        assert isinstance(errors[1], RoundsError)  # the duplicate row, alone
    with RoundDatabase.in_dir(tmp_path) as again:
        ((info, rows),) = again.load()
        assert [c.peer for c in rows] == ["a", "b", "c", "d"]
        assert info.status == Collecting(4, 4)


def test_fresh_blocks_answer_from_memory_and_fall_through_to_the_store() -> None:
    below = MemoryStore()
    held = below.put(b"below")
    fresh_cid = Cid.of(b"fresh")
    view = FreshBlocks(below, {fresh_cid: b"fresh"})
    assert bytes(view.get(fresh_cid, verify=True)) == b"fresh"
    assert view.get(fresh_cid).readonly
    assert bytes(view.get(held)) == b"below"
    assert view.has(fresh_cid) and view.has(held)
    assert view.size_of(fresh_cid) == 5
    gone = Cid.of(b"gone")
    assert view.missing([fresh_cid, held, gone]) == [gone]
    with pytest.raises(BlockNotFound):
        view.get(gone)
    assert list(view) == [held]  # listing is the store's: fresh bytes are not stored by it


def test_inline_blocks_are_stored_and_screened_to_the_same_aggregate(tmp_path: Path) -> None:
    updates = [ModelUpdate({"w": np.arange(16, dtype=np.float32) * k}, k) for k in (1, 2, 3)]
    with Coordinator.open(tmp_path, run_timer=False) as coord:
        coord.start_round(RID, RoundSpec(3))
        items = []
        for k, update in enumerate(updates):
            cid, blocks = _blocks(update)
            items.append((f"p{k}", cid, blocks))
        outcomes = intake_batch(coord, RID, items)
        assert outcomes == [Collecting(1, 3), Collecting(2, 3), Collecting(3, 3)]
        for _, _, blocks in items:  # in the coordinator's own store, not only in memory
            assert coord.store.missing([c for c, _ in blocks]) == []
        done = coord.wait(RID, timeout=30)
        assert isinstance(done, Complete)
        result = get_update(coord.store, Cid.parse(done.cid)).tensors["w"]
    want = sum(u.tensors["w"] * u.num_samples for u in updates) / 6
    np.testing.assert_allclose(result, want, rtol=1e-6)


def _tensor(store: MemoryStore, values: np.ndarray, **kwargs: object) -> TensorManifest:
    update = read_manifest(store, put_update(store, ModelUpdate({"w": values}, 1), **kwargs))
    assert isinstance(update, UpdateManifest)
    tensor = read_manifest(store, update.tensors[0].cid)
    assert isinstance(tensor, TensorManifest)
    return tensor


def test_a_remembered_layout_decodes_exactly_what_the_full_decode_does() -> None:
    store, decoder = MemoryStore(), ChunkDecoder()
    rng = np.random.default_rng(0)
    for k in range(4):
        values = rng.standard_normal(16).astype(np.float32)
        tensor = _tensor(store, values)
        buf = store.get(tensor.chunks[0].cid)
        got = decoder.decode(buf, tensor, 0)
        np.testing.assert_array_equal(got, decode_chunk(buf, tensor, 0))
        np.testing.assert_array_equal(got, values)
        assert decoder.hits == k  # the first one learnt the layout
    assert CHUNKS is not decoder


def _outcome(decode: object, buf: memoryview, tensor: TensorManifest) -> object:
    try:
        return decode(buf, tensor, 0).tolist()  # type: ignore[operator]
    except Exception as exc:
        return type(exc)


@pytest.mark.parametrize("at", [12, 40, 200, -3])
def test_a_chunk_that_differs_outside_its_values_takes_the_full_decode(at: int) -> None:
    store, decoder = MemoryStore(), ChunkDecoder()
    tensor = _tensor(store, np.ones(16, np.float32))
    decoder.decode(store.get(tensor.chunks[0].cid), tensor, 0)
    forged = bytearray(store.get(tensor.chunks[0].cid))
    forged[at] ^= 0xFF  # in the Arrow messages or the end-of-stream marker, not the values
    buf = memoryview(bytes(forged))
    assert _outcome(decoder.decode, buf, tensor) == _outcome(decode_chunk, buf, tensor)
    assert decoder.hits == 0


def test_compressed_chunks_are_never_remembered() -> None:
    store, decoder = MemoryStore(), ChunkDecoder()
    values = np.zeros(4096, np.float32)
    tensor = _tensor(store, values, compression="zstd")
    for _ in range(2):
        buf = store.get(tensor.chunks[0].cid)
        np.testing.assert_array_equal(decoder.decode(buf, tensor, 0), values)
    assert decoder.hits == 0


async def test_the_next_batch_screens_while_the_one_before_commits(tmp_path: Path) -> None:
    armed, committing, release = threading.Event(), threading.Event(), threading.Event()

    def before_commit() -> None:
        if armed.is_set() and not committing.is_set():
            committing.set()
            release.wait(30)

    journal = RoundDatabase(tmp_path / "rounds.sqlite3", before_commit=before_commit)
    second_queued = threading.Event()
    journal._group.on_queue = lambda n: second_queued.set() if committing.is_set() else None
    with Coordinator(MemoryStore(), journal=journal, run_timer=False, owns=True) as coord:
        coord.start_round(RID, RoundSpec(3))
        queue = IntakeQueue(coord)
        armed.set()
        try:
            first = asyncio.ensure_future(queue.submit(RID, "a", *_blocks(_tiny(1.0))))
            assert await asyncio.to_thread(committing.wait, 30)
            second = asyncio.ensure_future(queue.submit(RID, "b", *_blocks(_tiny(2.0))))
            # b was screened and its journal write queued while a's commit still runs
            assert await asyncio.to_thread(second_queued.wait, 30)
            assert not first.done()
        finally:
            release.set()
        assert await first == Collecting(1, 3)
        assert await second == Collecting(2, 3)
        await queue.aclose()
        assert [c.peer for c in coord.contributions(RID)] == ["a", "b"]


def _tiny(value: float) -> ModelUpdate:
    return ModelUpdate({"w": np.full(16, value, np.float32)}, 1)
