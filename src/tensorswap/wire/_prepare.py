"""BLOCK frames prepared for sending: checksummed (and compressed) off the event loop."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from tensorswap.cid import Cid
from tensorswap.wire.frames import (
    NO_PAYLOAD_CRC,
    Compression,
    FrameHeader,
    FrameKind,
    compress,
    crc32c,
    crc32c_combine,
    pack_block_prefix,
)

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["PreparedBlock", "prepare_block"]


@dataclass(frozen=True, slots=True)
class PreparedBlock:
    """A BLOCK frame ready to send: header, prefix and body parts (built off the event loop).

    The parts are sent back to back and never joined: they may be views of a caller's
    memory (a tensor's values), which must not change until the frame is sent.
    """

    header: bytes
    prefix: bytes
    parts: tuple[Buffer, ...]
    raw_len: int

    @property
    def wire_bytes(self) -> int:
        body = sum(memoryview(part).nbytes for part in self.parts)
        return len(self.header) + len(self.prefix) + body


def _flat(data: Buffer) -> memoryview:
    view = data if isinstance(data, memoryview) else memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def prepare_block(
    cid: Cid,
    data: Buffer | Sequence[Buffer],
    compression: Compression = Compression.NONE,
    stream_id: int = 0,
    *,
    data_crc: int | None = None,
    crc: bool = True,
) -> PreparedBlock:
    """Checksum (and compress, if asked) a block given whole or as consecutive parts.

    CPU-bound, safe to run in a worker thread. Parts are checksummed in place, not copied,
    unless compression is asked for; compression is dropped for a block it would not shrink.
    ``data_crc``, the CRC32C of the (uncompressed) parts if the caller already computed it,
    saves reading them again. Without ``crc`` the frame carries none (``NO_PAYLOAD_CRC``:
    only for a peer that accepted it, ``FrameConnection.send_lean``).
    """
    if isinstance(data, list | tuple):
        parts = tuple(_flat(part) for part in data)
    else:
        parts = (_flat(cast("Buffer", data)),)
    raw_len = sum(part.nbytes for part in parts)
    if compression is not Compression.NONE:
        whole = parts[0] if len(parts) == 1 else memoryview(b"".join(parts))
        packed = compress(whole, compression)
        if memoryview(packed).nbytes < raw_len:
            parts = (_flat(packed),)
        else:
            compression = Compression.NONE
    prefix = pack_block_prefix(cid, raw_len)
    length = len(prefix) + sum(part.nbytes for part in parts)
    flags = int(compression)
    if not crc:
        value, flags = 0, flags | NO_PAYLOAD_CRC
    elif data_crc is not None and compression is Compression.NONE:
        value = crc32c_combine(crc32c(prefix), data_crc, raw_len)
    else:
        value = crc32c(prefix)
        for part in parts:
            value = crc32c(part, value)
    header = FrameHeader(FrameKind.BLOCK, length, value, stream_id, flags).pack()
    return PreparedBlock(header, prefix, parts, raw_len)
