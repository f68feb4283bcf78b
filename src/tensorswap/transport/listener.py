"""TcpListener: serves TCP/TLS connections under a cap, evicting the longest-idle one at it.

Every protocol that listens (the block service, the DWE listener) runs on this one listener, so
the cap, the idleness of each connection and the eviction rule exist once:

- At most ``max_connections`` connections are served at once.
- A connection is *idle* while its handler waits for the peer's bytes with nothing of that
  read received and nothing unread buffered, outside ``Transport.busy()`` (a handler marks a
  message in progress with it). Busy otherwise: between reads, handling a request, sending,
  in the middle of a read, inside ``busy()``.
- A newcomer at the cap closes the connection idle the longest, provided it has been idle
  for ``min_idle`` seconds at least (``evicted`` counts them); the newcomer is then served.
- When no connection qualifies, the newcomer is refused: ``on_refused(transport)`` may tell
  it so (a BlockServer sends an ``ERROR busy`` frame), then it is closed (``refused``).
"""

from __future__ import annotations

import asyncio
import logging
import ssl as ssl_module
import time
from collections.abc import Awaitable, Callable
from typing import Self

from tensorswap.errors import TensorSwapError
from tensorswap.transport._stream import StreamProtocol
from tensorswap.transport.base import Transport
from tensorswap.transport.errors import ConnectionFailed
from tensorswap.transport.tcp import TcpTransport, describe, peer_name

__all__ = [
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_MIN_IDLE",
    "Handler",
    "TcpListener",
    "serve_tcp",
]

DEFAULT_MAX_CONNECTIONS = 1024
"""Connections a listener handles at once unless told otherwise (``serve_tcp``)."""
DEFAULT_MIN_IDLE = 1.0
"""Seconds a connection must have been idle before a newcomer at the cap may evict it."""

Handler = Callable[[Transport], Awaitable[None]]
"""``async handler(transport)``: serves one connection; the listener closes it afterwards."""

_REFUSE_SECONDS = 2.0  # to tell a refused newcomer why and close its connection
_MAX_REFUSING = 64  # refusals being told at once; beyond them a newcomer is just aborted

log = logging.getLogger(__name__)


