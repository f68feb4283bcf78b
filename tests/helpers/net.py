"""Helpers shared by the network tests: loopback pairs, certificates, servers, ipc paths, clocks.

Plain functions and context managers; the pytest fixtures built on them live in conftest.py.
Everything binds 127.0.0.1 port 0 and closes what it opened, also when the test fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import ssl as ssl_module
import subprocess
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

import pytest

from tensorswap.transport import Transport, connect_tcp, memory_pair, serve_tcp
from tensorswap.wire.auth import client_ssl_context, server_ssl_context
from tensorswap.wire.connection import FrameConnection
from tensorswap.wire.messages import Error

Pair = tuple[Transport, Transport]
CertFiles = tuple[Path, Path]


def make_cert(directory: Path, *, san: bool = True) -> CertFiles:
    """A self-signed EC certificate for localhost (and 127.0.0.1 when ``san``), openssl CLI.

    Returns (cert.pem, key.pem) in ``directory``; skips the test where openssl is missing.
    """
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not available to make a test certificate")
    cert, key = directory / "cert.pem", directory / "key.pem"
    names = ["-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"] if san else []
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
            "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key), "-out", str(cert),
            "-days", "1", "-subj", "/CN=localhost", *names,
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key


@contextlib.asynccontextmanager
async def tcp_pair(tls: CertFiles | None = None) -> AsyncIterator[Pair]:
    """A real loopback TCP (or TLS) connection: (client end, server end), closed on exit."""
    accepted: asyncio.Queue[Transport] = asyncio.Queue(1)
    release = asyncio.Event()

    async def handler(transport: Transport) -> None:
        await accepted.put(transport)
        await release.wait()

    server_ctx = server_ssl_context(*tls) if tls else None
    client_ctx = client_ssl_context(tls[0]) if tls else None
    async with await serve_tcp(handler, ssl=server_ctx) as listener:
        try:
            client = await connect_tcp("127.0.0.1", listener.port, ssl=client_ctx)
            try:
                server = await accepted.get()
                yield client, server
            finally:
                await client.aclose()
        finally:
            release.set()


@contextlib.asynccontextmanager
async def transport_pair(
    kind: str, *, capacity: int = 1 << 20, tls: CertFiles | None = None
) -> AsyncIterator[Pair]:
    """Two connected ends (client, server) of ``kind``: "memory", "tcp" or "tls" (needs ``tls``)."""
    if kind == "memory":
        a, b = memory_pair(capacity=capacity)
        try:
            yield a, b
        finally:
            await a.aclose()
            await b.aclose()
        return
    if kind == "tls" and tls is None:
        raise ValueError("a tls pair needs certificate files")
    async with tcp_pair(tls if kind == "tls" else None) as ends:
        yield ends


async def read_error(conn: FrameConnection) -> Error:
    """The next frame, which must be an ERROR (the connection's timeouts.read bounds the wait)."""
    message = conn.expect(await conn.receive_frame(), Error)
    assert isinstance(message, Error)
    return message


async def receive_all(transport: Transport, n: int) -> bytes:
    """Exactly ``n`` bytes from ``transport``."""
    buf = bytearray(n)
    await transport.receive_exactly(buf)
    return bytes(buf)


class _Server(Protocol):
    async def start(
        self, host: str = ..., port: int = ..., *, ssl: ssl_module.SSLContext | None = None
    ) -> Any: ...

    async def aclose(self) -> None: ...


S = TypeVar("S", bound=_Server)


@contextlib.asynccontextmanager
async def running(server: S, **start: Any) -> AsyncIterator[S]:
    """``server`` (a BlockServer or RoundServer) started on 127.0.0.1 port 0, closed on exit."""
    try:
        await server.start("127.0.0.1", 0, **start)
        yield server
    finally:
        await server.aclose()


class IpcEndpoints:
    """ipc:// endpoints in one short private directory (socket paths have a length limit).

    ``endpoints("name")`` is that name's endpoint; ``endpoints()`` a fresh one each call.
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._count = 0

    def __call__(self, name: str | None = None) -> str:
        if name is None:
            name = str(self._count)
            self._count += 1
        return f"ipc://{self.directory}/{name}.ipc"


class ManualClock:
    """A clock the test moves by hand (a listener reads it to measure idleness)."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


async def until(
    predicate: Callable[[], object],
    what: str = "the condition",
    *,
    seconds: float = 5,
    step: float = 0,
) -> None:
    """Let the loop run until ``predicate()`` holds: ``step`` between checks, ``seconds`` at most.

    ``step=0`` yields one loop turn (no timed sleep); a small step suits a condition another
    thread makes true. Past ``seconds`` a TimeoutError names ``what`` was awaited.
    """
    try:
        async with asyncio.timeout(seconds):
            while not predicate():
                await asyncio.sleep(step)
    except TimeoutError as exc:
        raise TimeoutError(f"waited {seconds} s for {what}") from exc
