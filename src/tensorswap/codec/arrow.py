"""TensorBlock <-> Arrow IPC stream bytes: one record batch, zero-copy decode.

Layout: an Arrow IPC *stream* (schema message, one record batch, end-of-stream marker). The
schema has one non-null column per encoding column (``values`` for dense tensors) and one
schema-metadata key, ``tensorswap.block``, whose value is compact JSON::

    {"v": 1, "kind": "tensor", "name": ..., "dtype": ..., "shape": [...],
     "num_samples": ..., "encoding": "dense", "params": {...}, "meta": {...}}

bfloat16 values are stored as their uint16 bits with ``"dtype": "bfloat16"``. Arrow body
compression (lz4 or zstd) is optional and recorded by Arrow itself.
"""

from __future__ import annotations

import math
import os
from typing import Any, BinaryIO, Literal

import msgspec
import numpy as np
import pyarrow as pa

from tensorswap.codec.block import TensorBlock
from tensorswap.codec.dtypes import DType
from tensorswap.codec.lossy import ENCODINGS, Encoding
from tensorswap.errors import CodecError, MalformedBlock, TruncatedData

META_KEY = b"tensorswap.block"
FORMAT_VERSION = 1
MAX_NDIM = 64
Compression = Literal["lz4", "zstd"] | None
_COMPRESSIONS = {None: None, "none": None, "lz4": "lz4_frame", "zstd": "zstd"}


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


def _options(compression: Compression) -> pa.ipc.IpcWriteOptions:
    try:
        codec = _COMPRESSIONS[compression]
    except KeyError:
        msg = f"compression must be one of lz4, zstd or None, got {compression!r}"
        raise ValueError(msg) from None
    return pa.ipc.IpcWriteOptions(compression=codec, use_threads=False)


def _to_batch(
    block: TensorBlock, encoding: Encoding | str, kind: str, **options: Any
) -> pa.RecordBatch:
    enc = Encoding(encoding)
    columns, params = ENCODINGS[enc].encode(block.flat(), block.dtype, **options)
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


