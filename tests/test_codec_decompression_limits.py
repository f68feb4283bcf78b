"""Compressed columns a block or ipfrs file should not have are never decompressed."""

from __future__ import annotations

import struct
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa
import pytest

from tensorswap.codec import decode_block
from tensorswap.codec.ipfrs import decode_ipfrs_gradient
from tensorswap.errors import MalformedBlock


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
