"""Arrow IPC block codec: round trips, zero-copy decode, encode targets, hostile input."""

from __future__ import annotations

import contextlib
import io
import mmap
import os
import random
from pathlib import Path
from typing import Any

import hypothesis.extra.numpy as hnp
import ml_dtypes
import msgspec
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensorswap.codec import (
    DType,
    Encoding,
    TensorBlock,
    decode_block,
    encode_block,
    encode_block_into,
    encoded_size,
    is_tensorswap_block,
    write_block,
)
from tensorswap.codec import arrow as codec_arrow
from tensorswap.errors import CodecError, MalformedBlock, UnsupportedDtype

COMPRESSIONS = [None, "lz4", "zstd"]
ALL_DTYPES = list(DType)


def _raw_array(dtype: DType, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Arbitrary bit patterns (NaN payloads, infinities, subnormals) of `dtype`."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    raw = rng.integers(0, 256, size=n * dtype.itemsize, dtype=np.uint8)
    return raw.view(dtype.numpy).reshape(shape)


def _header_of(buf: Any) -> dict[str, Any]:
    schema = pa.ipc.open_stream(pa.py_buffer(buf)).schema
    return dict(msgspec.json.decode(schema.metadata[b"tensorswap.block"]))


def _forge(header: dict[str, Any], columns: dict[str, pa.Array], compression: Any = None) -> bytes:
    """An Arrow IPC stream with an arbitrary tensorswap header and columns."""
    schema = pa.schema(
        [pa.field(k, v.type, nullable=False) for k, v in columns.items()],
        metadata={b"tensorswap.block": msgspec.json.encode(header)},
    )
    sink = pa.BufferOutputStream()
    opts = pa.ipc.IpcWriteOptions(compression=compression)
    with pa.ipc.new_stream(sink, schema, options=opts) as writer:
        writer.write_batch(pa.RecordBatch.from_arrays(list(columns.values()), schema=schema))
    return sink.getvalue().to_pybytes()


def _base_header(**changes: Any) -> dict[str, Any]:
    header: dict[str, Any] = {
        "v": 1,
        "kind": "tensor",
        "name": "t",
        "dtype": "float32",
        "shape": [4],
        "num_samples": 0,
        "encoding": "dense",
        "params": {},
        "meta": {},
    }
    header.update(changes)
    return header


def _f32(n: int) -> pa.Array:
    return pa.array(np.arange(n, dtype=np.float32))


# ── round trips ──────────────────────────────────────────────────────────────
@settings(
    max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    dtype=st.sampled_from(ALL_DTYPES),
    shape=hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5),
    compression=st.sampled_from(COMPRESSIONS),
    seed=st.integers(0, 2**32 - 1),
    num_samples=st.integers(0, 2**64 - 1),
    name=st.text(max_size=20),
    meta=st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3),
)
def test_dense_round_trip_is_bit_exact(
    dtype: DType,
    shape: tuple[int, ...],
    compression: Any,
    seed: int,
    num_samples: int,
    name: str,
    meta: dict[str, str],
) -> None:
    block = TensorBlock(name, _raw_array(dtype, shape, seed), num_samples, meta)
    decoded = decode_block(encode_block(block, compression=compression))
    assert decoded == block
    assert decoded.dtype is dtype
    assert decoded.shape == shape


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_dense_keeps_dtype_without_widening(dtype: DType) -> None:
    block = TensorBlock("x", _raw_array(dtype, (3, 2)))
    buf = encode_block(block)
    assert decode_block(buf).values.dtype == dtype.numpy
    assert _header_of(buf)["dtype"] == dtype.value


def test_bfloat16_is_stored_as_16_bit() -> None:
    block = TensorBlock("x", np.ones(1024, dtype=ml_dtypes.bfloat16))
    schema = pa.ipc.open_stream(encode_block(block)).schema
    assert schema.field("values").type == pa.uint16()
    assert encoded_size(block) < 1024 * 2 + 1024


