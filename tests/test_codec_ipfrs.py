"""The ipfrs gradient Arrow IPC file: arrow-rs's exact bytes out, any writer's file in."""

from __future__ import annotations

import contextlib
import hashlib
import io
import struct
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorswap.codec.garw import FieldOverflow, GarwBlock
from tensorswap.codec.ipfrs import (
    MissingValueColumn,
    ValueColumnNotFloat32,
    decode_ipfrs_gradient,
    encode_ipfrs_gradient,
    encode_ipfrs_gradient_into,
    ipfrs_gradient_size,
    is_ipfrs_gradient_file,
    write_ipfrs_gradient,
)
from tensorswap.errors import CodecError, InvalidMagic, MalformedBlock, UnsupportedDtype

SPECIAL_BITS = [0x7FC00000, 0x7F800000, 0xFF800000, 0x80000000, 0x00800000, 0x7FC00001, 0xFFBFFFFF]

# SHA-256 of the files written by a Rust program that replays arrow-rs 57.3.1
# FileWriter::try_new + write + finish for ipfrs's schema, built from the flatbuffers 25.2.10
# Rust runtime and arrow-ipc 57.3.1's generated flatbuffer code (sizes in bytes).
RUST_GOLDEN = {
    "empty": (770, "fa611d73e812c4d22d913ea01bc14ea4357e2eae96657362ea328b4ac64681cb"),
    "one": (1026, "c4ea0e4fae51c9e47117c867aecbf94c6eed154eae3ffbcceca7b3d97c9610a3"),
    "three": (1026, "968e6374b9b8187b1019e635d7cfcd03588b7f4b2af98dc28666d260ba91e362"),
    "eight": (1026, "791e25a58372004236b4f57635f77e76a971ad5e8fbbf796971850e5361e8646"),
    "nine": (1026, "3376d3f0d36f2ec1253ae0184b87fe154051459c3afd3455258713b3291e97e8"),
    "seventeen": (1154, "3173142d535f19b553ff4b9a6e8acc2251f357a45babcaf186e8ecc5f126847d"),
    "thousand": (9090, "702332724b3cbf25d5cc15d797624d60f252af38c69c355068eecd4874d8df06"),
    "special": (1026, "d06cfcde1b8b2695e302b0b67d544a97b056754e5cd7dca8da6e07d631b7ddbf"),
}


def golden_values(name: str) -> np.ndarray:
    f = np.float32
    return {
        "empty": np.array([], f),
        "one": np.array([1.5], f),
        "three": np.array([0.5, -1.0, 2.25], f),
        "eight": np.arange(8, dtype=f) * f(0.25),
        "nine": np.arange(9, dtype=f) - f(4),
        "seventeen": np.sqrt(np.arange(17, dtype=f)),
        "thousand": np.arange(1000, dtype=np.uint32).astype(f) * f(0.001),
        "special": np.array(SPECIAL_BITS, np.uint32).view(f),
    }[name]


SCHEMA = pa.schema([pa.field("index", pa.int32(), False), pa.field("value", pa.float32(), False)])


def pyarrow_file(*batches: pa.RecordBatch, schema: pa.Schema = SCHEMA) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, schema) as writer:
        for batch in batches:
            writer.write_batch(batch)
    return bytes(sink.getvalue())


def batch(values: list[float | None], schema: pa.Schema = SCHEMA) -> pa.RecordBatch:
    index = pa.array(range(len(values)), pa.int32())
    return pa.record_batch([index, pa.array(values, schema.field(1).type)], schema=schema)


def bits(values: np.ndarray) -> list[int]:
    return np.ascontiguousarray(values, "<f4").view("<u4").tolist()


# ── writing: the bytes of arrow-rs ───────────────────────────────────────────
@pytest.mark.parametrize("name", sorted(RUST_GOLDEN))
def test_bytes_equal_the_rust_writer(name: str) -> None:
    size, digest = RUST_GOLDEN[name]
    data = encode_ipfrs_gradient(golden_values(name))
    assert len(data) == size == ipfrs_gradient_size(golden_values(name).size)
    assert hashlib.sha256(data).hexdigest() == digest


