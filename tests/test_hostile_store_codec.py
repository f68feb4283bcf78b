"""Hostile input to the codec and the block stores: small inputs that claimed far more work
or memory than they carry, files that are not what a block path should hold, and exceptions
that escaped untyped. Each test was seen failing before its fix."""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa
import pytest

from tensorswap.cid import Cid, Multicodec
from tensorswap.codec import decode_block
from tensorswap.codec.arrow import MAX_DECODED_VALUES
from tensorswap.codec.ipfrs import decode_ipfrs_gradient
from tensorswap.errors import BlockNotFound, CorruptBlock, MalformedBlock, StoreError
from tensorswap.store import (
    MANIFEST_MAGIC,
    DirectoryStore,
    MalformedManifest,
    MemoryStore,
    TensorManifest,
    collect_garbage,
    decode_manifest,
    encode_manifest,
    get_tensor,
)
from tensorswap.store.directory import FORMAT_LINE


def _stream(header: dict[str, Any], columns: dict[str, pa.Array], compression: Any) -> pa.Buffer:
    schema = pa.schema(
        [pa.field(name, arr.type, nullable=False) for name, arr in columns.items()],
        metadata={b"tensorswap.block": msgspec.json.encode(header)},
    )
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(
        sink, schema, options=pa.ipc.IpcWriteOptions(compression=compression)
    ) as writer:
        writer.write_batch(pa.record_batch(list(columns.values()), schema=schema))
    return sink.getvalue()


def _refuse_batch_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("pyarrow was asked to read (and decompress) the record batch")

    monkeypatch.setattr(pa.ipc, "read_record_batch", fail)


# ── codec: a compressed block with columns its encoding does not have ──────────
@pytest.mark.parametrize("compression", ["lz4", "zstd"])
def test_extra_compressed_columns_are_refused_before_decompression(
    compression: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The header justifies one column of 4096 float64 values (32 KiB). 64 more columns of
    # zeros compress to almost nothing, and pyarrow would decompress every one of them
    # (a 32 KB block of 200 such columns of 2**17 values made it allocate 210 MB).
    n = 4096
    header = {"v": 1, "kind": "tensor", "name": "", "dtype": "float64", "shape": [n]}
    zeros = pa.array(np.zeros(n))
    columns = {"values": zeros, **{f"x{i}": zeros for i in range(64)}}
    data = _stream(header, columns, compression)
    _refuse_batch_reads(monkeypatch)
    with pytest.raises(MalformedBlock, match="65 columns"):
        decode_block(data)


def test_wrongly_typed_compressed_column_is_refused_before_decompression(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    header = {"v": 1, "kind": "tensor", "name": "", "dtype": "float32", "shape": [64]}
    data = _stream(header, {"values": pa.array(np.zeros(64))}, "zstd")  # float64, not float32
    _refuse_batch_reads(monkeypatch)
    with pytest.raises(MalformedBlock, match="expected float"):
        decode_block(data)


# ── codec: an ipfrs gradient file with other columns ───────────────────────────
def test_ipfrs_decode_decompresses_only_the_value_column() -> None:
    # A foreign file may carry any columns besides `value`; pyarrow decompressed all of them
    # (a 373 KB file with 200 extra zstd columns of zeros took 211 MB for 512 KiB of values).
    # Here the extra column's compressed bytes are garbage: never decompressed, never seen.
    values = np.linspace(0, 1, 1000, dtype=np.float32)
    table = pa.table(
        {
            "index": pa.array(np.arange(values.size, dtype=np.int32)),
            "value": pa.array(values),
            "extra": pa.array(np.zeros(values.size)),  # float64: an 8000-byte buffer
        }
    )
    sink = pa.BufferOutputStream()
    options = pa.ipc.IpcWriteOptions(compression="zstd")
    with pa.ipc.new_file(sink, table.schema, options=options) as writer:
        writer.write_table(table)
    data = bytearray(sink.getvalue().to_pybytes())
    at = data.find(struct.pack("<q", 8000))  # the extra column's decompressed-size prefix
    assert at > 0
    data[at + 8 : at + 16] = b"\xff" * 8  # break its zstd frame
    np.testing.assert_array_equal(decode_ipfrs_gradient(bytes(data)), values)


# ── manifests: shapes no array can have ────────────────────────────────────────
@pytest.mark.parametrize("shape", [(0, 2**40, 2**40), (0, 2**63), (2**64 - 1, 0)])
def test_zero_size_shape_beyond_any_array_is_a_malformed_manifest(shape: tuple[int, ...]) -> None:
    # Zero values, so the chunk sum checks out, but numpy cannot make an array of this shape:
    # get_tensor let numpy's ValueError escape from reshape.
    store = MemoryStore()
    manifest = TensorManifest("w", "float32", shape, 0, "dense", "", (), {})
    data = MANIFEST_MAGIC + msgspec.msgpack.encode(manifest)
    with pytest.raises(MalformedManifest, match="shape"):
        decode_manifest(data)
    cid = store.put(data, codec=Multicodec.TENSORSWAP_MANIFEST)
    with pytest.raises(MalformedManifest):
        get_tensor(store, cid)


def test_zero_size_shape_past_the_load_limit_is_refused_on_load() -> None:
    store = MemoryStore()
    shape = (0, MAX_DECODED_VALUES + 1)  # a valid manifest, but beyond what a load builds
    manifest = TensorManifest("w", "float32", shape, 0, "dense", "", (), {})
    cid = store.put(encode_manifest(manifest), codec=Multicodec.TENSORSWAP_MANIFEST)
    with pytest.raises(MalformedManifest, match="exceeds"):
        get_tensor(store, cid)


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
