"""Wire errors: the leaves of the WireError branch, each carrying the facts that failed.

::

    WireError
    ├── StreamEnded            the peer closed cleanly at a frame boundary before any frame
    ├── TransportError         (tensorswap.transport.errors; re-exported here)
    │   ├── UnexpectedEof      the peer closed inside a frame (received < expected bytes)
    │   ├── ConnectionFailed   connect/read/write failed at the OS level (refused, reset, ...)
    │   │   ├── ServerBusy     the server is at its connection cap and said so (ERROR busy)
    │   │   └── ConnectionBroken  a client's connection given up (a frame cut by a cancel, a
    │   │                      failure inside an answer) and no way to dial it again
    │   ├── PeerTimeout        (also TimeoutError) connect or a frame read took too long
    │   └── TransportClosed    (also RuntimeError) local use of a closed transport
    ├── ProtocolViolation      the peer sent bytes or messages the protocol forbids
    │   ├── FrameTooLarge      a length or count above the configured limit (refused unread)
    │   │   └── OverBudget     a frame needing more memory than the server's in-flight budget
    │   ├── TotalChunksMismatch / DuplicateChunk / ChunkIndexOutOfRange   (ipfrs streams)
    │   └── InvalidChunkPayload  a chunk payload that is not an ipfrs gradient file
    ├── ChecksumMismatch       CRC-32 (ipfrs) or CRC32C (tensorswap) of a payload differs
    ├── IncompleteStream       the stream ended with chunks missing (received of total)
    ├── BlockHashMismatch      a received block does not hash to the CID it came with
    ├── AuthenticationFailed   wrong, missing or unexpected key in the handshake
    └── RemoteError            the peer answered with an Error message (code, message)
        └── RemoteOverBudget   ... with code "over_budget": a block too large for its budget
"""

from __future__ import annotations

from tensorswap.errors import TransportError, WireError
from tensorswap.transport.errors import (
    ConnectionFailed,
    PeerTimeout,
    ServerBusy,
    TransportClosed,
    UnexpectedEof,
)

__all__ = [
    "AuthenticationFailed",
    "BlockHashMismatch",
    "ChecksumMismatch",
    "ChunkIndexOutOfRange",
    "ConnectionBroken",
    "ConnectionFailed",
    "DuplicateChunk",
    "FrameTooLarge",
    "IncompleteStream",
    "InvalidChunkPayload",
    "OverBudget",
    "PeerTimeout",
    "ProtocolViolation",
    "RemoteError",
    "RemoteOverBudget",
    "ServerBusy",
    "StreamEnded",
    "TotalChunksMismatch",
    "TransportClosed",
    "TransportError",
    "UnexpectedEof",
    "WireError",
    "remote_error",
]


class StreamEnded(WireError):
    """The peer closed the stream at a frame boundary before sending the first frame.

    Distinct from an empty result: a caller that expected data must decide what an idle,
    closed connection means (the ipfrs seed silently returned an empty gradient here).
    """

    def __init__(self, what: str = "stream") -> None:
        self.what = what
        super().__init__(f"{what} ended before the first frame (peer closed the connection)")


class ConnectionBroken(ConnectionFailed):
    """A client's connection is out of frame sync and was given up: a send cut inside a
    frame (a cancel during a write), or a failure in the middle of an answer. ``reason``
    says which. Raised by the calls after it on a client that cannot dial again (one opened
    over a given Transport); one from ``BlockClient.connect`` reconnects instead."""

    def __init__(self, peer: str, reason: str) -> None:
        self.reason = reason
        super().__init__(peer, f"connection broken ({reason}); connect again")