def test_nan_payloads_survive() -> None:
    bits = np.array([0x7FC00001, 0xFFC12345, 0x7F800001, 0x80000000], dtype=np.uint32)
    block = TensorBlock("nan", bits.view(np.float32))
    assert decode_block(encode_block(block)).values.view(np.uint32).tolist() == bits.tolist()


@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (1, 1, 1, 1)])
def test_zero_dim_and_empty_shapes_round_trip(shape: tuple[int, ...]) -> None:
    block = TensorBlock("s", np.full(shape, 7.5, dtype=np.float32))
    decoded = decode_block(encode_block(block))
    assert decoded.shape == shape
    assert decoded == block


@pytest.mark.parametrize(
    "make",
    [
        lambda a: a.T,
        lambda a: a[::2, 1::3],
        lambda a: a[::-1, ::-2],
        lambda a: np.asfortranarray(a),
        lambda a: a.astype(">f4"),
    ],
    ids=["transposed", "strided", "negative-strides", "fortran", "big-endian"],
)
def test_non_contiguous_input_round_trips(make: Any) -> None:
    base = np.arange(60, dtype=np.float32).reshape(6, 10)
    values = make(base)
    decoded = decode_block(encode_block(TensorBlock("v", values)))
    np.testing.assert_array_equal(decoded.values, np.asarray(values, dtype=np.float32))
    assert decoded.values.flags.c_contiguous


def test_header_fields_round_trip() -> None:
    block = TensorBlock("layer.0", np.zeros((2, 3), np.int32), 12, {"round": "3", "peer": "a"})
    decoded = decode_block(encode_block(block))
    assert (decoded.name, decoded.num_samples, dict(decoded.metadata)) == (
        "layer.0",
        12,
        {"round": "3", "peer": "a"},
    )


def test_kind_is_recorded() -> None:
    block = TensorBlock("c", np.zeros(2, np.float32))
    assert _header_of(encode_block(block, kind="chunk"))["kind"] == "chunk"


def test_unknown_encoding_option_is_refused() -> None:
    with pytest.raises(TypeError, match="topk_fraction"):
        encode_block(TensorBlock("x", np.zeros(3, np.float32)), topk_fraction=0.5)


def test_unknown_compression_is_refused() -> None:
    with pytest.raises(ValueError, match="compression"):
        encode_block(TensorBlock("x", np.zeros(3, np.float32)), compression="gzip")  # type: ignore[arg-type]


def test_torch_input_round_trips() -> None:
    torch = pytest.importorskip("torch")
    t = torch.randn(5, 4, requires_grad=True).to(torch.bfloat16).T[::2]
    block = TensorBlock("t", t)
    decoded = decode_block(encode_block(block))
    assert decoded.dtype is DType.BFLOAT16
    expected = t.detach().contiguous().view(torch.int16).numpy()
    np.testing.assert_array_equal(decoded.values.view(np.int16), expected)


# ── zero-copy decode ─────────────────────────────────────────────────────────
def _block() -> TensorBlock:
    return TensorBlock("z", np.arange(256, dtype=np.float32).reshape(16, 16), 3)


@pytest.mark.parametrize(
    "wrap",
    [bytes, bytearray, lambda b: memoryview(bytearray(b)), pa.py_buffer],
    ids=["bytes", "bytearray", "memoryview", "pa.Buffer"],
)
def test_decode_shares_the_input_memory(wrap: Any) -> None:
    data = wrap(bytes(encode_block(_block())))
    decoded = decode_block(data)
    assert np.shares_memory(decoded.values, np.frombuffer(data, np.uint8))
    assert decoded == _block()


def test_decode_of_a_pa_buffer_from_encode_shares_it() -> None:
    buf = encode_block(_block())
    assert np.shares_memory(decode_block(buf).values, np.frombuffer(buf, np.uint8))


def test_decode_shares_an_mmap(tmp_path: Path) -> None:
    path = tmp_path / "b.arrow"
    write_block(_block(), path)
    with open(path, "rb") as fh:
        mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    decoded = decode_block(mapped)
    assert np.shares_memory(decoded.values, np.frombuffer(mapped, np.uint8))
    assert not decoded.values.flags.writeable
    with pytest.raises(BufferError):  # the decoded array keeps the mapping alive
        mapped.close()
    del decoded
    mapped.close()


