"""Re-exports of ``tensorswap.transport``: TCP/TLS transports and the capped listener."""

from tensorswap.transport.listener import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MIN_IDLE,
    TcpListener,
    serve_tcp,
)
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
    "TcpListener",
    "TcpTransport",
    "connect_tcp",
    "serve_tcp",
]