class ProtocolViolation(WireError):
    """The peer sent bytes or a message sequence that the protocol does not allow."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"protocol violation: {reason}")


class FrameTooLarge(ProtocolViolation):
    """A length or count read from the peer exceeds its limit; nothing was allocated for it."""

    def __init__(self, what: str, length: int, limit: int) -> None:
        self.what = what
        self.length = length
        self.limit = limit
        ProtocolViolation.__init__(self, f"{what} {length} exceeds the limit {limit}")


class OverBudget(FrameTooLarge):
    """A frame would need more bytes in memory at once than the whole in-flight budget.

    Raised before anything of it is allocated: it could never be received, however long it
    waited for other connections to release their share.
    """

    def __init__(self, what: str, length: int, limit: int) -> None:
        self.what = what
        self.length = length
        self.limit = limit
        ProtocolViolation.__init__(
            self, f"{what} needs {length} bytes in memory, above the in-flight budget {limit}"
        )


class TotalChunksMismatch(ProtocolViolation):
    """A chunk claims a different total_chunks than the first chunk of its stream."""

    def __init__(self, chunk_index: int, expected: int, actual: int) -> None:
        self.chunk_index = chunk_index
        self.expected = expected
        self.actual = actual
        ProtocolViolation.__init__(
            self, f"chunk {chunk_index} says total_chunks={actual}, the stream said {expected}"
        )


class DuplicateChunk(ProtocolViolation):
    """The same chunk index arrived twice in one stream."""

    def __init__(self, chunk_index: int) -> None:
        self.chunk_index = chunk_index
        ProtocolViolation.__init__(self, f"chunk {chunk_index} received twice")


class ChunkIndexOutOfRange(ProtocolViolation):
    """A chunk index not below total_chunks (total_chunks = 0 makes every index out of range)."""

    def __init__(self, chunk_index: int, total: int) -> None:
        self.chunk_index = chunk_index
        self.total = total
        ProtocolViolation.__init__(
            self, f"chunk index {chunk_index} out of range for total_chunks={total}"
        )


class InvalidChunkPayload(ProtocolViolation):
    """A chunk's payload (checksum correct) is not a valid ipfrs gradient Arrow IPC file."""

    def __init__(self, chunk_index: int, detail: str) -> None:
        self.chunk_index = chunk_index
        self.detail = detail
        ProtocolViolation.__init__(
            self, f"chunk {chunk_index} is not a valid gradient file: {detail}"
        )


class ChecksumMismatch(WireError):
    """A payload's checksum differs from the one its frame carried.

    ``chunk_index`` is the ipfrs chunk index, or None for a tensorswap frame (then
    ``stream_id`` names it); ``algorithm`` is ``"crc32"`` (IEEE, ipfrs) or ``"crc32c"``.
    """

    def __init__(
        self,
        chunk_index: int | None,
        expected: int,
        actual: int,
        *,
        algorithm: str = "crc32",
        what: str = "",
    ) -> None:
        self.chunk_index = chunk_index
        self.expected = expected
        self.actual = actual
        self.algorithm = algorithm
        self.what = what
        where = what or (f"chunk {chunk_index}" if chunk_index is not None else "frame")
        super().__init__(
            f"{algorithm} checksum mismatch on {where}: expected {expected:#010x}, "
            f"got {actual:#010x}"
        )


class IncompleteStream(WireError):
    """A chunk stream ended (or was decoded) with chunks missing."""

    def __init__(self, received: int, total: int | None) -> None:
        self.received = received
        self.total = total
        shown = "an unknown number of" if total is None else str(total)
        super().__init__(f"incomplete chunk stream: received {received} of {shown} chunks")


class BlockHashMismatch(WireError):
    """A block received from a peer does not hash to the CID it was sent under; not stored."""

    def __init__(self, cid: object, actual: object) -> None:
        self.cid = cid
        self.actual = actual
        super().__init__(f"received block does not match its CID {cid}: it hashes to {actual}")


class AuthenticationFailed(WireError):
    """The handshake failed: wrong key, a key missing on one side, or a forged answer."""

    def __init__(self, peer: str, reason: str) -> None:
        self.peer = peer
        self.reason = reason
        super().__init__(f"authentication with {peer or 'peer'} failed: {reason}")


class RemoteError(WireError):
    """The peer reported an error instead of the expected answer."""

    def __init__(self, code: str, message: str, peer: str = "") -> None:
        self.code = code
        self.message = message
        self.peer = peer
        who = f" {peer}" if peer else ""
        super().__init__(f"peer{who} reported {code}: {message}")


class RemoteOverBudget(RemoteError):
    """The server refused a block it could never hold in memory (code ``over_budget``).

    Retrying does not help: send smaller blocks (``chunk_bytes``) or raise the server's
    ``max_inflight_bytes``.
    """


_REMOTE_CODES: dict[str, type[RemoteError]] = {"over_budget": RemoteOverBudget}


def remote_error(code: str, message: str, peer: str = "") -> RemoteError:
    """The RemoteError for an Error message: its precise subclass where its code has one."""
    return _REMOTE_CODES.get(code, RemoteError)(code, message, peer)