class TcpListener:
    """A listening TCP server; each connection runs ``handler(transport)`` in its own task.

    The task owns its transport and closes it when the handler returns or fails; an evicted
    connection's task is cancelled (its transport then closed the same way). ``aclose`` stops
    accepting, cancels running handlers and waits for them. See the module docstring for the
    cap and the eviction rule; ``on_evicted(transport)`` is called as a connection is chosen
    for eviction, ``on_refused(transport)`` (awaited, ``_REFUSE_SECONDS`` at most) before a
    refused newcomer is closed. ``clock`` (seconds, monotonic) measures idleness; tests may
    replace it at any time.
    """

    def __init__(
        self,
        *,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        min_idle: float = DEFAULT_MIN_IDLE,
        on_refused: Callable[[Transport], Awaitable[None]] | None = None,
        on_evicted: Callable[[Transport], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {max_connections}")
        if min_idle < 0:
            raise ValueError(f"min_idle must not be negative, got {min_idle}")
        self._server: asyncio.Server | None = None
        self._served: dict[asyncio.Task[None], TcpTransport] = {}  # counted against the cap
        self._tasks: set[asyncio.Task[None]] = set()  # every handler task, evicted ones too
        self._refusing: set[asyncio.Task[None]] = set()
        self._closing = False
        self.host = ""
        self.port = 0
        self.max_connections = max_connections
        self.min_idle = min_idle
        self.on_refused = on_refused
        self.on_evicted = on_evicted
        self.clock = clock
        self.refused = 0
        """Newcomers refused because ``max_connections`` were served and none could go."""
        self.evicted = 0
        """Idle connections closed to make room for a newcomer."""

    @property
    def connections(self) -> int:
        """Number of connections being served now (evicted ones no longer count)."""
        return len(self._served)

    def served(self) -> tuple[TcpTransport, ...]:
        """The transports being served now, oldest first."""
        return tuple(self._served.values())

    def _now(self) -> float:
        return self.clock()

    def _spawn(self, handler: Handler, proto: StreamProtocol) -> None:
        assert proto.transport is not None
        transport = TcpTransport(proto, peer_name(proto.transport))
        if self._closing:
            transport.abort()
            return
        if len(self._served) >= self.max_connections and not self._evict_idle():
            self._refuse(transport)
            return
        proto.clock = self._now  # from now on the protocol stamps when it goes idle

        async def run() -> None:
            try:
                await handler(transport)
            finally:
                await transport.aclose()

        task = asyncio.get_running_loop().create_task(run())
        self._served[task] = transport
        self._tasks.add(task)
        task.add_done_callback(self._finished)

    def _evict_idle(self) -> bool:
        """Cancel the connection idle the longest (``min_idle`` at least); False if none is."""
        now = self.clock()
        victim: asyncio.Task[None] | None = None
        oldest = 0.0
        for task, transport in self._served.items():
            since = transport.idle_since
            if since is None or now - since < self.min_idle:
                continue
            if victim is None or since < oldest:
                victim, oldest = task, since
        if victim is None:
            return False
        transport = self._served.pop(victim)
        self.evicted += 1
        log.info("closing %s, idle for %.3gs, to make room", transport.peer, now - oldest)
        if self.on_evicted is not None:
            try:
                self.on_evicted(transport)
            except Exception:  # a callback's bug must not break accepting
                log.exception("on_evicted raised for %s", transport.peer)
        victim.cancel()
        return True

    def _refuse(self, transport: TcpTransport) -> None:
        self.refused += 1
        log.info(
            "refused %s: %d connections served, none idle for %gs",
            transport.peer,
            len(self._served),
            self.min_idle,
        )
        if len(self._refusing) >= _MAX_REFUSING:
            transport.abort()  # a flood of newcomers: no time to tell each one
            return
        task = asyncio.get_running_loop().create_task(self._tell_refused(transport))
        self._refusing.add(task)
        task.add_done_callback(self._refusing.discard)

    async def _tell_refused(self, transport: TcpTransport) -> None:
        try:
            async with asyncio.timeout(_REFUSE_SECONDS):
                if self.on_refused is not None:
                    await self.on_refused(transport)
                await transport.aclose()  # a clean close: the peer reads what it was told
        except (TensorSwapError, OSError, TimeoutError) as exc:
            log.debug("could not tell %s it was refused: %s", transport.peer, exc)
        except Exception:
            log.exception("on_refused raised for %s", transport.peer)
        finally:
            transport.abort()  # no-op once closed

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._served.pop(task, None)
        if not task.cancelled() and task.exception() is not None:
            task.exception()  # retrieved: handlers report their own errors

    async def aclose(self) -> None:
        """Stop accepting, cancel every handler and refusal, and wait for them."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        tasks = [*self._tasks, *self._refusing]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


async def serve_tcp(
    handler: Handler,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    ssl: ssl_module.SSLContext | None = None,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    min_idle: float = DEFAULT_MIN_IDLE,
    on_refused: Callable[[Transport], Awaitable[None]] | None = None,
    on_evicted: Callable[[Transport], None] | None = None,
) -> TcpListener:
    """Listen on ``host:port`` (port 0 picks a free one; see ``listener.port``).

    At most ``max_connections`` connections are served at once; at the cap a newcomer evicts
    the connection idle the longest (``min_idle`` seconds at least) or is refused (see
    ``TcpListener``). Raises ConnectionFailed when the address cannot be listened on.
    """
    loop = asyncio.get_running_loop()
    listener = TcpListener(
        max_connections=max_connections,
        min_idle=min_idle,
        on_refused=on_refused,
        on_evicted=on_evicted,
    )
    tls = ssl is not None

    def factory() -> StreamProtocol:
        proto = StreamProtocol(tls=tls)
        proto.on_connect = lambda p: listener._spawn(handler, p)
        return proto

    try:
        server = await loop.create_server(factory, host, port, ssl=ssl)
    except (OSError, UnicodeError) as exc:  # UnicodeError: a host name IDNA refuses
        raise ConnectionFailed(f"{host}:{port}", describe(exc, "listen failed")) from exc
    listener._server = server
    sockname = server.sockets[0].getsockname()
    listener.host, listener.port = str(sockname[0]), int(sockname[1])
    return listener
