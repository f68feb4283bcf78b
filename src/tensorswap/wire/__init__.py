"""Wire: frames, checksums, async streams of blocks and gradients, handshake/auth, TLS."""

from tensorswap.wire.auth import (
    client_ssl_context,
    load_key,
    server_ssl_context,
)
from tensorswap.wire.client import BlockClient, PullResult, PushResult
from tensorswap.wire.connection import FrameConnection, Timeouts, WireLimits
from tensorswap.wire.errors import (
    AuthenticationFailed,
    BlockHashMismatch,
    ChecksumMismatch,
    ChunkIndexOutOfRange,
    ConnectionFailed,
    DuplicateChunk,
    FrameTooLarge,
    IncompleteStream,
    InvalidChunkPayload,
    PeerTimeout,
    ProtocolViolation,
    RemoteError,
    StreamEnded,
    TotalChunksMismatch,
    TransportClosed,
    UnexpectedEof,
)
from tensorswap.wire.frames import Compression, FrameHeader, FrameKind
from tensorswap.wire.ipfrs import (
    DEFAULT_CHUNK_SIZE,
    GradientChunk,
    GradientReassembler,
    GradientStreamSession,
    IpfrsFrameHeader,
    IpfrsLimits,
    chunk_count,
)
from tensorswap.wire.server import AppRequest, BlockServer, RequestHandler, ServerStats
from tensorswap.wire.tcp import TcpListener, TcpTransport, connect_tcp, serve_tcp
from tensorswap.wire.transport import MemoryTransport, Transport, memory_pair

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "AppRequest",
    "AuthenticationFailed",
    "BlockClient",
    "BlockHashMismatch",
    "BlockServer",
    "ChecksumMismatch",
    "ChunkIndexOutOfRange",
    "Compression",
    "ConnectionFailed",
    "DuplicateChunk",
    "FrameConnection",
    "FrameHeader",
    "FrameKind",
    "FrameTooLarge",
    "GradientChunk",
    "GradientReassembler",
    "GradientStreamSession",
    "IncompleteStream",
    "InvalidChunkPayload",
    "IpfrsFrameHeader",
    "IpfrsLimits",
    "MemoryTransport",
    "PeerTimeout",
    "ProtocolViolation",
    "PullResult",
    "PushResult",
    "RemoteError",
    "RequestHandler",
    "ServerStats",
    "StreamEnded",
    "TcpListener",
    "TcpTransport",
    "Timeouts",
    "TotalChunksMismatch",
    "Transport",
    "TransportClosed",
    "UnexpectedEof",
    "WireLimits",
    "chunk_count",
    "client_ssl_context",
    "connect_tcp",
    "load_key",
    "memory_pair",
    "serve_tcp",
    "server_ssl_context",
]
