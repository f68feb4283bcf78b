"""The ipfrs file's flatbuffers (schema, record batch, footer), built as arrow-rs 57 builds them."""

from __future__ import annotations

import struct

__all__ = ["INDEX_COLUMN", "VALUE_COLUMN"]

INDEX_COLUMN = "index"
VALUE_COLUMN = "value"

# Arrow format enums and flatbuffer slots (format/Schema.fbs, Message.fbs, File.fbs).
_V5 = 4
_HEADER_SCHEMA, _HEADER_RECORD_BATCH = 1, 3
_TYPE_INT, _TYPE_FLOATING_POINT = 2, 3
_PRECISION_SINGLE = 1


class _FlatBufferBuilder:
    """Back-to-front flatbuffer builder making the layout choices of flatbuffers-rs 25.x.

    Positions are "reverse offsets" (bytes from the end of the buffer), as in the Rust builder.
    Padding and released vtable space are zeros.
    """

    def __init__(self) -> None:
        self._buf = bytearray()  # the used tail of the buffer, in forward order
        self._min_align = 1
        self._vtables: dict[bytes, int] = {}
        self._fields: list[tuple[int, int]] = []
        self._table_start = 0

    @property
    def used(self) -> int:
        return len(self._buf)

    def _align(self, length: int, alignment: int) -> None:
        self._min_align = max(self._min_align, alignment)
        self._buf[0:0] = bytes(-(self.used + length) % alignment)

    def _push(self, raw: bytes, alignment: int) -> int:
        self._align(len(raw), alignment)
        self._buf[0:0] = raw
        return self.used

    def _push_offset(self, target: int) -> int:
        self._align(4, 4)
        return self._push(struct.pack("<I", self.used + 4 - target), 4)

    def string(self, text: str) -> int:
        data = text.encode()
        self._align(len(data) + 1, 4)
        self._buf[0:0] = data + b"\x00"
        return self._push(struct.pack("<I", len(data)), 4)

    def struct_vector(self, items: list[bytes], alignment: int) -> int:
        raw = b"".join(items)
        self._align(len(raw), max(alignment, 4))
        self._buf[0:0] = raw
        return self._push(struct.pack("<I", len(items)), 4)

    def offset_vector(self, targets: list[int]) -> int:
        self._align(4 * len(targets), 4)
        end = self.used + 4 * len(targets)
        raw = b"".join(struct.pack("<I", end - 4 * i - t) for i, t in enumerate(targets))
        self._buf[0:0] = raw
        return self._push(struct.pack("<I", len(targets)), 4)

    def start_table(self) -> None:
        self._fields = []
        self._table_start = self.used

    def add_scalar(self, slot: int, fmt: str, value: int, default: int = 0) -> None:
        if value != default:
            self._fields.append(
                (slot, self._push(struct.pack("<" + fmt, value), struct.calcsize(fmt)))
            )

    def add_offset(self, slot: int, target: int) -> None:
        self._fields.append((slot, self._push_offset(target)))

    def end_table(self) -> int:
        table = self._push(b"\xf0\xf0\xf0\xf0", 4)
        vt_len = max((slot for slot, _ in self._fields), default=2) + 2
        slots = [0] * (vt_len // 2)
        slots[0], slots[1] = vt_len, table - self._table_start
        for slot, pos in self._fields:
            slots[slot // 2] = table - pos
        vtable = struct.pack(f"<{len(slots)}H", *slots)
        where = self._vtables.get(vtable)
        if where is None:
            self._buf[0:0] = vtable
            where = self._vtables[vtable] = self.used
        at = self.used - table
        self._buf[at : at + 4] = struct.pack("<i", where - table)
        self._fields = []
        return table

    def finish(self, root: int) -> bytes:
        self._align(4, self._min_align)
        self._push_offset(root)
        return bytes(self._buf)


def _field(fbb: _FlatBufferBuilder, name: str, is_float: bool) -> int:
    # arrow-rs convert.rs build_field / get_fb_field_type, in their call order.
    name_at = fbb.string(name)
    children = fbb.offset_vector([])
    fbb.start_table()
    if is_float:
        fbb.add_scalar(4, "h", _PRECISION_SINGLE)  # FloatingPoint.precision
    else:
        fbb.add_scalar(6, "B", 1)  # Int.is_signed
        fbb.add_scalar(4, "i", 32)  # Int.bitWidth
    type_at = fbb.end_table()
    fbb.start_table()
    fbb.add_offset(4, name_at)  # Field.name
    fbb.add_scalar(8, "B", _TYPE_FLOATING_POINT if is_float else _TYPE_INT)  # Field.type_type
    fbb.add_scalar(6, "B", 0)  # Field.nullable = false: the default, so omitted
    fbb.add_offset(14, children)  # Field.children
    fbb.add_offset(10, type_at)  # Field.type
    return fbb.end_table()


def _schema(fbb: _FlatBufferBuilder) -> int:
    fields = [_field(fbb, INDEX_COLUMN, False), _field(fbb, VALUE_COLUMN, True)]
    vector = fbb.offset_vector(fields)
    fbb.start_table()
    fbb.add_offset(6, vector)  # Schema.fields
    return fbb.end_table()


def _message(fbb: _FlatBufferBuilder, header_type: int, header: int, body_length: int) -> bytes:
    fbb.start_table()
    fbb.add_scalar(4, "h", _V5)  # Message.version
    fbb.add_scalar(6, "B", header_type)  # Message.header_type
    fbb.add_scalar(10, "q", body_length)  # Message.bodyLength
    fbb.add_offset(8, header)  # Message.header
    return fbb.finish(fbb.end_table())


def _schema_message() -> bytes:
    fbb = _FlatBufferBuilder()
    return _message(fbb, _HEADER_SCHEMA, _schema(fbb), 0)


def _record_batch_message(n: int, buffers: list[tuple[int, int]], body_length: int) -> bytes:
    fbb = _FlatBufferBuilder()
    buffer_vec = fbb.struct_vector([struct.pack("<qq", o, ln) for o, ln in buffers], 8)
    node_vec = fbb.struct_vector([struct.pack("<qq", n, 0)] * 2, 8)
    fbb.start_table()
    fbb.add_scalar(4, "q", n)  # RecordBatch.length
    fbb.add_offset(6, node_vec)  # RecordBatch.nodes
    fbb.add_offset(8, buffer_vec)  # RecordBatch.buffers
    batch = fbb.end_table()
    return _message(fbb, _HEADER_RECORD_BATCH, batch, body_length)


def _footer(block_offset: int, meta_length: int, body_length: int) -> bytes:
    fbb = _FlatBufferBuilder()
    dictionaries = fbb.struct_vector([], 8)
    block = struct.pack("<qi4xq", block_offset, meta_length, body_length)
    batches = fbb.struct_vector([block], 8)
    schema = _schema(fbb)
    fbb.start_table()
    fbb.add_scalar(4, "h", _V5)  # Footer.version
    fbb.add_offset(6, schema)  # Footer.schema
    fbb.add_offset(8, dictionaries)  # Footer.dictionaries
    fbb.add_offset(10, batches)  # Footer.recordBatches
    return fbb.finish(fbb.end_table())
