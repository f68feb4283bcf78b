"""Transport: byte streams (TCP, TLS, in-memory) and the capped TCP listener, under wire and delta.

One interface (``Transport``), its implementations (``TcpTransport`` from ``connect_tcp`` or a
``TcpListener``, ``MemoryTransport`` from ``memory_pair``), one listener that owns the
connection cap and the eviction of idle connections (``serve_tcp``), and the TransportError
branch of errors. Imports nothing above ``tensorswap.errors``.
"""

from tensorswap.transport.base import Transport, byte_view
from tensorswap.transport.errors import (
    ConnectionFailed,
    PeerTimeout,
    ServerBusy,
    TransportClosed,
    TransportError,
    UnexpectedEof,
)
from tensorswap.transport.listener import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MIN_IDLE,
    Handler,
    TcpListener,
    serve_tcp,
)
from tensorswap.transport.memory import MemoryTransport, memory_pair
from tensorswap.transport.tcp import (
    DIRECT_RECEIVE_BYTES,
    DIRECT_SEND_BYTES,
    TcpTransport,
    connect_tcp,
)

__all__ = [
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_MIN_IDLE",
    "DIRECT_RECEIVE_BYTES",
    "DIRECT_SEND_BYTES",
    "ConnectionFailed",
    "Handler",
    "MemoryTransport",
    "PeerTimeout",
    "ServerBusy",
    "TcpListener",
    "TcpTransport",
    "Transport",
    "TransportClosed",
    "TransportError",
    "UnexpectedEof",
    "byte_view",
    "connect_tcp",
    "memory_pair",
    "serve_tcp",
]
