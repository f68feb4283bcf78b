"""The DWE broadcast bus: a bounded queue and a background asyncio sender to every peer.

``broadcast()`` never blocks: a full queue counts a drop. One dispatcher task encodes (and,
with fleet keys, signs) each fragment once; one sender task per peer writes it, over one
persistent connection (default) or one connection per fragment (axiom 0.1.5 compatibility).
Delivery is best effort: no acks exist in the protocol, a frame is retried on a fresh connection
up to ``max_attempts`` times, so a receiver may see a duplicate, which its sequence tracking
rejects as a replay.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any

from tensorswap.delta.bincode import (
    HMAC_FIELD_BYTES,
    FragmentTooLarge,
    encode_frame,
    encoded_size,
)
from tensorswap.delta.config import DweConfig, Endpoint, SendMode, parse_endpoint
from tensorswap.delta.fragment import DweFragment
from tensorswap.delta.telemetry import DweTelemetry, TelemetrySnapshot
from tensorswap.delta.verify import fragment_hmac
from tensorswap.errors import DeltaError
from tensorswap.transport import TcpTransport, TransportError, connect_tcp

# Encoding and signing a fragment above this size runs in a worker thread, off the event loop.
_OFFLOAD_BYTES = 1 << 20

log = logging.getLogger(__name__)


class BusClosed(DeltaError, RuntimeError):
    """The bus is closed (or was never started) and cannot take or flush fragments."""


class _State(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    CLOSED = "closed"


@dataclass(eq=False)
class _Frame:
    """One encoded fragment shared by every peer's queue; ``pending`` peers still owe a result."""

    data: memoryview
    session_id: str
    pending: int

    @property
    def fragment_bytes(self) -> int:
        return len(self.data) - 4


@dataclass(eq=False)
class _Peer:
    endpoint: Endpoint
    queue: asyncio.Queue[_Frame]
    transport: TcpTransport | None = None
    delay: float = 0.0

    def connected(self) -> bool:
        # the peer closed its side: reconnect before writing
        return self.transport is not None and not self.transport.peer_closed

    async def disconnect(self, *, broken: bool = False) -> None:
        transport, self.transport = self.transport, None
        if transport is not None:
            await _close(transport, broken=broken)