def test_layout_of_a_three_value_file() -> None:
    data = encode_ipfrs_gradient(np.array([0.5, -1.0, 2.25], np.float32))
    assert data[:64] == b"ARROW1" + bytes(58)  # magic padded to the 64-byte alignment
    assert data[64:68] == b"\xff\xff\xff\xff"  # continuation marker of the schema message
    schema_len = struct.unpack_from("<i", data, 68)[0]
    assert (8 + schema_len) % 64 == 0
    batch_at = 64 + 8 + schema_len
    assert data[batch_at : batch_at + 4] == b"\xff\xff\xff\xff"
    batch_len = struct.unpack_from("<i", data, batch_at + 4)[0]
    body = data[batch_at + 8 + batch_len :][:256]
    # four buffers, each padded to 64 bytes: validity, index, validity, value
    assert body[0:64] == b"\xff" + bytes(63)
    assert body[64:128] == struct.pack("<3i", 0, 1, 2) + bytes(52)
    assert body[128:192] == b"\xff" + bytes(63)
    assert body[192:256] == struct.pack("<3f", 0.5, -1.0, 2.25) + bytes(52)
    footer_len = struct.unpack_from("<i", data, len(data) - 10)[0]
    assert data[-6:] == b"ARROW1"
    assert data[-10 - footer_len - 8 : -10 - footer_len] == b"\xff\xff\xff\xff" + bytes(4)


def test_pyarrow_reads_the_file_as_ipfrs_defines_it() -> None:
    values = np.array([0.25, -3.0, 7.5, 1e-30], np.float32)
    reader = pa.ipc.open_file(pa.py_buffer(encode_ipfrs_gradient(values)))
    assert reader.num_record_batches == 1
    assert reader.schema.equals(SCHEMA, check_metadata=True)
    assert reader.schema.metadata is None
    assert all(not field.nullable and field.metadata is None for field in reader.schema)
    table = reader.read_all()
    assert table.column("index").to_pylist() == [0, 1, 2, 3]
    assert bits(table.column("value").to_numpy()) == bits(values)


def test_empty_gradient_is_a_valid_file_with_zero_rows() -> None:
    data = encode_ipfrs_gradient([])
    reader = pa.ipc.open_file(pa.py_buffer(data))
    assert reader.num_record_batches == 1
    assert reader.get_batch(0).num_rows == 0
    assert decode_ipfrs_gradient(data).size == 0


def test_inputs_accepted_and_refused() -> None:
    expected = encode_ipfrs_gradient(np.array([1, 2, 3, 4], np.float32))
    assert encode_ipfrs_gradient([1, 2, 3, 4]) == expected
    assert encode_ipfrs_gradient(np.arange(1, 5, dtype=np.float32).reshape(2, 2)) == expected
    strided = np.array([1, 0, 2, 0, 3, 0, 4, 0], np.float32)[::2]
    assert not strided.flags.c_contiguous
    assert encode_ipfrs_gradient(strided) == expected
    assert encode_ipfrs_gradient(np.array([1, 2, 3, 4], ">f4")) == expected
    with pytest.raises(UnsupportedDtype):
        encode_ipfrs_gradient(np.zeros(3, np.float64))


def test_too_many_values_for_the_int32_index() -> None:
    with pytest.raises(FieldOverflow) as info:
        ipfrs_gradient_size(2**31)
    assert isinstance(info.value, ValueError)


def test_encode_into_a_caller_buffer() -> None:
    values = np.linspace(-1, 1, 100, dtype=np.float32)
    expected = encode_ipfrs_gradient(values)
    out = bytearray(len(expected) + 10)
    assert encode_ipfrs_gradient_into(values, out) == len(expected)
    assert bytes(out[: len(expected)]) == expected
    arr = np.zeros(len(expected), np.uint8)
    encode_ipfrs_gradient_into(values, arr)
    assert arr.tobytes() == expected


def test_encode_into_a_small_buffer_leaves_it_untouched() -> None:
    out = bytearray(b"\x01" * 100)
    with pytest.raises(ValueError, match="needs 1026"):
        encode_ipfrs_gradient_into([1.0], out)
    assert out == b"\x01" * 100


