"""Connection handshake: mutual HMAC-SHA256 challenge-response on a shared key; TLS contexts."""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path

from tensorswap.transport import Transport
from tensorswap.wire.connection import FrameConnection
from tensorswap.wire.errors import (
    AuthenticationFailed,
    ProtocolViolation,
    RemoteError,
    ServerBusy,
    StreamEnded,
)
from tensorswap.wire.frames import PROTOCOL_VERSION
from tensorswap.wire.messages import Error, Hello, Ready, Welcome

__all__ = [
    "BUSY_CODE",
    "HANDSHAKE_MESSAGE_BYTES",
    "KEY_ENV",
    "NONCE_BYTES",
    "busy_refusal",
    "client_handshake",
    "client_proof",
    "client_ssl_context",
    "load_key",
    "server_handshake",
    "server_proof",
    "server_ssl_context",
]

NONCE_BYTES = 32
HANDSHAKE_MESSAGE_BYTES = 4096
"""Largest handshake message payload (Welcome, Hello, Ready, or an Error instead) accepted:
nothing larger is allocated for a peer that has not authenticated."""
KEY_ENV = "TENSORSWAP_KEY"
"""Environment variable the CLI reads a shared key from (the key file option wins)."""
BUSY_CODE = "busy"
"""Error code a server at its connection cap sends in place of its Welcome (ServerBusy)."""
_CLIENT_LABEL = b"tensorswap/1 client proof\x00"
_SERVER_LABEL = b"tensorswap/1 server proof\x00"


