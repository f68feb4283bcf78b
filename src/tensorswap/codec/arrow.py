"""TensorBlock <-> Arrow IPC stream bytes: one record batch, zero-copy decode.

Layout: an Arrow IPC *stream* (schema message, one record batch, end-of-stream marker). The
schema has one non-null column per encoding column (``values`` for dense tensors) and one
schema-metadata key, ``tensorswap.block``, whose value is compact JSON with sorted keys::

    {"dtype": ..., "encoding": "dense", "kind": "tensor", "meta": {...}, "name": ...,
     "num_samples": ..., "params": {...}, "shape": [...], "v": 1}

bfloat16 values are stored as their uint16 bits with ``"dtype": "bfloat16"``. Arrow body
compression (lz4 or zstd) is optional and recorded by Arrow itself. docs/codec.md has the rest.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, BinaryIO, Literal

import msgspec
import numpy as np
import pyarrow as pa

from tensorswap.codec._ipcmeta import batch_layout, check_decompressed_sizes
from tensorswap.codec.block import TensorBlock
from tensorswap.codec.dtypes import DType
from tensorswap.codec.lossy import ENCODINGS, Encoding, TensorEncoding
from tensorswap.errors import CodecError, MalformedBlock, TruncatedData, UnsupportedDtype

META_KEY = b"tensorswap.block"
FORMAT_VERSION = 1
MAX_NDIM = 64  # numpy's own limit
# Largest tensor (in values) a decoder builds from a header; the header is untrusted input.
# decode_block(max_values=...) overrides it per call.
MAX_DECODED_VALUES = 2**34
EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"  # Arrow IPC end-of-stream marker
Compression = Literal["lz4", "zstd"] | None
_COMPRESSIONS = {None: None, "none": None, "lz4": "lz4_frame", "zstd": "zstd"}
_ARROW_ERRORS = (pa.ArrowException, OSError, EOFError, ValueError, TypeError, MemoryError)


class BlockHeader(msgspec.Struct, forbid_unknown_fields=False):
    """The JSON header kept in the schema metadata (unknown fields from newer peers ignored)."""

    v: int
    kind: str
    name: str
    dtype: str
    shape: list[int]
    num_samples: int = 0
    encoding: str = "dense"
    params: dict[str, float | int] = msgspec.field(default_factory=dict)
    meta: dict[str, str] = msgspec.field(default_factory=dict)


_header_encoder = msgspec.json.Encoder(order="sorted")
_header_decoder = msgspec.json.Decoder(BlockHeader)


# ── encode ───────────────────────────────────────────────────────────────────
_WRITE_OPTIONS = {
    key: pa.ipc.IpcWriteOptions(compression=codec, use_threads=False)
    for key, codec in _COMPRESSIONS.items()
}


def _options(compression: Compression) -> pa.ipc.IpcWriteOptions:
    try:
        return _WRITE_OPTIONS[compression]
    except (KeyError, TypeError):
        msg = f"compression must be one of lz4, zstd or None, got {compression!r}"
        raise ValueError(msg) from None


def _encoding(encoding: Encoding | str, options: dict[str, Any]) -> tuple[Encoding, TensorEncoding]:
    try:
        enc = Encoding(encoding)
    except ValueError:
        known = ", ".join(e.value for e in Encoding)
        raise ValueError(f"unknown encoding {encoding!r}; known: {known}") from None
    spec = ENCODINGS[enc]
    unknown = sorted(set(options) - spec.options)
    if unknown:
        raise TypeError(f"encoding {enc} takes no option(s) {', '.join(unknown)}")
    return enc, spec


def _to_batch(
    block: TensorBlock, encoding: Encoding | str, kind: str, options: dict[str, Any]
) -> pa.RecordBatch:
    if not isinstance(block, TensorBlock):
        raise TypeError(f"expected a TensorBlock, got {type(block).__name__}")
    enc, spec = _encoding(encoding, options)
    columns, params = spec.encode(block.flat(), block.dtype, **options)
    header = BlockHeader(
        v=FORMAT_VERSION,
        kind=kind,
        name=block.name,
        dtype=block.dtype.value,
        shape=list(block.shape),
        num_samples=block.num_samples,
        encoding=enc.value,
        params=params,
        meta=dict(block.metadata),
    )
    schema = pa.schema(
        [pa.field(name, arr.type, nullable=False) for name, arr in columns],
        metadata={META_KEY: _header_encoder.encode(header)},
    )
    return pa.RecordBatch.from_arrays([arr for _, arr in columns], schema=schema)


def _write(batch: pa.RecordBatch, sink: Any, compression: Compression) -> None:
    with pa.ipc.new_stream(sink, batch.schema, options=_options(compression)) as writer:
        writer.write_batch(batch)


def _stream_size(batch: pa.RecordBatch) -> int:
    """Exact length of the uncompressed stream: Arrow lays it out without copying any data."""
    sink = pa.MockOutputStream()
    _write(batch, sink, None)
    return int(sink.size())


def encoded_size(
    block: TensorBlock,
    *,
    encoding: Encoding | str = Encoding.DENSE,
    compression: Compression = None,
    kind: str = "tensor",
    **options: Any,
) -> int:
    """Exact byte length `encode_block` would produce.

    Without compression no tensor data is copied to measure it; with compression the data is
    compressed once (there is no other way to know the compressed length).
    """
    batch = _to_batch(block, encoding, kind, options)
    if _options(compression).compression is None:
        return _stream_size(batch)
    sink = pa.MockOutputStream()
    _write(batch, sink, compression)
    return int(sink.size())


_SMALL_BLOCK = 64 * 1024
"""Uncompressed blocks of at most this many value bytes are encoded in one pass."""


def _writable(out: Any) -> pa.Buffer:
    try:
        view = memoryview(out)
    except TypeError as exc:
        msg = f"out must be a writable bytes-like object, not {type(out).__name__}"
        raise TypeError(msg) from exc
    if view.readonly:
        raise TypeError(f"out must be writable; {type(out).__name__} is read-only")
    if not view.c_contiguous:
        raise ValueError("out must be C-contiguous")
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    return pa.py_buffer(view)


def encode_block_into(
    block: TensorBlock,
    out: Any,
    *,
    encoding: Encoding | str = Encoding.DENSE,
    compression: Compression = None,
    kind: str = "tensor",
    **options: Any,
) -> int:
    """Encode into the writable buffer `out` (bytearray, memoryview, numpy, mmap); return length.

    The block occupies ``out[:length]``; the rest of `out` is untouched. The tensor bytes are
    copied exactly once, straight into `out` (plus once into a temporary if the values were not
    C-contiguous, or by the encoding for lossy ones). Reusing one `out` across calls is the
    fast path. Raises ValueError when `out` is too small (its contents are unspecified then) and
    TypeError when it is not a writable buffer.
    """
    batch = _to_batch(block, encoding, kind, options)
    target = _writable(out)
    if _options(compression).compression is None:
        size = _stream_size(batch)
        if size > target.size:
            raise ValueError(f"output buffer holds {target.size} bytes, the block needs {size}")
        _write(batch, pa.FixedSizeBufferWriter(target), None)
        return size
    writer = pa.FixedSizeBufferWriter(target)
    try:
        _write(batch, writer, compression)
    except OSError as exc:  # "Write out of bounds": the compressed length is known only now
        msg = f"output buffer of {target.size} bytes is too small for the compressed block"
        raise ValueError(msg) from exc
    return int(writer.tell())


def encode_block(
    block: TensorBlock,
    *,
    encoding: Encoding | str = Encoding.DENSE,
    compression: Compression = None,
    kind: str = "tensor",
    **options: Any,
) -> pa.Buffer:
    """Encode to a new pyarrow Buffer (64-byte aligned; buffer protocol, so memoryview() works).

    Lossy encodings (see `tensorswap.codec.lossy`) take options such as ``topk_fraction``;
    options an encoding does not know raise TypeError.
    """
    batch = _to_batch(block, encoding, kind, options)
    if _options(compression).compression is None and block.nbytes > _SMALL_BLOCK:
        buf = pa.allocate_buffer(_stream_size(batch))
        _write(batch, pa.FixedSizeBufferWriter(buf), None)
        return buf
    # compressed, or small: written once into a growing buffer (for a small block that costs
    # less than measuring the stream first; the bytes are the same)
    sink = pa.BufferOutputStream()
    _write(batch, sink, compression)
    return sink.getvalue()


class _FileSink:
    """A write-only file for pyarrow: passes buffers through, finishes short writes, counts."""

    def __init__(self, file: BinaryIO) -> None:
        self._file = file
        self.written = 0
        self.closed = False

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        total = len(view)
        while view:
            n = self._file.write(view)
            if n is None:
                raise BlockingIOError("non-blocking file could not take the write")
            view = view[n:]
        self.written += total
        return total

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:  # the caller owns the file; pyarrow closing its wrapper is no close
        self.closed = True

    def writable(self) -> bool:
        return True


def write_block(
    block: TensorBlock,
    file: str | os.PathLike[str] | BinaryIO,
    *,
    encoding: Encoding | str = Encoding.DENSE,
    compression: Compression = None,
    **options: Any,
) -> int:
    """Write the encoded block to a path (created or truncated) or a binary file object.

    Returns the bytes written. A file object is written at its current position and left open;
    the tensor bytes reach it as one buffer, without an intermediate copy.
    """
    batch = _to_batch(block, encoding, "tensor", options)
    if isinstance(file, str | os.PathLike):
        with pa.OSFile(os.fspath(file), "wb") as out:
            _write(batch, out, compression)
            return int(out.tell())
    sink = _FileSink(file)
    with pa.PythonFile(sink, mode="w") as out:
        _write(batch, out, compression)
    return sink.written


# ── decode ───────────────────────────────────────────────────────────────────
def read_header(schema: pa.Schema) -> BlockHeader:
    """The tensorswap header of an Arrow schema, validated; MalformedBlock if absent or bad."""
    raw = (schema.metadata or {}).get(META_KEY)
    if raw is None:
        raise MalformedBlock(
            "Arrow stream has no tensorswap.block metadata (not a tensorswap block)"
        )
    try:
        header = _header_decoder.decode(raw)
    except (msgspec.DecodeError, RecursionError) as exc:  # RecursionError: nested too deep
        raise MalformedBlock(f"bad tensorswap.block header: {exc}") from exc
    if header.v != FORMAT_VERSION:
        raise MalformedBlock(f"unsupported tensorswap block version {header.v}")
    if len(header.shape) > MAX_NDIM or any(d < 0 for d in header.shape):
        raise MalformedBlock(f"invalid shape {header.shape[:8]} ({len(header.shape)} dims)")
    if not 0 <= header.num_samples < 2**64:
        raise MalformedBlock(f"num_samples {header.num_samples} out of range")
    return header


@dataclass(frozen=True)
class _Plan:
    """What a validated header says the record batch must hold."""

    header: BlockHeader
    dtype: DType
    encoding: Encoding
    spec: TensorEncoding
    size: int
    rows: int


def _plan(header: BlockHeader, max_values: int) -> _Plan:
    dtype = DType.parse(header.dtype)
    try:
        enc = Encoding(header.encoding)
    except ValueError as exc:
        raise MalformedBlock(f"unknown encoding {header.encoding!r}") from exc
    if enc is not Encoding.DENSE and not dtype.is_float:
        raise UnsupportedDtype(f"{dtype} with encoding {enc}", ["float32", "float16", "bfloat16"])
    # Bound the shape before anything is built from it: zero dims aside, its product is what
    # numpy would have to address, and an empty column proves nothing about it.
    extent = math.prod(d for d in header.shape if d)
    if extent > max_values:
        raise MalformedBlock(
            f"shape {header.shape[:8]} spans {extent} values, more than the limit {max_values}"
        )
    size = math.prod(header.shape)
    spec = ENCODINGS[enc]
    return _Plan(header, dtype, enc, spec, size, spec.rows(header.params, size))


def _source(data: Any) -> tuple[pa.Buffer, memoryview]:
    if isinstance(data, pa.Buffer):
        return data, memoryview(data)
    try:
        view = memoryview(data)
    except TypeError as exc:
        raise TypeError(f"expected a bytes-like object, got {type(data).__name__}") from exc
    if view.ndim != 1 or view.itemsize != 1:
        if not view.c_contiguous:
            raise TypeError("expected a C-contiguous bytes-like object")
        view = view.cast("B")
    return pa.py_buffer(view), view


def decode_block(data: Any, *, max_values: int | None = None) -> TensorBlock:
    """Decode bytes from `encode_block`; dense values are a zero-copy view of `data`.

    The block ends at the Arrow end-of-stream marker; bytes after it are ignored. The decoded
    array aliases `data` (any bytes-like object: bytes, bytearray, memoryview, mmap,
    pa.Buffer), keeps it alive, and is writable exactly when `data` is (compressed and lossy
    blocks decode into fresh memory). It may be unaligned when `data` is.

    Every length and count is checked before anything is allocated from it: the header's shape
    against `max_values` (default MAX_DECODED_VALUES) and the batch's row count, and each
    compressed buffer's declared size against the header. Any inconsistency raises a CodecError
    subclass, never a pyarrow exception; a non-bytes-like `data` raises TypeError.
    """
    limit = MAX_DECODED_VALUES if max_values is None else int(max_values)
    buf, view = _source(data)
    if buf.size < len(EOS):
        raise TruncatedData("Arrow IPC stream", len(EOS), buf.size)
    try:
        reader = pa.BufferReader(buf)
        message = pa.ipc.read_message(reader)
        if message.type != "schema":
            raise MalformedBlock(f"Arrow stream starts with a {message.type} message")
        schema = pa.ipc.read_schema(message)
        plan = _plan(read_header(schema), limit)
        # Before pyarrow reads the batch: it decompresses every column the schema lists.
        indices = _column_indices(schema, plan)
        message = pa.ipc.read_message(reader)
        if message.type != "record batch":
            raise MalformedBlock(f"expected a record batch, found a {message.type} message")
        layout = batch_layout(memoryview(message.metadata))
        if layout.length != plan.rows:
            raise MalformedBlock(f"record batch has {layout.length} rows, header needs {plan.rows}")
        body = memoryview(message.body) if message.body is not None else memoryview(b"")
        check_decompressed_sizes(layout, body, plan.rows * 8 + 64)
        batch = pa.ipc.read_record_batch(message, schema)
        batch.validate()
        end = reader.tell()
    except CodecError:
        raise
    except EOFError as exc:
        raise TruncatedData("Arrow IPC stream message", len(EOS), 0) from exc
    except _ARROW_ERRORS as exc:
        raise MalformedBlock(f"invalid Arrow IPC stream: {exc}") from exc
    if bytes(view[end : end + len(EOS)]) != EOS:
        if end + len(EOS) > len(view):
            raise TruncatedData("Arrow end-of-stream marker", end + len(EOS), len(view))
        raise MalformedBlock("a tensorswap block holds exactly one record batch")
    return _block_from_batch(batch, plan, indices, buf, view)


def _column_indices(schema: pa.Schema, plan: _Plan) -> list[int]:
    """Where each of the encoding's columns is in `schema`; MalformedBlock unless the schema
    holds exactly those columns with their types (checked before any column is read)."""
    if len(schema) != len(plan.spec.columns):
        raise MalformedBlock(
            f"{plan.encoding} block has {len(schema)} columns, expected {len(plan.spec.columns)}"
        )
    indices = []
    for name, arrow_type in plan.spec.columns:
        want = plan.dtype.arrow if arrow_type is None else arrow_type
        idx = schema.get_field_index(name)
        if idx < 0:
            raise MalformedBlock(f"{plan.encoding} block has no {name!r} column")
        found = schema.field(idx).type
        if found != want:
            raise MalformedBlock(f"column {name!r} is {found}, expected {want}")
        indices.append(idx)
    return indices


def _block_from_batch(
    batch: pa.RecordBatch, plan: _Plan, indices: list[int], buf: pa.Buffer, view: memoryview
) -> TensorBlock:
    cols: dict[str, np.ndarray] = {}
    for (name, _), idx in zip(plan.spec.columns, indices, strict=True):
        column = batch.column(idx)
        if column.null_count:
            raise MalformedBlock(f"column {name!r} holds nulls")
        cols[name] = _column_view(column, buf, view)
    header = plan.header
    flat = plan.spec.decode(cols, header.params, plan.dtype, plan.size)
    return TensorBlock(header.name, flat.reshape(header.shape), header.num_samples, header.meta)


def _column_view(column: pa.Array, buf: pa.Buffer, view: memoryview) -> np.ndarray:
    """The column's values as unsigned ints over the input's (or Arrow's) memory, no copy."""
    width = column.type.bit_width // 8
    dtype = np.dtype(f"<u{width}")
    n = len(column)
    data = column.buffers()[1]
    if n == 0:
        return np.empty(0, dtype=dtype)
    if data is None:
        raise MalformedBlock("column has no data buffer")
    start = column.offset * width
    if start + n * width > data.size:
        raise TruncatedData(f"column of {n} values", start + n * width, data.size)
    at = data.address + start - buf.address
    if at >= 0 and at + n * width <= buf.size:
        # Inside the caller's buffer: view it through their object, so the array is writable
        # exactly when theirs is and keeps their object (not just Arrow's wrapper) alive.
        return np.frombuffer(view, dtype=dtype, count=n, offset=at)
    return np.frombuffer(data, dtype=dtype, count=n, offset=start)


def is_tensorswap_block(data: Any) -> bool:
    """True when `data` opens as an Arrow IPC stream with a tensorswap header (schema only)."""
    try:
        buf, _ = _source(data)
        message = pa.ipc.read_message(pa.BufferReader(buf))
        if message.type != "schema":
            return False
        return META_KEY in (pa.ipc.read_schema(message).metadata or {})
    except (*_ARROW_ERRORS, CodecError):
        return False