class DweBus:
    """Broadcast fragments to the configured peers from background tasks owned by a TaskGroup.

    Use as ``async with DweBus(peers) as bus:``; leaving the block stops intake, waits up to
    ``drain_timeout`` for queued frames to be delivered, then cancels the tasks and closes every
    connection. Fragments broadcast before the block starts wait in the bounded queue.
    Call :meth:`broadcast` from the event loop's thread (or :meth:`broadcast_threadsafe`).
    """

    def __init__(
        self,
        peers: Iterable[str | Endpoint] | None = None,
        *,
        config: DweConfig | None = None,
        telemetry: DweTelemetry | None = None,
        drain_timeout: float = 5.0,
    ) -> None:
        cfg = config if config is not None else DweConfig()
        if peers is not None:
            cfg = replace(cfg, peers=tuple(parse_endpoint(p) for p in peers))
        self.config = cfg
        self.telemetry_recorder = telemetry if telemetry is not None else DweTelemetry()
        self.drain_timeout = drain_timeout
        self.fault: Callable[[str, object], None] | None = None
        """Fault-injection seam, None by default: called with ``("encode", fragment)`` before
        a fragment is encoded and ``("send", endpoint)`` before each attempt to send a frame
        to that peer; an exception it raises fails that step as a bug there would (for tests
        that one failure never stops the bus or the other peers)."""
        self._queue: asyncio.Queue[DweFragment] = asyncio.Queue(maxsize=cfg.queue_size)
        self._peers = [_Peer(ep, asyncio.Queue(maxsize=cfg.queue_size)) for ep in cfg.peers]
        self._state = _State.NEW
        self._closing = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._room = asyncio.Event()
        self._room.set()
        self._outstanding = 0
        self._group: asyncio.TaskGroup | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def from_env(cls, **overrides: Any) -> DweBus:
        """A bus configured by :meth:`DweConfig.from_env` (``TENSORSWAP_DWE_PEERS`` or axiom's)."""
        return cls(config=DweConfig.from_env(**overrides))

    @classmethod
    def disabled(cls) -> DweBus:
        """A bus with no peers: broadcasts are accepted and go nowhere."""
        return cls(peers=())

    @property
    def peers(self) -> tuple[Endpoint, ...]:
        """The peers every fragment is sent to."""
        return self.config.peers

    def telemetry(self) -> TelemetrySnapshot:
        """Counters now; ``queued`` is the number of fragments not yet settled for every peer."""
        return self.telemetry_recorder.snapshot(queued=self._outstanding)

    def broadcast(self, fragment: DweFragment) -> bool:
        """Queue ``fragment`` for every peer without blocking; False if dropped (queue full).

        Raises :class:`FragmentTooLarge` at once when its encoding would exceed the cap (split it
        with :func:`~tensorswap.delta.split.split_fragment`) and :class:`BusClosed` after close.
        """
        self._check_size(fragment)
        return self._enqueue(fragment)

    async def put(self, fragment: DweFragment) -> None:
        """Queue ``fragment`` for every peer, waiting while ``queue_size`` fragments are unsettled.

        The producer-paced alternative to :meth:`broadcast`: it never drops, because no queue
        (the bus's or a peer's) can be full while fewer than ``queue_size`` fragments are
        outstanding. Raises like :meth:`broadcast`.
        """
        self._check_size(fragment)
        while self._outstanding >= self.config.queue_size:
            self._room.clear()
            await self._room.wait()
            self._check_size(fragment)  # the bus may have closed meanwhile
        self._enqueue(fragment)

    def broadcast_threadsafe(self, fragment: DweFragment) -> None:
        """:meth:`broadcast` from another thread while the bus runs; drops are only counted."""
        self._check_size(fragment)
        if self._loop is None or self._state is not _State.RUNNING:
            raise BusClosed("the bus is not running")
        self._loop.call_soon_threadsafe(self._enqueue_quietly, fragment)

    def _check_size(self, fragment: DweFragment) -> None:
        if self._state is _State.CLOSED:
            raise BusClosed("the bus is closed")
        extra = HMAC_FIELD_BYTES if self.config.keys is not None and fragment.hmac is None else 0
        size = encoded_size(fragment) + extra
        if size > self.config.max_fragment_bytes:
            raise FragmentTooLarge(size, self.config.max_fragment_bytes)

    def _enqueue_quietly(self, fragment: DweFragment) -> None:
        if self._state is _State.RUNNING:
            self._enqueue(fragment)

    def _enqueue(self, fragment: DweFragment) -> bool:
        if not self._peers:
            return True
        try:
            self._queue.put_nowait(fragment)
        except asyncio.QueueFull:
            self.telemetry_recorder.record_dropped(
                f"dwe queue full: {self._queue.maxsize} fragments waiting"
            )
            return False
        self._outstanding += 1
        self._idle.clear()
        if self._outstanding >= self.config.queue_size:
            self._room.clear()
        self.telemetry_recorder.record_enqueued()
        return True

    def _settle(self, frame: _Frame) -> None:
        frame.pending -= 1
        if frame.pending == 0:
            self._settle_fragment()

    def _settle_fragment(self) -> None:
        self._outstanding -= 1
        if self._outstanding < self.config.queue_size:
            self._room.set()
        if self._outstanding == 0:
            self._idle.set()

    async def flush(self) -> None:
        """Wait until every fragment broadcast so far is sent, failed or dropped for every peer."""
        if self._state is not _State.RUNNING and self._outstanding:
            raise BusClosed(f"the bus is {self._state.value}; {self._outstanding} fragments wait")
        await self._idle.wait()

    async def start(self) -> None:
        """Start the dispatcher and one sender per peer; use ``async with`` instead when you can."""
        if self._state is not _State.NEW:
            raise BusClosed(f"the bus is {self._state.value}")
        self._loop = asyncio.get_running_loop()
        self._group = asyncio.TaskGroup()
        await self._group.__aenter__()
        self._state = _State.RUNNING
        self._tasks.append(self._group.create_task(self._dispatch(), name="dwe-dispatch"))
        for peer in self._peers:
            task = self._group.create_task(self._run_peer(peer), name=f"dwe-send-{peer.endpoint}")
            self._tasks.append(task)

    async def aclose(self) -> None:
        """Stop intake, deliver what is queued for up to ``drain_timeout``, then stop everything.

        Frames still queued after the drain are abandoned (counted as send failures by nobody:
        they were never tried); every connection is closed when this returns.
        """
        if self._state is _State.CLOSED:
            return
        running = self._state is _State.RUNNING
        self._state = _State.CLOSED
        self._room.set()  # producers waiting in put() wake up and see BusClosed
        if not running:
            return
        self._closing.set()  # backoff waits end at once from now on
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.drain_timeout):
                await self._idle.wait()
        for task in self._tasks:
            task.cancel()
        if self._group is not None:
            await self._group.__aexit__(None, None, None)

    async def __aenter__(self) -> DweBus:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # ── background tasks ────────────────────────────────────────────────────
    def _encode(self, fragment: DweFragment) -> memoryview:
        if self.fault is not None:
            self.fault("encode", fragment)
        keys = self.config.keys
        if keys is not None and fragment.hmac is None:
            fragment = fragment.with_hmac(fragment_hmac(fragment, keys.current))
        return encode_frame(fragment, max_bytes=self.config.max_fragment_bytes)

    async def _dispatch(self) -> None:
        while True:
            fragment = await self._queue.get()
            try:
                if encoded_size(fragment) > _OFFLOAD_BYTES:
                    data = await asyncio.to_thread(self._encode, fragment)
                else:
                    data = self._encode(fragment)
            except DeltaError as exc:  # checked in broadcast(); only a changed config gets here
                self.telemetry_recorder.record_send_failure(f"dwe encode: {exc}")
                self._settle_fragment()
                continue
            except Exception as exc:  # one bad fragment must not stop the bus or its owner
                log.exception("dwe bus: encoding a fragment of %r failed", fragment.session_id)
                self.telemetry_recorder.record_failure(f"dwe encode: {exc!r}")
                self.telemetry_recorder.record_send_failure(f"dwe encode: {exc!r}")
                self._settle_fragment()
                continue
            finally:
                self._queue.task_done()
            self._fan_out(_Frame(data, fragment.session_id, len(self._peers)))

    def _fan_out(self, frame: _Frame) -> None:
        for peer in self._peers:
            try:
                peer.queue.put_nowait(frame)
            except asyncio.QueueFull:
                self.telemetry_recorder.record_dropped(f"dwe peer queue full: {peer.endpoint}")
                self._settle(frame)

    async def _run_peer(self, peer: _Peer) -> None:
        try:
            while True:
                frame = await peer.queue.get()
                try:
                    await self._deliver(peer, frame)
                except Exception as exc:  # unexpected: fail this delivery, never the other peers
                    log.exception("dwe bus: sending to %s failed", peer.endpoint)
                    error = f"dwe send {peer.endpoint}: unexpected {exc!r}"
                    self.telemetry_recorder.record_failure(error)
                    self.telemetry_recorder.record_send_failure(error)
                    with contextlib.suppress(Exception):
                        await peer.disconnect(broken=True)
                finally:
                    peer.queue.task_done()
                    self._settle(frame)
        finally:
            await peer.disconnect()

    async def _deliver(self, peer: _Peer, frame: _Frame) -> None:
        error: BaseException | None = None
        for _ in range(self.config.max_attempts):
            await self._backoff(peer)
            try:
                if self.fault is not None:
                    self.fault("send", peer.endpoint)
                if self.config.mode is SendMode.PERSISTENT:
                    await self._send_persistent(peer, frame)
                else:
                    await self._send_per_fragment(peer, frame)
            # A host name IDNA cannot encode (say, a label over 63 characters) fails in
            # connect_tcp like a refused connection: it fails this peer, not the bus.
            except (TransportError, OSError, TimeoutError) as exc:
                error = exc
                await peer.disconnect(broken=True)
                peer.delay = min(
                    self.config.backoff_max, peer.delay * 2 or self.config.backoff_initial
                )
                self.telemetry_recorder.record_error(f"dwe send {peer.endpoint}: {exc!r}")
                continue
            peer.delay = 0.0
            self.telemetry_recorder.record_sent(frame.session_id, frame.fragment_bytes)
            return
        self.telemetry_recorder.record_send_failure(
            f"dwe send {peer.endpoint}: gave up after {self.config.max_attempts} attempts: "
            f"{error!r}"
        )

    async def _backoff(self, peer: _Peer) -> None:
        if peer.delay and not self._closing.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(peer.delay):
                    await self._closing.wait()

    async def _connect(self, peer: _Peer) -> TcpTransport:
        transport = await connect_tcp(
            peer.endpoint.host, peer.endpoint.port, timeout=self.config.connect_timeout
        )
        self.telemetry_recorder.record_reconnect()
        return transport

    async def _send_persistent(self, peer: _Peer, frame: _Frame) -> None:
        if not peer.connected():
            await peer.disconnect()
            peer.transport = await self._connect(peer)
        transport = peer.transport
        if transport is None:  # connected() was true or we just connected
            raise TransportError("no connection")
        async with asyncio.timeout(self.config.write_timeout):
            await transport.send(frame.data)

    async def _send_per_fragment(self, peer: _Peer, frame: _Frame) -> None:
        transport = await self._connect(peer)
        broken = True
        try:
            async with asyncio.timeout(self.config.write_timeout):
                await transport.send(frame.data)
                await transport.send_eof()
            broken = False
            # The receiver closes once it has read the frame: waiting for that keeps fragments
            # in order across connections. Its absence is not a failure (the bytes were sent).
            with contextlib.suppress(TimeoutError, TransportError):
                async with asyncio.timeout(self.config.write_timeout):
                    sink = bytearray(1 << 16)
                    while await transport.receive_into(sink):
                        pass
        finally:
            await _close(transport, broken=broken)


async def _close(transport: TcpTransport, *, broken: bool) -> None:
    """Close a connection without waiting on a peer that stopped reading.

    A clean close would wait until the write buffer has been flushed, which a stalled peer
    never allows: a broken stream (a send that failed or timed out), or one with bytes still
    buffered, is aborted instead.
    """
    if broken or transport.write_buffer_size:
        transport.abort()
    else:
        await transport.aclose()