@pytest.mark.parametrize("offset", [1, 3, 4, 7])
def test_decode_from_a_misaligned_slice_is_still_zero_copy(offset: int) -> None:
    raw = bytes(encode_block(_block()))
    backing = bytearray(offset + len(raw))
    backing[offset:] = raw
    decoded = decode_block(memoryview(backing)[offset:])
    assert np.shares_memory(decoded.values, np.frombuffer(backing, np.uint8))
    assert decoded.values.flags.aligned == (decoded.values.ctypes.data % 4 == 0)
    assert decoded == _block()


def test_decoded_array_is_writable_only_for_writable_input() -> None:
    raw = bytes(encode_block(_block()))
    assert not decode_block(raw).values.flags.writeable
    assert decode_block(bytearray(raw)).values.flags.writeable


def test_encode_output_is_aligned_for_decode() -> None:
    decoded = decode_block(encode_block(_block()))
    assert decoded.values.ctypes.data % 8 == 0  # Arrow pads every message to 8 bytes


def test_bytes_after_the_end_of_stream_are_ignored() -> None:
    raw = bytes(encode_block(_block()))
    assert decode_block(raw + b"\x00" * 13) == _block()


@pytest.mark.parametrize("compression", ["lz4", "zstd"])
def test_compressed_decode_is_a_fresh_array(compression: str) -> None:
    data = bytearray(encode_block(_block(), compression=compression))
    decoded = decode_block(data)
    assert not np.shares_memory(decoded.values, np.frombuffer(data, np.uint8))
    assert decoded == _block()


# ── encode targets ───────────────────────────────────────────────────────────
@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_encode_block_into_writes_the_same_bytes(compression: Any) -> None:
    block = _block()
    expected = bytes(encode_block(block, compression=compression))
    out = bytearray(len(expected) + 100)
    n = encode_block_into(block, out, compression=compression)
    assert n == len(expected) == encoded_size(block, compression=compression)
    assert bytes(out[:n]) == expected
    assert out[n:] == bytearray(100)


