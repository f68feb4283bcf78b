"""BlockServer's counters, and the codes its ERROR frames give failures."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tensorswap.errors import StoreError, TensorSwapError
from tensorswap.wire._budget import DEFAULT_MAX_INFLIGHT_BYTES
from tensorswap.wire.errors import (
    AuthenticationFailed,
    BlockHashMismatch,
    ChecksumMismatch,
    ConnectionFailed,
    FrameTooLarge,
    OverBudget,
    PeerTimeout,
    ProtocolViolation,
    StreamEnded,
    TransportClosed,
)
from tensorswap.wire.transport import Transport

__all__ = ["ServerStats", "error_code"]


@dataclass
class ServerStats:
    """Counters over the server's lifetime (mutated by the event loop only).

    ``bytes_in`` / ``bytes_out``: wire bytes over every connection so far, open ones included.
    """

    connections: int = 0
    blocks_stored: int = 0
    bytes_stored: int = 0
    roots_committed: int = 0
    blocks_served: int = 0
    failed_connections: int = 0
    requests: int = 0
    ended_bytes_in: int = 0
    ended_bytes_out: int = 0
    inflight_bytes: int = 0
    """Bytes received, decompressed or decoded and not yet stored, now (all connections)."""
    inflight_peak_bytes: int = 0
    """The most ever in flight at once; never above ``inflight_limit_bytes``."""
    inflight_limit_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES
    inflight_waits: int = 0
    """Frames a connection had to wait for (it stopped reading) until others released bytes."""
    inflight_refused: int = 0
    """Frames refused outright (``over_budget``): more than the whole limit at once."""
    pool_in_use_bytes: int = 0
    """Bytes of the process's slab pool in use now (payloads, sums, loaded tensors)."""
    pool_idle_bytes: int = 0
    """Bytes the pool keeps idle for reuse (freed after ``IDLE_SECONDS`` unused)."""
    pool_working_set_bytes: int = 0
    """The most of the pool in use at once since it was last idle: what it may keep."""

    def __post_init__(self) -> None:
        self._open: set[Transport] = set()

    def opened(self, transport: Transport) -> None:
        """Count a connection that is now being served."""
        self.connections += 1
        self._open.add(transport)

    def ended(self, transport: Transport) -> None:
        """Count a served connection's end; its bytes move to ``ended_bytes_*``."""
        self._open.discard(transport)
        self.ended_bytes_in += transport.bytes_received
        self.ended_bytes_out += transport.bytes_sent

    def serving(self, peer: str) -> bool:
        """Whether a connection from the client address ``peer`` is being served now."""
        return any(t.peer == peer for t in self._open)

    @property
    def open_connections(self) -> int:
        return len(self._open)

    @property
    def bytes_in(self) -> int:
        return self.ended_bytes_in + sum(t.bytes_received for t in self._open)

    @property
    def bytes_out(self) -> int:
        return self.ended_bytes_out + sum(t.bytes_sent for t in self._open)


_NOT_REPORTED = (AuthenticationFailed, StreamEnded, ConnectionFailed, TransportClosed)
"""Failures not answered with an ERROR frame: the handshake already told the client, or the
connection no longer works."""


def error_code(exc: BaseException) -> str:
    """The Error-message code a failure is reported to the peer with."""
    for kind, code in _CODES:
        if isinstance(exc, kind):
            return code
    return "internal"


_CODES: Sequence[tuple[type[BaseException], str]] = (
    (AuthenticationFailed, "auth_failed"),
    (BlockHashMismatch, "block_hash_mismatch"),
    (ChecksumMismatch, "checksum_mismatch"),
    (OverBudget, "over_budget"),
    (FrameTooLarge, "frame_too_large"),
    (ProtocolViolation, "protocol_violation"),
    (PeerTimeout, "timeout"),
    (StoreError, "store_error"),
    (TensorSwapError, "error"),
)


def _without_frames(exc: BaseException) -> BaseException:
    """``exc`` (and the exceptions chained to it) without tracebacks, to be kept: a traceback
    holds its frames' variables, such as the block a failed check was given, and ``errors``
    would keep up to 100 of those (as many blocks of up to 256 MiB) alive."""
    todo: list[BaseException | None] = [exc]
    seen: set[int] = set()
    while todo:
        item = todo.pop()
        if item is None or id(item) in seen:
            continue
        seen.add(id(item))
        item.__traceback__ = None
        todo += [item.__cause__, item.__context__]
    return exc
