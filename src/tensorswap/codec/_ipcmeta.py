"""Bounds checks on an Arrow IPC record-batch message, read from its flatbuffer metadata.

pyarrow allocates a decompressed buffer of whatever size the 8-byte prefix of a compressed body
buffer claims before it notices the data is short. These checks read the record batch's
length and buffer table straight from the message metadata (Message.fbs: Message.header ->
RecordBatch {length, nodes, buffers, compression}) so callers can bound both before pyarrow
sees the body. The metadata has already passed pyarrow's flatbuffer verifier; every offset is
still bounds-checked here, and any inconsistency raises MalformedBlock.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from tensorswap.errors import MalformedBlock

_U8 = struct.Struct("<B")
_U16 = struct.Struct("<H")
_I32 = struct.Struct("<i")
_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")
_BUFFER = struct.Struct("<qq")  # org.apache.arrow.flatbuf.Buffer {offset: long, length: long}
_RECORD_BATCH = 3  # MessageHeader union tag
_UNCOMPRESSED = -1  # prefix of a body buffer left uncompressed by the writer


def _read(fmt: struct.Struct, buf: memoryview, pos: int) -> int:
    if pos < 0 or pos + fmt.size > len(buf):
        raise MalformedBlock(f"Arrow message metadata: offset {pos} outside {len(buf)} bytes")
    return int(fmt.unpack_from(buf, pos)[0])


class _Table:
    """A flatbuffer table: a position and its vtable."""

    def __init__(self, buf: memoryview, pos: int) -> None:
        self.buf = buf
        self.pos = pos
        self.vtable = pos - _read(_I32, buf, pos)
        self.vtable_len = _read(_U16, buf, self.vtable)

    def _field(self, index: int) -> int | None:
        slot = 4 + 2 * index
        if slot + 2 > self.vtable_len:
            return None
        offset = _read(_U16, self.buf, self.vtable + slot)
        return self.pos + offset if offset else None

    def scalar(self, fmt: struct.Struct, index: int, default: int = 0) -> int:
        pos = self._field(index)
        return default if pos is None else _read(fmt, self.buf, pos)

    def table(self, index: int) -> _Table | None:
        pos = self._field(index)
        return None if pos is None else _Table(self.buf, pos + _read(_U32, self.buf, pos))

    def vector(self, index: int) -> tuple[int, int]:
        """(position of the first element, element count); (0, 0) when absent."""
        pos = self._field(index)
        if pos is None:
            return 0, 0
        start = pos + _read(_U32, self.buf, pos)
        return start + 4, _read(_U32, self.buf, start)


@dataclass(frozen=True)
class BatchLayout:
    """What a record batch message declares: its row count and its body buffers."""

    length: int
    buffers: tuple[tuple[int, int], ...]  # (offset, length) within the message body
    compressed: bool


def batch_layout(metadata: memoryview) -> BatchLayout:
    """The layout declared by a record batch message's flatbuffer metadata."""
    root = _Table(metadata, _read(_U32, metadata, 0))
    if root.scalar(_U8, 1) != _RECORD_BATCH:
        raise MalformedBlock("Arrow message is not a record batch")
    batch = root.table(2)
    if batch is None:
        raise MalformedBlock("Arrow record batch message has no header")
    start, count = batch.vector(2)
    if count * _BUFFER.size > len(metadata):
        raise MalformedBlock(f"Arrow record batch declares {count} buffers in a short message")
    buffers = []
    for i in range(count):
        pos = start + i * _BUFFER.size
        if pos < 0 or pos + _BUFFER.size > len(metadata):
            raise MalformedBlock("Arrow record batch buffer table runs past its message")
        offset, length = _BUFFER.unpack_from(metadata, pos)
        buffers.append((int(offset), int(length)))
    return BatchLayout(
        length=batch.scalar(_I64, 0),
        buffers=tuple(buffers),
        compressed=batch.table(3) is not None,
    )


def check_decompressed_sizes(layout: BatchLayout, body: memoryview, max_bytes: int) -> int:
    """Refuse any compressed body buffer whose declared decompressed size exceeds `max_bytes`;
    return the sum of the sizes declared (0 for an uncompressed batch).

    Runs before pyarrow decompresses (and so allocates) anything.
    """
    total = 0
    if not layout.compressed:
        return total
    for offset, length in layout.buffers:
        if length == 0:
            continue  # empty buffers are not decompressed
        if offset < 0 or length < 8 or offset + length > len(body):
            raise MalformedBlock(
                f"Arrow compressed buffer at {offset} (+{length}) outside a {len(body)}-byte body"
            )
        claimed = _read(_I64, body, offset)
        if claimed == _UNCOMPRESSED:
            continue
        if not 0 <= claimed <= max_bytes:
            raise MalformedBlock(
                f"Arrow compressed buffer claims {claimed} decompressed bytes, at most "
                f"{max_bytes} are allowed here"
            )
        total += claimed
    return total


def check_ipc_messages(data: memoryview, max_bytes: int) -> None:
    """Walk the messages of an Arrow IPC stream (or a file's, after its 8-byte magic) and
    refuse it when its compressed record batches declare more than `max_bytes` decompressed in
    all: what pyarrow would allocate to read it. Uncompressed batches cost no more than the
    bytes they occupy. Damaged framing raises MalformedBlock.
    """
    import pyarrow as pa

    reader = pa.ipc.MessageReader.open_stream(pa.py_buffer(data))
    budget = max_bytes
    while True:
        try:
            message = reader.read_next_message()
        except StopIteration:
            return
        except (pa.ArrowException, OSError, ValueError, EOFError) as exc:
            raise MalformedBlock(f"damaged Arrow IPC message: {exc}") from exc
        if message is None:
            return
        if message.type != "record batch":
            continue
        body = memoryview(message.body) if message.body is not None else memoryview(b"")
        layout = batch_layout(memoryview(message.metadata))
        budget -= check_decompressed_sizes(layout, body, budget)
        if budget < 0:
            raise MalformedBlock(
                f"Arrow IPC data declares over {max_bytes} decompressed bytes in all"
            )
