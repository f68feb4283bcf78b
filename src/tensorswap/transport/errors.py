"""Transport errors: the leaves of the TransportError branch (itself under WireError).

::

    WireError
    └── TransportError
        ├── ConnectionFailed       connect/read/write failed at the OS level (refused, reset, ...)
        │   └── ServerBusy         the server is at its connection cap and said so; retry later
        ├── PeerTimeout            (also TimeoutError) connect or a read/send took too long
        ├── TransportClosed        (also RuntimeError) local use of a closed transport
        └── UnexpectedEof          the peer closed inside a read that had to be filled

``tensorswap.wire.errors`` re-exports these very classes.
"""

from __future__ import annotations

from tensorswap.errors import TransportError

__all__ = [
    "ConnectionFailed",
    "PeerTimeout",
    "ServerBusy",
    "TransportClosed",
    "TransportError",
    "UnexpectedEof",
]


class ConnectionFailed(TransportError):
    """An OS-level failure connecting, reading or writing (refused, reset, broken pipe)."""

    def __init__(self, peer: str, detail: str) -> None:
        self.peer = peer
        self.detail = detail
        super().__init__(f"connection to {peer} failed: {detail}")


class ServerBusy(ConnectionFailed):
    """The server is at its connection cap with no idle connection to close, and said so.

    Nothing was sent or stored; connecting again later may succeed. ``reason`` is the
    server's own explanation (for a BlockServer: ``at its connection cap (N); retry later``).
    """

    def __init__(self, peer: str, reason: str) -> None:
        self.peer = peer
        self.reason = reason
        self.detail = f"server busy: {reason}"
        TransportError.__init__(self, f"{self.detail} (server {peer or 'peer'})")


class PeerTimeout(TransportError, TimeoutError):
    """The peer did not connect or deliver a frame in time; the connection is dropped."""

    def __init__(self, what: str, seconds: float, peer: str = "") -> None:
        self.what = what
        self.seconds = seconds
        self.peer = peer
        who = f" from {peer}" if peer else ""
        super().__init__(f"timed out after {seconds:g}s waiting for {what}{who}")


class TransportClosed(TransportError, RuntimeError):
    """This side already closed the transport; nothing more can be sent or received."""

    def __init__(self, peer: str = "") -> None:
        self.peer = peer
        super().__init__(f"transport to {peer or 'peer'} is closed")


class UnexpectedEof(TransportError):
    """The peer closed the stream in the middle of a read that had to be filled (a frame)."""

    def __init__(self, what: str, received: int, expected: int) -> None:
        self.what = what
        self.received = received
        self.expected = expected
        super().__init__(
            f"connection closed inside {what}: received {received} of {expected} bytes"
        )