def test_write_to_a_file_object_and_a_path(tmp_path: Path) -> None:
    values = np.arange(70, dtype=np.float32)
    expected = encode_ipfrs_gradient(values)
    sink = io.BytesIO()
    assert write_ipfrs_gradient(values, sink) == len(expected)
    assert sink.getvalue() == expected
    path = tmp_path / "gradient.arrow"
    assert write_ipfrs_gradient(values, path) == len(expected)
    assert path.read_bytes() == expected


# ── reading ──────────────────────────────────────────────────────────────────
def test_single_batch_decode_is_zero_copy() -> None:
    data = bytearray(encode_ipfrs_gradient(np.arange(10, dtype=np.float32)))
    values = decode_ipfrs_gradient(data)
    assert values.dtype == np.float32
    assert values.tolist() == list(range(10))
    assert np.shares_memory(values, np.frombuffer(data, np.uint8))


def test_reads_files_written_by_pyarrow() -> None:
    data = pyarrow_file(batch([1.0, 2.5, -4.0]))
    assert decode_ipfrs_gradient(data).tolist() == [1.0, 2.5, -4.0]


def test_every_batch_is_read_and_concatenated() -> None:
    data = pyarrow_file(batch([1.0, 2.0]), batch([]), batch([3.0, 4.0, 5.0]))
    assert decode_ipfrs_gradient(data).tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]


def test_zero_batches_decode_to_empty() -> None:
    assert decode_ipfrs_gradient(pyarrow_file()).size == 0


def test_index_column_is_ignored_and_value_found_by_name() -> None:
    schema = pa.schema([pa.field("value", pa.float32()), pa.field("other", pa.int64())])
    b = pa.record_batch([pa.array([9.0, 8.0], pa.float32()), pa.array([5, 6])], schema=schema)
    assert decode_ipfrs_gradient(pyarrow_file(b, schema=schema)).tolist() == [9.0, 8.0]


def test_missing_value_column_carries_the_seed_message() -> None:
    schema = pa.schema([pa.field("index", pa.int32()), pa.field("values", pa.float32())])
    data = pyarrow_file(batch([1.0], schema), schema=schema)
    with pytest.raises(MissingValueColumn) as info:
        decode_ipfrs_gradient(data)
    assert str(info.value) == "Arrow IPC block missing 'value' column"
    assert issubclass(MissingValueColumn, MalformedBlock)


def test_value_column_of_another_type_carries_the_seed_message() -> None:
    schema = pa.schema([pa.field("index", pa.int32()), pa.field("value", pa.float64())])
    data = pyarrow_file(batch([1.0], schema), schema=schema)
    with pytest.raises(ValueColumnNotFloat32) as info:
        decode_ipfrs_gradient(data)
    assert str(info.value) == "'value' column is not Float32"
    assert info.value.found == "double"
    assert not is_ipfrs_gradient_file(data)


def test_validity_is_ignored_like_the_seed() -> None:
    schema = pa.schema([pa.field("index", pa.int32()), pa.field("value", pa.float32())])
    data = pyarrow_file(batch([1.0, None, 3.0], schema), schema=schema)
    values = decode_ipfrs_gradient(data)
    assert values.size == 3 and values[0] == 1.0 and values[2] == 3.0


def test_a_stream_is_not_a_file() -> None:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, SCHEMA) as writer:
        writer.write_batch(batch([1.0]))
    with pytest.raises(InvalidMagic):
        decode_ipfrs_gradient(sink.getvalue())


def test_every_truncation_raises_a_codec_error() -> None:
    data = encode_ipfrs_gradient(np.array([1.0, 2.0, 3.0], np.float32))
    for cut in range(len(data)):
        with pytest.raises(CodecError):
            decode_ipfrs_gradient(data[:cut])


def test_sniffing() -> None:
    assert is_ipfrs_gradient_file(encode_ipfrs_gradient([1.0]))
    assert is_ipfrs_gradient_file(pyarrow_file(batch([1.0])))
    assert not is_ipfrs_gradient_file(GarwBlock("", "", (1,), np.ones(1, np.float32), 1).to_bytes())
    assert not is_ipfrs_gradient_file(b"ARROW1")
    assert not is_ipfrs_gradient_file(b"")
    other = pa.schema([pa.field("value", pa.float32())])
    assert not is_ipfrs_gradient_file(pyarrow_file(schema=other))