def client_proof(key: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """HMAC-SHA256(key, label || server_nonce || client_nonce): the client knows the key."""
    return hmac.new(key, _CLIENT_LABEL + server_nonce + client_nonce, hashlib.sha256).digest()


def server_proof(key: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """The server's answer; a different label, so a proof cannot be reflected back."""
    return hmac.new(key, _SERVER_LABEL + server_nonce + client_nonce, hashlib.sha256).digest()


def load_key(path: str | os.PathLike[str] | None = None, *, env: str = KEY_ENV) -> bytes | None:
    """A shared key from a file (bytes, trailing newline stripped) or ``$TENSORSWAP_KEY``."""
    if path is not None:
        key = Path(path).read_bytes().rstrip(b"\r\n")
    else:
        text = os.environ.get(env)
        if text is None:
            return None
        key = text.encode()
    if not key:
        raise ValueError("the shared key is empty")
    return key


def busy_refusal(max_connections: int) -> Callable[[Transport], Awaitable[None]]:
    """A listener's ``on_refused`` for the tensorswap framing: ``ERROR busy`` before closing.

    Sent in place of the Welcome, so a client learns why it was refused (``ServerBusy``)
    instead of seeing the connection close before the handshake.
    """

    async def refuse(transport: Transport) -> None:
        conn = FrameConnection(transport)
        reason = f"at its connection cap ({max_connections}); retry later"
        await conn.send_error(BUSY_CODE, reason)

    return refuse


async def server_handshake(
    conn: FrameConnection,
    key: bytes | None,
    *,
    name: str = "tensorswap",
    operator_key: bytes | None = None,
    lean_blocks: bool = True,
    chunk_bytes: int = 0,
) -> Hello:
    """Run the server side: Welcome, check the client's Hello, answer Ready.

    With a key, a client must prove it (else AuthenticationFailed, after telling the client
    with an Error frame); the Ready carries the server's own proof. A client that proves
    ``operator_key`` instead (a second secret, only with ``key``) is the operator: the
    server proves that key back and marks the connection (``conn.operator``), so the
    applications above may show it what peers are not shown. Nothing else is read from the
    client before this returns. ``lean_blocks``: offer to take, and if the client offers the
    same, send, BLOCK frames without a payload CRC32C (``conn.accept_lean`` / ``send_lean``).
    ``chunk_bytes``: said in the Welcome (``Welcome.chunk_bytes``).
    """
    if operator_key is not None and (key is None or not operator_key or operator_key == key):
        raise ValueError("an operator key needs a shared key, and must differ from it")
    nonce = secrets.token_bytes(NONCE_BYTES)
    seconds = conn.timeouts.handshake
    await conn.send_message(
        Welcome(
            protocol=PROTOCOL_VERSION,
            nonce=nonce,
            auth=key is not None,
            max_block_bytes=conn.limits.max_block_bytes,
            server=name,
            lean_blocks=lean_blocks,
            chunk_bytes=chunk_bytes,
        )
    )
    conn.accept_lean = lean_blocks
    try:
        hello, _ = await conn.receive_message(
            Hello, timeout=seconds, max_payload=HANDSHAKE_MESSAGE_BYTES, whole_frame=True
        )
    except StreamEnded as exc:
        raise AuthenticationFailed(conn.peer, "client closed during the handshake") from exc
    if hello.protocol != PROTOCOL_VERSION:
        await conn.send_error("version", f"server speaks protocol {PROTOCOL_VERSION}")
        raise ProtocolViolation(f"client speaks protocol {hello.protocol}")
    if len(hello.nonce) != NONCE_BYTES:
        raise ProtocolViolation(f"client nonce of {len(hello.nonce)} bytes")
    conn.send_lean = lean_blocks and hello.lean_blocks
    if key is None:
        await conn.send_message(Ready(mac=None))
        return hello
    if hello.mac is None:
        reason = "this server requires a shared key; the client sent none"
        await conn.send_error("auth_required", reason)
        raise AuthenticationFailed(conn.peer, reason)
    proven = key
    if not hmac.compare_digest(hello.mac, client_proof(key, nonce, hello.nonce)):
        if operator_key is None or not hmac.compare_digest(
            hello.mac, client_proof(operator_key, nonce, hello.nonce)
        ):
            reason = "wrong shared key (client proof does not verify)"
            await conn.send_error("auth_failed", reason)
            raise AuthenticationFailed(conn.peer, reason)
        proven, conn.operator = operator_key, True
    await conn.send_message(Ready(mac=server_proof(proven, nonce, hello.nonce)))
    return hello


async def client_handshake(
    conn: FrameConnection, key: bytes | None, *, name: str = "tensorswap", lean_blocks: bool = True
) -> Welcome:
    """Run the client side; returns the server's Welcome once both sides are satisfied.

    Raises AuthenticationFailed when the server wants a key and none is configured, when a
    key is configured but the server does not authenticate (a server without the key could
    be anyone), when the server refuses the proof, or when the server's proof is wrong;
    ServerBusy when the server answers ``ERROR busy`` (at its connection cap) instead.
    ``lean_blocks`` as for ``server_handshake``.
    """
    seconds = conn.timeouts.handshake
    try:
        welcome, _ = await conn.receive_message(
            Welcome, timeout=seconds, max_payload=HANDSHAKE_MESSAGE_BYTES, whole_frame=True
        )
    except StreamEnded as exc:
        raise AuthenticationFailed(conn.peer, "server closed before its welcome") from exc
    except RemoteError as exc:
        if exc.code == BUSY_CODE:
            raise ServerBusy(conn.peer, exc.message) from exc
        raise
    if welcome.protocol != PROTOCOL_VERSION:
        raise ProtocolViolation(f"server speaks protocol {welcome.protocol}")
    if len(welcome.nonce) != NONCE_BYTES:
        raise ProtocolViolation(f"server nonce of {len(welcome.nonce)} bytes")
    if welcome.auth and key is None:
        raise AuthenticationFailed(conn.peer, "the server requires a shared key; none is set")
    if key is not None and not welcome.auth:
        raise AuthenticationFailed(
            conn.peer, "a key is set but the server does not authenticate; refusing it"
        )
    nonce = secrets.token_bytes(NONCE_BYTES)
    mac = client_proof(key, welcome.nonce, nonce) if key is not None else None
    hello = Hello(
        protocol=PROTOCOL_VERSION, nonce=nonce, mac=mac, client=name, lean_blocks=lean_blocks
    )
    conn.accept_lean = lean_blocks
    await conn.send_message(hello)
    try:
        frame = await conn.receive_frame(
            timeout=seconds, max_payload=HANDSHAKE_MESSAGE_BYTES, whole_frame=True
        )
        ready = conn.expect(frame, Ready, Error)
    except StreamEnded as exc:
        raise AuthenticationFailed(conn.peer, "server closed during the handshake") from exc
    if isinstance(ready, Error):
        if ready.code.startswith("auth"):
            raise AuthenticationFailed(conn.peer, f"server refused: {ready.message}")
        raise RemoteError(ready.code, ready.message, conn.peer)
    if not isinstance(ready, Ready):
        raise ProtocolViolation(f"expected Ready, got {type(ready).__name__}")
    if key is not None:
        expected = server_proof(key, welcome.nonce, nonce)
        if ready.mac is None or not hmac.compare_digest(ready.mac, expected):
            raise AuthenticationFailed(conn.peer, "the server's proof does not verify")
    conn.send_lean = lean_blocks and welcome.lean_blocks
    return welcome


def server_ssl_context(
    certfile: str | os.PathLike[str],
    keyfile: str | os.PathLike[str] | None = None,
    *,
    client_ca: str | os.PathLike[str] | None = None,
) -> ssl.SSLContext:
    """A TLS server context (TLS 1.2+); with ``client_ca``, clients must present a cert."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(certfile, keyfile)
    if client_ca is not None:
        ctx.load_verify_locations(client_ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_ssl_context(
    cafile: str | os.PathLike[str] | None = None,
    *,
    certfile: str | os.PathLike[str] | None = None,
    keyfile: str | os.PathLike[str] | None = None,
    check_hostname: bool = True,
) -> ssl.SSLContext:
    """A TLS client context trusting ``cafile`` (system roots when None), hostname checked."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=cafile)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = check_hostname
    if certfile is not None:
        ctx.load_cert_chain(certfile, keyfile)
    return ctx
