"""The TcpListener's cap: idleness per connection, eviction of the longest idle, refusals."""

from __future__ import annotations

import ast
import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import tensorswap.transport as transport_pkg
from helpers.net import ManualClock, until
from tensorswap import errors as root_errors
from tensorswap.transport import (
    ConnectionFailed,
    ServerBusy,
    TcpListener,
    Transport,
    TransportError,
    connect_tcp,
    serve_tcp,
)
from tensorswap.wire import errors as wire_errors
from tensorswap.wire import tcp as wire_tcp
from tensorswap.wire import transport as wire_transport


class Served:
    """A handler that waits for one byte per read, inside ``busy()`` when asked."""

    def __init__(self) -> None:
        self.hold = False
        self.ended: list[str] = []

    async def __call__(self, transport: Transport) -> None:
        try:
            while True:
                if self.hold:
                    with transport.busy():
                        got = await transport.receive_into(bytearray(1))
                else:
                    got = await transport.receive_into(bytearray(1))
                if not got:
                    return
        except asyncio.CancelledError:
            self.ended.append(transport.peer)
            raise


async def eof_seen(client: Transport) -> bool:
    async with asyncio.timeout(5):
        return await client.receive_into(bytearray(1)) == 0


@pytest.fixture
async def listening() -> AsyncIterator[tuple[TcpListener, Served, ManualClock]]:
    handler = Served()
    clock = ManualClock(50.0)
    async with await serve_tcp(handler, max_connections=2, min_idle=5.0) as listener:
        listener.clock = clock
        yield listener, handler, clock


async def idle_pair(listener: TcpListener, clock: ManualClock) -> list[Transport]:
    clients = []
    for _ in range(2):
        clients.append(await connect_tcp("127.0.0.1", listener.port))
        await until(lambda: len(listener.served()) == len(clients))
        await until(lambda: listener.served()[-1].idle_since is not None)
        clock.now += 1.0
    return clients


async def test_a_waiting_connection_is_idle_until_bytes_arrive(listening) -> None:
    listener, _, clock = listening
    client = await connect_tcp("127.0.0.1", listener.port)
    await until(lambda: len(listener.served()) == 1)
    served = listener.served()[0]
    await until(lambda: served.idle_since is not None)
    assert served.idle_since == clock.now
    clock.now += 3.0
    await client.send(b"x")
    await until(lambda: served.bytes_received == 1)  # read, and waiting again
    await until(lambda: served.idle_since is not None)
    assert served.idle_since == clock.now
    await client.aclose()


async def test_the_longest_idle_connection_makes_room_once_idle_long_enough(listening) -> None:
    listener, handler, clock = listening
    evicted: list[str] = []
    listener.on_evicted = lambda t: evicted.append(t.peer)
    first, second = await idle_pair(listener, clock)  # idle since 50 and 51; now 52
    early = await connect_tcp("127.0.0.1", listener.port)  # neither idle for 5 s yet
    assert await eof_seen(early)
    assert (listener.refused, listener.evicted) == (1, 0)
    clock.now = 56.0  # first idle for 6 s, second for 5
    newcomer = await connect_tcp("127.0.0.1", listener.port)
    assert await eof_seen(first)  # closed cleanly: EOF, not a reset
    assert (listener.refused, listener.evicted, listener.connections) == (1, 1, 2)
    assert evicted == handler.ended and len(evicted) == 1
    await second.send(b"still served")
    await newcomer.send(b"served")
    for client in (first, second, early, newcomer):
        await client.aclose()


async def test_a_connection_inside_busy_is_never_evicted(listening) -> None:
    listener, handler, clock = listening
    handler.hold = True  # both handlers wait for bytes inside busy()
    clients = [await connect_tcp("127.0.0.1", listener.port) for _ in range(2)]
    await until(lambda: listener.connections == 2)
    clock.now += 3600.0
    refused = await connect_tcp("127.0.0.1", listener.port)
    assert await eof_seen(refused)
    assert (listener.refused, listener.evicted) == (1, 0)
    assert all(t.idle_since is None for t in listener.served())
    for client in (*clients, refused):
        await client.aclose()


async def test_a_refused_newcomer_reads_what_on_refused_sent(listening) -> None:
    listener, _, clock = listening
    told: list[str] = []

    async def say_busy(transport: Transport) -> None:
        told.append(transport.peer)
        await transport.send(b"busy\n")

    listener.on_refused = say_busy
    clients = await idle_pair(listener, clock)  # idle for 1-2 s: below min_idle
    refused = await connect_tcp("127.0.0.1", listener.port)
    buffer = bytearray(16)
    async with asyncio.timeout(5):
        got = await refused.receive_into(buffer)  # the message, then EOF
    assert bytes(buffer[:got]) == b"busy\n" and len(told) == 1
    for client in (*clients, refused):
        await client.aclose()


def test_min_idle_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="min_idle"):
        TcpListener(min_idle=-1)


# ── one layer, re-exported ─────────────────────────────────────────────────────
def test_wire_reexports_the_very_same_objects() -> None:
    assert wire_transport.Transport is transport_pkg.Transport
    assert wire_transport.memory_pair is transport_pkg.memory_pair
    assert wire_tcp.TcpListener is transport_pkg.TcpListener
    assert wire_tcp.serve_tcp is transport_pkg.serve_tcp
    assert wire_tcp.DEFAULT_MAX_CONNECTIONS == transport_pkg.DEFAULT_MAX_CONNECTIONS
    for name in ("ConnectionFailed", "PeerTimeout", "TransportClosed", "UnexpectedEof"):
        assert getattr(wire_errors, name) is getattr(transport_pkg, name)
    assert wire_errors.ServerBusy is ServerBusy
    assert issubclass(ServerBusy, ConnectionFailed)
    assert TransportError is root_errors.TransportError
    assert issubclass(TransportError, root_errors.WireError)


def test_server_busy_says_what_to_do() -> None:
    busy = ServerBusy("127.0.0.1:7000", "at its connection cap (64); retry later")
    assert str(busy).startswith("server busy: at its connection cap (64); retry later")
    assert (busy.peer, busy.reason) == ("127.0.0.1:7000", "at its connection cap (64); retry later")


def test_the_transport_layer_imports_nothing_above_it() -> None:
    allowed = ("tensorswap.errors", "tensorswap._netaddr", "tensorswap.transport")
    for path in Path(transport_pkg.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                if name.startswith("tensorswap"):
                    assert name.startswith(allowed), f"{path.name} imports {name}"