def encoded_size(
    block: TensorBlock,
    *,
    encoding: Encoding | str = Encoding.DENSE,
    compression: Compression = None,
    kind: str = "tensor",
    **options: Any,
) -> int:
    """Exact byte length `encode_block` would produce (data is not copied to measure it)."""
    sink = pa.MockOutputStream()
    _write(_to_batch(block, encoding, kind, **options), sink, compression)
    return int(sink.size())


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

    The tensor bytes are copied exactly once, straight into `out`. Raises ValueError when `out`
    is too small (nothing useful is left in it then).
    """
    batch = _to_batch(block, encoding, kind, **options)
    target = pa.py_buffer(out)
    measure = pa.MockOutputStream()
    _write(batch, measure, compression)
    size = int(measure.size())
    if size > target.size:
        raise ValueError(f"output buffer holds {target.size} bytes, the block needs {size}")
    writer = pa.FixedSizeBufferWriter(target)
    _write(batch, writer, compression)
    return size


def encode_block(
    block: TensorBlock,
    *,
    encoding: Encoding | str = Encoding.DENSE,
    compression: Compression = None,
    kind: str = "tensor",
    **options: Any,
) -> pa.Buffer:
    """Encode to a new pyarrow Buffer (buffer protocol; `bytes(buf)` or memoryview(buf) to use).

    Lossy encodings (see `tensorswap.codec.lossy`) take options such as ``topk_fraction``.
    """
    batch = _to_batch(block, encoding, kind, **options)
    if compression in (None, "none"):
        measure = pa.MockOutputStream()
        _write(batch, measure, None)
        buf = pa.allocate_buffer(int(measure.size()))
        _write(batch, pa.FixedSizeBufferWriter(buf), None)
        return buf
    sink = pa.BufferOutputStream()
    _write(batch, sink, compression)
    return sink.getvalue()


def write_block(
    block: TensorBlock,
    file: str | os.PathLike[str] | BinaryIO,
    *,
    encoding: Encoding | str = Encoding.DENSE,
    compression: Compression = None,
    **options: Any,
) -> int:
    """Write the encoded block to a path or binary file object; return the bytes written."""
    batch = _to_batch(block, encoding, "tensor", **options)
    if isinstance(file, str | os.PathLike):
        with pa.OSFile(os.fspath(file), "wb") as sink:
            _write(batch, sink, compression)
            return int(sink.tell())
    sink = pa.PythonFile(file, mode="w")
    start = sink.tell()
    _write(batch, sink, compression)
    return int(sink.tell()) - int(start)


def _as_arrow_buffer(data: Any) -> pa.Buffer:
    if isinstance(data, pa.Buffer):
        return data
    try:
        return pa.py_buffer(data)
    except TypeError as exc:
        raise TypeError(f"expected a bytes-like object, got {type(data).__name__}") from exc


def read_header(schema: pa.Schema) -> BlockHeader:
    """The tensorswap header of an Arrow schema, validated; MalformedBlock if absent or bad."""
    raw = (schema.metadata or {}).get(META_KEY)
    if raw is None:
        raise MalformedBlock(
            "Arrow stream has no tensorswap.block metadata (not a tensorswap block)"
        )
    try:
        header = _header_decoder.decode(raw)
    except msgspec.DecodeError as exc:
        raise MalformedBlock(f"bad tensorswap.block header: {exc}") from exc
    if header.v != FORMAT_VERSION:
        raise MalformedBlock(f"unsupported tensorswap block version {header.v}")
    if len(header.shape) > MAX_NDIM or any(d < 0 for d in header.shape):
        raise MalformedBlock(f"invalid shape {header.shape[:8]}")
    if not 0 <= header.num_samples < 2**64:
        raise MalformedBlock(f"num_samples {header.num_samples} out of range")
    return header


def decode_block(data: Any) -> TensorBlock:
    """Decode bytes from `encode_block`; dense values are a zero-copy view of `data`.

    The returned array is read-only when `data` is immutable (bytes, pa.Buffer). Every length
    in the stream is checked against the buffer by Arrow before use; any inconsistency raises a
    CodecError subclass, never a pyarrow exception.
    """
    buf = _as_arrow_buffer(data)
    if buf.size < 8:
        raise TruncatedData("Arrow IPC stream", 8, buf.size)
    try:
        reader = pa.ipc.open_stream(buf)
        header = read_header(reader.schema)
        batch = reader.read_next_batch()
        batch.validate()
    except StopIteration as exc:
        raise MalformedBlock("Arrow stream holds no record batch") from exc
    except (pa.ArrowException, OSError, ValueError) as exc:
        if isinstance(exc, CodecError):
            raise
        raise MalformedBlock(f"invalid Arrow IPC stream: {exc}") from exc
    return _block_from_batch(batch, header)


def _block_from_batch(batch: pa.RecordBatch, header: BlockHeader) -> TensorBlock:
    dtype = DType.parse(header.dtype)
    try:
        enc = Encoding(header.encoding)
    except ValueError as exc:
        raise MalformedBlock(f"unknown encoding {header.encoding!r}") from exc
    spec = ENCODINGS[enc]
    cols: dict[str, np.ndarray] = {}
    for name, arrow_type in spec.columns:
        want = dtype.arrow if arrow_type is None else arrow_type
        idx = batch.schema.get_field_index(name)
        if idx < 0:
            raise MalformedBlock(f"{enc} block has no {name!r} column")
        column = batch.column(idx)
        if column.type != want:
            raise MalformedBlock(f"column {name!r} is {column.type}, expected {want}")
        if column.null_count:
            raise MalformedBlock(f"column {name!r} holds nulls")
        cols[name] = _column_view(column)
    size = math.prod(header.shape)
    flat = spec.decode(cols, header.params, dtype, size)
    values = flat.reshape(header.shape)
    return TensorBlock(header.name, values, header.num_samples, header.meta)


def _column_view(column: pa.Array) -> np.ndarray:
    """The column's values as a numpy array over Arrow's memory (no copy)."""
    data = column.buffers()[1]
    width = column.type.bit_width // 8
    n = len(column)
    if data is None:
        return np.empty(0, dtype=np.uint8).view(f"u{width}") if n == 0 else _missing()
    start = column.offset * width
    if start + n * width > data.size:
        raise TruncatedData(f"column of {n} values", start + n * width, data.size)
    return np.frombuffer(data, dtype=f"u{width}", count=n, offset=start)


def _missing() -> np.ndarray:
    raise MalformedBlock("column has no data buffer")


def is_tensorswap_block(data: Any) -> bool:
    """True when `data` opens as an Arrow IPC stream with a tensorswap header."""
    try:
        reader = pa.ipc.open_stream(_as_arrow_buffer(data))
        return META_KEY in (reader.schema.metadata or {})
    except (pa.ArrowException, OSError, ValueError, TypeError):
        return False