# ── hypothesis ───────────────────────────────────────────────────────────────
float32_arrays = st.lists(st.integers(0, 2**32 - 1), max_size=80).map(
    lambda b: np.array(b, np.uint32).view(np.float32)
)


@settings(max_examples=60, derandomize=True, deadline=None)
@given(float32_arrays)
def test_roundtrip_is_bit_exact(values: np.ndarray) -> None:
    data = encode_ipfrs_gradient(values)
    assert len(data) == ipfrs_gradient_size(values.size)
    assert bits(decode_ipfrs_gradient(data)) == bits(values)
    table = pa.ipc.open_file(pa.py_buffer(data)).read_all()
    assert bits(table.column("value").to_numpy()) == bits(values)
    assert table.column("index").to_pylist() == list(range(values.size))


@settings(max_examples=60, derandomize=True, deadline=None)
@given(st.lists(float32_arrays, max_size=4))
def test_pyarrow_multi_batch_files_roundtrip(parts: list[np.ndarray]) -> None:
    batches = [
        pa.record_batch([pa.array(np.arange(p.size, dtype=np.int32)), pa.array(p)], schema=SCHEMA)
        for p in parts
    ]
    expected = np.concatenate(parts) if parts else np.empty(0, np.float32)
    assert bits(decode_ipfrs_gradient(pyarrow_file(*batches))) == bits(expected)


@settings(max_examples=200, derandomize=True, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_raise_only_codec_errors(data: bytes) -> None:
    for candidate in (data, b"ARROW1\x00\x00" + data, b"ARROW1\x00\x00" + data + b"ARROW1"):
        with contextlib.suppress(CodecError):
            decode_ipfrs_gradient(candidate)
        assert isinstance(is_ipfrs_gradient_file(candidate), bool)


VALID = encode_ipfrs_gradient(np.arange(5, dtype=np.float32))


@settings(max_examples=300, derandomize=True, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)), max_size=4))
def test_corrupted_files_raise_only_codec_errors(edits: list[tuple[int, int]]) -> None:
    data = bytearray(VALID)
    for at, byte in edits:
        data[at] = byte
    with contextlib.suppress(CodecError):
        decode_ipfrs_gradient(bytes(data))


def _compressed_file(values: np.ndarray, codec: str = "zstd") -> bytes:
    table = pa.table(
        {"index": pa.array(np.arange(values.size, dtype=np.int32)), "value": pa.array(values)}
    )
    sink = pa.BufferOutputStream()
    options = pa.ipc.IpcWriteOptions(compression=codec)
    with pa.ipc.new_file(sink, table.schema, options=options) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def test_compressed_file_decodes() -> None:
    values = np.linspace(0, 1, 1000, dtype=np.float32)
    np.testing.assert_array_equal(decode_ipfrs_gradient(_compressed_file(values)), values)


def test_compressed_buffer_claiming_a_huge_size_is_refused_before_allocation() -> None:
    values = np.linspace(0, 1, 1000, dtype=np.float32)
    data = bytearray(_compressed_file(values))
    claimed = struct.pack("<q", values.nbytes)  # the value buffer's decompressed-size prefix
    at = data.find(claimed)
    assert at > 0
    data[at : at + 8] = struct.pack("<q", 2**40)
    with pytest.raises(MalformedBlock, match="decompressed"):
        decode_ipfrs_gradient(bytes(data))


def test_row_count_above_max_values_is_refused() -> None:
    data = encode_ipfrs_gradient(np.zeros(100, np.float32))
    with pytest.raises(MalformedBlock, match="over 99 values"):
        decode_ipfrs_gradient(data, max_values=99)
    assert decode_ipfrs_gradient(data, max_values=100).size == 100


@pytest.mark.parametrize(("at", "byte"), [(324, 0), (984, 9)])
def test_a_record_batch_cut_short_is_a_malformed_block(at: int, byte: int) -> None:
    """pyarrow reports some damaged record batches with a bare EOFError."""
    data = bytearray(VALID)
    data[at] = byte
    with pytest.raises(CodecError):
        decode_ipfrs_gradient(bytes(data))
