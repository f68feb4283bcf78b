"""The ipfrs gradient Arrow IPC file, written byte-for-byte as ipfrs (arrow-rs) writes it.

ipfrs-tensorlogic's ``store_gradient_as_arrow`` writes an Arrow IPC *file* with
``arrow::ipc::writer::FileWriter::try_new`` (default ``IpcWriteOptions``: metadata V5,
64-byte alignment, no compression): one record batch of two non-nullable columns,
``index: Int32`` (0..n-1) and ``value: Float32``, no schema or field metadata. Its
``load_gradient_from_arrow`` reads every batch and appends the ``value`` column.

Writing. pyarrow cannot produce those bytes: Arrow C++ aligns to 8 bytes, omits validity
buffers of columns without nulls and lays out its flatbuffers differently, so the two files
differ in almost every byte (each reads the other's, though). This module therefore writes the
file itself, reproducing arrow-rs 57 ``FileWriter`` exactly:

* ``"ARROW1"`` padded with zeros to 64 bytes;
* the schema message and the record-batch message, each framed as ``0xFFFFFFFF``, an ``i32``
  length and the flatbuffer padded so the frame is a multiple of 64 bytes;
* a body of four buffers, each padded to 64 bytes: an all-ones validity bitmap of ceil(n/8)
  bytes (arrow-rs writes one even for non-nullable columns), the int32 indices, the bitmap
  again, the float32 values;
* the end-of-stream marker ``0xFFFFFFFF 00000000``, the footer flatbuffer, its ``i32``
  length and ``"ARROW1"``.

The flatbuffers come from `_FlatBufferBuilder` (in ``codec/_ipfrs_flatbuf.py``), a port of
the layout decisions of the flatbuffers 25.x Rust builder that arrow-rs uses (back-to-front,
fields in call order, scalars equal to their default omitted, vtables shared within a
buffer), fed the same calls in the same order as arrow-rs 57.3 ``writer.rs``/``convert.rs``.
Verified: the bytes equal those of a Rust program built from the flatbuffers 25.2.10 runtime
and arrow-rs 57.3.1's generated code replaying ``FileWriter`` for these two columns (golden
files in the tests), and pyarrow reads them. Not verified: a run of the ``arrow`` crate
itself (crates.io was not reachable). Read, not run: arrow-rs 52 to 59 make the same calls
for this schema; arrow-rs 51 and older pad the leading magic to 8 bytes, not 64, so their
files differ in that padding and in the footer's block offset (ipfrs depends on arrow 57).

Reading goes through pyarrow, which accepts the files of both writers (and any other Arrow
IPC file with a Float32 ``value`` column). The seed's checks and messages are kept; pyarrow
errors become MalformedBlock, so only CodecError subclasses escape.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np
import pyarrow as pa

from tensorswap.codec._ipcmeta import _I32, _Table, batch_layout, check_decompressed_sizes
from tensorswap.codec._ipfrs_flatbuf import (
    INDEX_COLUMN,
    VALUE_COLUMN,
    _footer,
    _record_batch_message,
    _schema_message,
)
from tensorswap.codec.garw import FieldOverflow, float32_vector
from tensorswap.errors import CodecError, InvalidMagic, MalformedBlock, TruncatedData

ARROW_MAGIC = b"ARROW1"
MAX_VALUES = 2**31 - 1  # the index column is Int32
ALIGNMENT = 64  # arrow-rs IpcWriteOptions::default()

_CONTINUATION = b"\xff\xff\xff\xff"
_EOS = _CONTINUATION + b"\x00\x00\x00\x00"
_INDEX_CHUNK = 1 << 20


class MissingValueColumn(MalformedBlock):
    """The Arrow IPC file has no ``value`` column (the seed's error and message)."""

    def __init__(self) -> None:
        super().__init__("Arrow IPC block missing 'value' column")


class ValueColumnNotFloat32(MalformedBlock):
    """The ``value`` column is not Float32 (the seed's error and message)."""

    def __init__(self, found: object) -> None:
        self.found = str(found)
        super().__init__("'value' column is not Float32")


def _pad(length: int) -> int:
    return -length % ALIGNMENT


def _frame(message: bytes) -> bytes:
    framed = 8 + len(message)
    padding = _pad(framed)
    return b"".join(
        (_CONTINUATION, struct.pack("<i", framed + padding - 8), message, bytes(padding))
    )


_HEADER = ARROW_MAGIC + bytes(_pad(len(ARROW_MAGIC)))
_SCHEMA_FRAME = _frame(_schema_message())


# ── writing ──────────────────────────────────────────────────────────────────
@dataclass(frozen=True)
class _Layout:
    """Everything of one ipfrs gradient file but its index and value bytes."""

    n: int
    head: bytes  # magic, schema message, record-batch message
    validity: bytes  # one padded validity bitmap
    column_padding: int  # zeros after each column's data
    tail: bytes  # end-of-stream marker, footer, footer length, magic

    @property
    def nbytes(self) -> int:
        column = len(self.validity) + 4 * self.n + self.column_padding
        return len(self.head) + 2 * column + len(self.tail)


def _layout(n: int) -> _Layout:
    if n > MAX_VALUES:
        raise FieldOverflow("ipfrs gradient length", n, MAX_VALUES)
    bitmap = -(-n // 8)
    bitmap_padded = bitmap + _pad(bitmap)
    data_padded = 4 * n + _pad(4 * n)
    buffers = []
    offset = 0
    for length, padded in [(bitmap, bitmap_padded), (4 * n, data_padded)] * 2:
        buffers.append((offset, length))
        offset += padded
    body_length = offset
    batch_frame = _frame(_record_batch_message(n, buffers, body_length))
    block_offset = len(_HEADER) + len(_SCHEMA_FRAME)
    footer = _footer(block_offset, len(batch_frame), body_length)
    return _Layout(
        n=n,
        head=_HEADER + _SCHEMA_FRAME + batch_frame,
        validity=b"\xff" * bitmap + bytes(_pad(bitmap)),
        column_padding=_pad(4 * n),
        tail=b"".join((_EOS, footer, struct.pack("<i", len(footer)), ARROW_MAGIC)),
    )


def _segments(values: np.ndarray) -> Iterator[Any]:
    """The file as bytes-like pieces, produced lazily; the values are referenced, not copied.

    The layout (and so FieldOverflow) is computed before the first piece is asked for.
    """
    return _pieces(_layout(values.size), values)


def _pieces(layout: _Layout, values: np.ndarray) -> Iterator[Any]:
    padding = bytes(layout.column_padding)
    yield layout.head
    yield layout.validity
    for start in range(0, layout.n, _INDEX_CHUNK):  # bounded scratch for the index column
        yield np.arange(start, min(start + _INDEX_CHUNK, layout.n), dtype="<i4").data
    yield from (padding, layout.validity, values.data.cast("B"), padding, layout.tail)


def ipfrs_gradient_size(n: int) -> int:
    """Exact length in bytes of the ipfrs gradient file of `n` values."""
    return _layout(n).nbytes


def encode_ipfrs_gradient(values: Any) -> bytes:
    """The ipfrs gradient file of `values` (float32; flattened in C order), as arrow-rs writes it.

    FieldOverflow above 2**31-1 values (the index column is Int32); UnsupportedDtype for a
    numpy array or torch tensor that is not float32.
    """
    return b"".join(_segments(float32_vector(values)))


def encode_ipfrs_gradient_into(values: Any, out: Any) -> int:
    """Write the file into the writable buffer `out` (bytearray, memoryview, numpy, mmap).

    Returns the length written. Raises ValueError, leaving `out` untouched, when it is too small.
    """
    vec = float32_vector(values)
    target = memoryview(out).cast("B")
    size = ipfrs_gradient_size(vec.size)
    if size > target.nbytes:
        raise ValueError(f"output buffer holds {target.nbytes} bytes, the file needs {size}")
    pos = 0
    for piece in _segments(vec):
        length = memoryview(piece).nbytes
        target[pos : pos + length] = memoryview(piece).cast("B")
        pos += length
    return pos


def write_ipfrs_gradient(values: Any, file: str | os.PathLike[str] | BinaryIO) -> int:
    """Write the file to a path or a binary file object; return the number of bytes written."""
    pieces = _segments(float32_vector(values))
    if isinstance(file, str | os.PathLike):
        with open(file, "wb") as sink:
            return _write_all(pieces, sink)
    return _write_all(pieces, file)


def _write_all(pieces: Iterator[Any], sink: BinaryIO) -> int:
    total = 0
    for piece in pieces:
        view = memoryview(piece).cast("B")
        while view.nbytes:  # raw (unbuffered) files may take less than they are given
            done = sink.write(view)
            if not done:  # 0, or None from a non-blocking raw file that would block
                raise OSError(f"the sink accepted no bytes ({total} written so far)")
            total += done
            view = view[done:]
    return total


# ── reading ──────────────────────────────────────────────────────────────────
_MIN_FILE = len(ARROW_MAGIC) + 2 + 4 + len(ARROW_MAGIC)  # magic, padding, footer length, magic


def _as_arrow_buffer(data: Any) -> pa.Buffer:
    if isinstance(data, pa.Buffer):
        return data
    return pa.py_buffer(data)


@dataclass(frozen=True)
class _OpenFile:
    reader: pa.ipc.RecordBatchFileReader
    columns: list[tuple[str, pa.DataType]]


def _open(data: Any, include: int | None = None) -> _OpenFile:
    """Open the file; with `include`, batches read hold only that column (pyarrow then reads
    and decompresses no other: a foreign file's extra columns cost nothing)."""
    buf = _as_arrow_buffer(data)
    size = buf.size
    if size < len(ARROW_MAGIC):
        raise TruncatedData("Arrow IPC file magic", len(ARROW_MAGIC), size)
    head = buf.slice(0, len(ARROW_MAGIC)).to_pybytes()
    if head != ARROW_MAGIC:
        raise InvalidMagic("Arrow IPC file", ARROW_MAGIC, head)
    if size < _MIN_FILE:
        raise TruncatedData("Arrow IPC file footer", _MIN_FILE, size)
    if buf.slice(size - len(ARROW_MAGIC)).to_pybytes() != ARROW_MAGIC:
        raise MalformedBlock(
            "Arrow IPC file does not end with ARROW1: truncated, or a stream rather than a file"
        )
    footer_length = struct.unpack_from("<i", buf.slice(size - 10, 4).to_pybytes())[0]
    if not 0 < footer_length <= size - _MIN_FILE:
        raise TruncatedData("Arrow IPC file footer", max(footer_length, 0), size - _MIN_FILE)
    try:
        options = None if include is None else pa.ipc.IpcReadOptions(included_fields=[include])
        reader = pa.ipc.open_file(buf, options=options)
        schema = reader.schema
        columns = [(field.name, field.type) for field in schema]
    except (pa.ArrowException, OSError, ValueError, EOFError) as exc:  # UnicodeDecodeError too
        raise MalformedBlock(f"not a readable Arrow IPC file: {exc}") from exc
    return _OpenFile(reader, columns)


def _value_index(columns: list[tuple[str, pa.DataType]]) -> int:
    names = [name for name, _ in columns]
    if VALUE_COLUMN not in names:
        raise MissingValueColumn()
    index = names.index(VALUE_COLUMN)  # the first one, as arrow-rs Schema::index_of
    found = columns[index][1]
    if found != pa.float32():
        raise ValueColumnNotFloat32(found)
    return index


def _column_values(column: pa.Array) -> np.ndarray:
    """The raw float32 values of `column` (validity ignored, as the seed does), zero-copy."""
    column.validate()
    data = column.buffers()[1]
    if len(column) == 0 or data is None:
        return np.empty(0, dtype=np.float32)
    return np.frombuffer(data, dtype="<f4", count=len(column), offset=4 * column.offset)


_BLOCK = struct.Struct(
    "<qi4xq"
)  # org.apache.arrow.flatbuf.Block {offset, metaDataLength, bodyLength}
_FOOTER_RECORD_BATCHES = 3  # Footer {version, schema, dictionaries, recordBatches, ...}


def _check_batches(buf: pa.Buffer, max_values: int) -> bool:
    """Bound every record batch the footer lists before pyarrow reads (and decompresses) it;
    whether any batch is compressed.

    Row counts must sum to at most `max_values`; a compressed body buffer may not claim more
    decompressed bytes than its batch's rows can need. Without this, a small file whose
    compressed buffer claims 2**40 bytes makes pyarrow allocate that much.
    """
    view = memoryview(buf)
    size = len(view)
    footer_length = int(_I32.unpack_from(view, size - 10)[0])
    footer = view[size - 10 - footer_length : size - 10]
    try:
        root = _Table(footer, int(struct.unpack_from("<I", footer, 0)[0]))
        start, count = root.vector(_FOOTER_RECORD_BATCHES)
    except struct.error as exc:
        raise MalformedBlock(f"unreadable Arrow IPC file footer: {exc}") from exc
    if start < 0 or start + count * _BLOCK.size > len(footer):
        raise MalformedBlock("Arrow IPC file footer lists more record batches than it holds")
    rows = 0
    compressed = False
    for i in range(count):
        offset, meta_length, body_length = _BLOCK.unpack_from(footer, start + i * _BLOCK.size)
        end = offset + meta_length + body_length
        if offset < 0 or meta_length <= 0 or body_length < 0 or end > size:
            raise MalformedBlock(f"record batch {i} lies outside the {size}-byte file")
        try:
            message = pa.ipc.read_message(buf.slice(offset, meta_length + body_length))
        except (pa.ArrowException, OSError, ValueError, EOFError) as exc:  # EOF: a short block
            raise MalformedBlock(f"bad record batch {i} in Arrow IPC file: {exc}") from exc
        layout = batch_layout(memoryview(message.metadata))
        if layout.length < 0:
            raise MalformedBlock(f"record batch {i} declares {layout.length} rows")
        rows += layout.length
        if rows > max_values:
            raise MalformedBlock(f"Arrow IPC file declares over {max_values} values")
        body = memoryview(message.body) if message.body is not None else memoryview(b"")
        # Widest ipfrs column is 4 bytes a row; other columns of a foreign file may be wider.
        check_decompressed_sizes(layout, body, layout.length * 8 + 64)
        compressed = compressed or layout.compressed
    return compressed


def decode_ipfrs_gradient(data: Any, *, max_values: int = MAX_VALUES) -> np.ndarray:
    """The gradient of an ipfrs gradient file: every batch's ``value`` column, concatenated.

    The ``index`` column is ignored, as by the seed; so are validity bitmaps (raw values are
    returned). With exactly one batch the result is a read-only view of `data`, not a copy.
    Raises MissingValueColumn or ValueColumnNotFloat32 (the seed's messages), InvalidMagic,
    TruncatedData or MalformedBlock; never a pyarrow exception. Unlike the seed, the column
    check also applies to a file of zero batches, and every batch's row count and declared
    decompressed sizes are bounded (at most `max_values` values in all) before any is read;
    only the ``value`` column is read (and decompressed), whatever other columns a file has.
    """
    opened = _open(data)
    index = _value_index(opened.columns)
    if _check_batches(_as_arrow_buffer(data), max_values):
        # pyarrow decompresses every column of a batch it reads: read the value column alone
        # (it then copies even uncompressed buffers, so uncompressed files keep the plain,
        # zero-copy reader: their extra columns cost nothing).
        opened, index = _open(data, include=index), 0
    reader = opened.reader
    try:
        parts = [
            _column_values(reader.get_batch(i).column(index))
            for i in range(reader.num_record_batches)
        ]
    except (pa.ArrowException, OSError, ValueError, EOFError) as exc:
        raise MalformedBlock(f"bad record batch in Arrow IPC file: {exc}") from exc
    if len(parts) == 1:
        return parts[0]
    if not parts:
        return np.empty(0, dtype=np.float32)
    return np.concatenate(parts)


def is_ipfrs_gradient_file(data: Any) -> bool:
    """True for an Arrow IPC file whose schema is ``index: Int32, value: Float32``.

    Only the magic and the footer are read. Nullability and metadata are not checked: the
    seed's reader does not care about them either.
    """
    try:
        columns = _open(data).columns
    except (CodecError, TypeError):
        return False
    return columns == [(INDEX_COLUMN, pa.int32()), (VALUE_COLUMN, pa.float32())]


__all__ = [
    "ARROW_MAGIC",
    "MAX_VALUES",
    "MissingValueColumn",
    "ValueColumnNotFloat32",
    "decode_ipfrs_gradient",
    "encode_ipfrs_gradient",
    "encode_ipfrs_gradient_into",
    "ipfrs_gradient_size",
    "is_ipfrs_gradient_file",
    "write_ipfrs_gradient",
]