@pytest.mark.parametrize(
    "make_out",
    [
        lambda n: np.zeros(n, np.uint8),
        lambda n: np.zeros(n // 8 + 1, np.float64),
        lambda n: memoryview(bytearray(n)),
    ],
    ids=["numpy-u8", "numpy-f64", "memoryview"],
)
def test_encode_block_into_accepts_writable_buffers(make_out: Any) -> None:
    out = make_out(encoded_size(_block()))
    n = encode_block_into(_block(), out)
    assert decode_block(memoryview(out).cast("B")[:n]) == _block()


def test_encode_block_into_an_mmap(tmp_path: Path) -> None:
    size = encoded_size(_block())
    path = tmp_path / "m"
    path.write_bytes(b"\0" * size)
    with open(path, "r+b") as fh, mmap.mmap(fh.fileno(), size) as mapped:
        assert encode_block_into(_block(), mapped) == size
    assert decode_block(path.read_bytes()) == _block()


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_encode_block_into_too_small_raises_value_error(compression: Any) -> None:
    needed = encoded_size(_block(), compression=compression)
    with pytest.raises(ValueError, match="bytes"):
        encode_block_into(_block(), bytearray(needed - 1), compression=compression)


def test_encode_block_into_read_only_buffer_raises_type_error() -> None:
    with pytest.raises(TypeError, match="writable"):
        encode_block_into(_block(), bytes(10_000))


def test_encode_block_into_reused_buffer() -> None:
    out = bytearray(encoded_size(_block()))
    first = TensorBlock("z", np.ones((16, 16), np.float32))
    n = encode_block_into(first, out)
    assert decode_block(bytes(out[:n])) == first
    n = encode_block_into(_block(), out)
    assert decode_block(bytes(out[:n])) == _block()


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_write_block_to_a_path(tmp_path: Path, compression: Any) -> None:
    path = tmp_path / "blk"
    n = write_block(_block(), path, compression=compression)
    assert n == path.stat().st_size == encoded_size(_block(), compression=compression)
    assert decode_block(path.read_bytes()) == _block()


def test_write_block_to_a_file_object_at_its_position() -> None:
    f = io.BytesIO()
    f.write(b"prefix")
    n = write_block(_block(), f)
    assert not f.closed
    assert f.getvalue()[:6] == b"prefix"
    assert len(f.getvalue()) == 6 + n
    assert decode_block(f.getvalue()[6:]) == _block()


def test_write_block_to_a_pipe() -> None:
    r, w = os.pipe()
    size = encoded_size(_block())
    assert size < 60_000  # fits the pipe buffer, so no reader thread is needed
    with os.fdopen(w, "wb") as wf:
        assert write_block(_block(), wf) == size
    with os.fdopen(r, "rb") as rf:
        assert decode_block(rf.read()) == _block()


class _ShortWriter(io.RawIOBase):
    """A raw file that accepts at most 7 bytes per write and records what it was given."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.kinds: set[str] = set()

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        self.kinds.add(type(b).__name__)
        chunk = bytes(memoryview(b)[:7])
        self.data += chunk
        return len(chunk)


def test_write_block_completes_short_writes() -> None:
    f = _ShortWriter()
    n = write_block(_block(), f)
    assert n == len(f.data)
    assert decode_block(bytes(f.data)) == _block()


def test_write_block_passes_the_tensor_without_making_bytes() -> None:
    f = _ShortWriter()
    write_block(TensorBlock("big", np.zeros(1 << 16, np.float32)), f)
    assert "bytes" not in f.kinds


# ── hostile input: only CodecError subclasses ────────────────────────────────
def _sample_blocks() -> list[bytes]:
    block = TensorBlock("h", np.arange(24, dtype=np.float32).reshape(2, 3, 4), 2, {"k": "v"})
    return [
        bytes(encode_block(block)),
        bytes(encode_block(block, compression="zstd")),
        bytes(encode_block(block, compression="lz4")),
        bytes(encode_block(block, encoding=Encoding.TOPK, topk_fraction=0.25)),
        bytes(encode_block(block, encoding=Encoding.INT8)),
    ]


@pytest.mark.parametrize("which", range(5))
def test_every_truncation_raises_codec_error(which: int) -> None:
    raw = _sample_blocks()[which]
    for cut in range(len(raw)):
        with pytest.raises(CodecError):
            decode_block(raw[:cut])


@pytest.mark.parametrize("which", range(5))
def test_corrupted_bytes_raise_codec_error_or_decode(which: int) -> None:
    raw = _sample_blocks()[which]
    rng = random.Random(which)
    for _ in range(400):
        bad = bytearray(raw)
        for _ in range(rng.randint(1, 4)):
            bad[rng.randrange(len(bad))] = rng.randrange(256)
        with contextlib.suppress(CodecError):
            decode_block(bytes(bad))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.binary(max_size=600))
def test_random_bytes_raise_codec_error(data: bytes) -> None:
    with pytest.raises(CodecError):
        decode_block(data)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.binary(max_size=200))
def test_random_bytes_after_a_valid_schema_raise_codec_error(tail: bytes) -> None:
    raw = bytes(encode_block(_block()))
    schema_len = len(pa.ipc.open_stream(raw).schema.serialize())
    with pytest.raises(CodecError):
        decode_block(raw[:schema_len] + tail)


def test_non_buffer_input_is_a_type_error() -> None:
    with pytest.raises(TypeError):
        decode_block(12345)


def test_shape_not_matching_column_length_is_malformed() -> None:
    with pytest.raises(MalformedBlock, match="rows"):
        decode_block(_forge(_base_header(shape=[5]), {"values": _f32(4)}))


def test_wrong_column_type_is_malformed() -> None:
    with pytest.raises(MalformedBlock, match="column"):
        decode_block(_forge(_base_header(), {"values": pa.array(np.arange(4, dtype=np.int32))}))


def test_missing_column_is_malformed() -> None:
    with pytest.raises(MalformedBlock, match="no 'values' column"):
        decode_block(_forge(_base_header(), {"other": _f32(4)}))


def test_extra_column_is_malformed() -> None:
    with pytest.raises(MalformedBlock, match="columns"):
        decode_block(_forge(_base_header(), {"values": _f32(4), "x": _f32(4)}))


def test_nulls_are_malformed() -> None:
    header = _base_header()
    schema = pa.schema(
        [pa.field("values", pa.float32())],
        metadata={b"tensorswap.block": msgspec.json.encode(header)},
    )
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as writer:
        writer.write_batch(pa.record_batch([pa.array([1.0, None, 2.0, 3.0], pa.float32())], schema))
    with pytest.raises(MalformedBlock, match="nulls"):
        decode_block(sink.getvalue())


def test_unknown_encoding_is_malformed() -> None:
    with pytest.raises(MalformedBlock, match="encoding"):
        decode_block(_forge(_base_header(encoding="fp4"), {"values": _f32(4)}))


def test_unknown_dtype_is_unsupported() -> None:
    with pytest.raises(UnsupportedDtype):
        decode_block(_forge(_base_header(dtype="complex64"), {"values": _f32(4)}))


def test_lossy_encoding_of_an_integer_dtype_is_unsupported() -> None:
    header = _base_header(dtype="int8", encoding="int8", params={"scale": 1.0, "offset": 0.0})
    with pytest.raises(UnsupportedDtype):
        decode_block(_forge(header, {"values": pa.array(np.zeros(4, np.int8))}))


def test_version_2_is_malformed() -> None:
    with pytest.raises(MalformedBlock, match="version 2"):
        decode_block(_forge(_base_header(v=2), {"values": _f32(4)}))


@pytest.mark.parametrize(
    "header",
    [
        {"v": 1},
        {"v": "1", "kind": "tensor", "name": "t", "dtype": "float32", "shape": [4]},
        _base_header(shape=[-4]),
        _base_header(shape=[1] * 65),
        _base_header(shape="4"),
        _base_header(num_samples=-1),
        _base_header(num_samples=2**64),
        _base_header(meta={"a": 1}),
    ],
    ids=["missing", "v-type", "negative", "ndim", "shape-type", "samples<0", "samples>u64", "meta"],
)
def test_bad_header_fields_are_malformed(header: dict[str, Any]) -> None:
    with pytest.raises(MalformedBlock):
        decode_block(_forge(header, {"values": _f32(4)}))


def test_header_that_is_not_json_is_malformed() -> None:
    schema = pa.schema([pa.field("values", pa.float32(), nullable=False)])
    schema = schema.with_metadata({b"tensorswap.block": b"{not json"})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as writer:
        writer.write_batch(pa.record_batch([_f32(4)], schema))
    with pytest.raises(MalformedBlock, match="header"):
        decode_block(sink.getvalue())


def test_missing_header_is_malformed() -> None:
    sink = pa.BufferOutputStream()
    batch = pa.record_batch([_f32(4)], names=["values"])
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    assert not is_tensorswap_block(sink.getvalue())
    with pytest.raises(MalformedBlock, match=r"no tensorswap\.block"):
        decode_block(sink.getvalue())


def test_two_record_batches_are_malformed() -> None:
    header = _base_header()
    schema = pa.schema(
        [pa.field("values", pa.float32(), nullable=False)],
        metadata={b"tensorswap.block": msgspec.json.encode(header)},
    )
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as writer:
        writer.write_batch(pa.record_batch([_f32(4)], schema))
        writer.write_batch(pa.record_batch([_f32(4)], schema))
    with pytest.raises(MalformedBlock, match="one record batch"):
        decode_block(sink.getvalue())


@pytest.mark.parametrize(
    "shape", [[2**40, 2**40], [0, 2**62, 2**62], [2**64 + 1], [10**30]], ids=str
)
def test_huge_shape_is_refused_before_allocation(shape: list[int]) -> None:
    with pytest.raises(MalformedBlock, match="limit"):
        decode_block(_forge(_base_header(shape=shape), {"values": _f32(4)}))


def test_huge_topk_shape_is_refused_before_allocation() -> None:
    header = _base_header(shape=[2**40], encoding="topk", params={"k": 1})
    columns = {"indices": pa.array([3], pa.int64()), "values": pa.array([1.0], pa.float32())}
    with pytest.raises(MalformedBlock, match="limit"):
        decode_block(_forge(header, columns))


def test_max_values_is_configurable_per_call() -> None:
    raw = encode_block(TensorBlock("x", np.zeros(100, np.float32)))
    assert decode_block(raw, max_values=100).size == 100
    with pytest.raises(MalformedBlock, match="limit 99"):
        decode_block(raw, max_values=99)


def test_max_values_is_configurable_per_module(monkeypatch: pytest.MonkeyPatch) -> None:
    raw = encode_block(TensorBlock("x", np.zeros(100, np.float32)))
    monkeypatch.setattr(codec_arrow, "MAX_DECODED_VALUES", 10)
    with pytest.raises(MalformedBlock, match="limit 10"):
        decode_block(raw)


@pytest.mark.parametrize("compression", ["lz4", "zstd"])
@pytest.mark.parametrize("claim", [2**40, 2**62, 10_000, -5])
def test_compressed_size_claim_is_checked_before_decompressing(
    compression: str, claim: int
) -> None:
    raw = bytearray(
        encode_block(TensorBlock("c", np.zeros(1000, np.float32)), compression=compression)
    )
    at = raw.find((4000).to_bytes(8, "little"))
    assert at > 0
    raw[at : at + 8] = claim.to_bytes(8, "little", signed=True)
    with pytest.raises(MalformedBlock, match="claims"):
        decode_block(bytes(raw))


def test_is_tensorswap_block() -> None:
    assert is_tensorswap_block(encode_block(_block()))
    assert is_tensorswap_block(bytes(encode_block(_block(), compression="zstd")))
    assert not is_tensorswap_block(b"")
    assert not is_tensorswap_block(b"GARW\x00\x00\x00\x00")
    assert not is_tensorswap_block(12)


def test_a_header_nested_too_deep_is_a_malformed_block() -> None:
    import pyarrow as pa

    from tensorswap.codec.arrow import META_KEY

    depth = 5000
    header = (
        '{"v":1,"kind":"tensor","name":"x","dtype":"float32","shape":[1],"num_samples":0,'
        '"encoding":"dense","params":{},"meta":{},"zz":' + "[" * depth + "]" * depth + "}"
    ).encode()
    schema = pa.schema(
        [pa.field("values", pa.float32(), nullable=False)], metadata={META_KEY: header}
    )
    batch = pa.RecordBatch.from_arrays([pa.array([1.0], pa.float32())], schema=schema)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    with pytest.raises(MalformedBlock, match="header"):
        decode_block(sink.getvalue())


@pytest.mark.parametrize("kind", ["stream", "file"])
def test_check_ipc_messages_bounds_what_a_compressed_ipc_would_decompress(kind: str) -> None:
    import pyarrow as pa

    from tensorswap.codec._ipcmeta import check_ipc_messages

    table = pa.table({"zeros": pa.array(np.zeros(1 << 20, np.float32))})  # 4 MiB, compresses
    sink = pa.BufferOutputStream()
    options = pa.ipc.IpcWriteOptions(compression="zstd")
    opener = pa.ipc.new_stream if kind == "stream" else pa.ipc.new_file
    with opener(sink, table.schema, options=options) as writer:
        writer.write_table(table)
        writer.write_table(table)
    data = memoryview(sink.getvalue())
    messages = data if kind == "stream" else data[8:]  # a file's messages follow its magic
    assert len(data) < 64 * 1024
    check_ipc_messages(messages, 16 << 20)  # 8 MiB declared: fits
    with pytest.raises(MalformedBlock, match="decompressed"):
        check_ipc_messages(messages, 6 << 20)  # the second batch crosses it
    with pytest.raises(MalformedBlock):
        check_ipc_messages(messages[: len(messages) // 2], 16 << 20)
