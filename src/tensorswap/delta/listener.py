"""The DWE listener: reads length-prefixed fragments under the size cap, verifies, hands off.

Each connection may carry any number of frames (one per connection is what axiom 0.1.5 sends).
A frame is read only after its length prefix passed the cap; it is decoded zero-copy, checked by
a :class:`~tensorswap.delta.verify.FragmentVerifier`, then given to the handler. The sequence is
recorded only after the handler returned, under one lock, so a fragment is applied at most once
even when copies arrive on several connections at the same time.

A frame must arrive within ``frame_timeout`` of its first byte; a connection with no frame in
progress is closed after ``idle_timeout``, and when ``max_connections`` are open the longest-idle
one makes room for a newcomer (the shared ``tensorswap.transport.TcpListener`` keeps the cap and
evicts). Nothing a connection or a callback raises stops the listener.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType

from tensorswap.delta.bincode import (
    FRAME_PREFIX_BYTES,
    FragmentTooLarge,
    MalformedFragment,
    decode_fragment_signed,
    read_frame_length,
)
from tensorswap.delta.config import DeltaConfigError, DweConfig, Endpoint
from tensorswap.delta.fragment import DweFragment, quoted
from tensorswap.delta.telemetry import DweTelemetry, TelemetrySnapshot
from tensorswap.delta.verify import FragmentRejected, FragmentVerifier, KeyUsed, RejectReason
from tensorswap.errors import DeltaError
from tensorswap.transport import TcpListener, Transport, TransportError, serve_tcp

Handler = Callable[[DweFragment], Awaitable[object] | object]
# Fragments above this size are hashed and authenticated in a worker thread.
_OFFLOAD_BYTES = 1 << 20
# A connection whose frames are already buffered never waits, so it would keep the event loop
# until its buffer ran dry (60,000 four-byte frames: 2.3 s); it yields after this long.
_TURN_SECONDS = 0.005

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Verdict:
    """What happened to one received frame; ``reason`` is None when it was accepted."""

    peer: str
    accepted: bool
    reason: RejectReason | None
    detail: str
    fragment_bytes: int
    session_id: str | None = None
    sequence: int | None = None
    layers: int = 0
    values: int = 0
    key_used: KeyUsed = KeyUsed.NONE
    skipped: int = 0

    def describe(self) -> str:
        """One human-readable line."""
        what = (
            f"session={quoted(self.session_id)} seq={self.sequence} layers={self.layers} "
            f"values={self.values}"
            if self.session_id is not None
            else "frame"
        )
        reason = self.reason.value if self.reason is not None else ""
        verdict = "ACCEPTED" if self.accepted else f"REJECTED {reason}"
        extra = f" ({self.detail})" if self.detail else ""
        return f"{self.peer} {what} bytes={self.fragment_bytes} {verdict}{extra}"


class DweListener:
    """Serve the DWE protocol on TCP; every connection task is owned by its ``TcpListener``.

    ``handler`` is called with each verified fragment (sync or async; an ``asyncio.Queue`` is
    put into); it may raise a :class:`DeltaError` (e.g. from ``apply_fragment``) to refuse it,
    which leaves the sequence unrecorded. ``on_verdict`` sees every frame's outcome. Failures are
    contained per connection: a raising ``on_verdict`` or any unexpected exception in a
    connection is logged and counted (``errors``, ``last_error``), and the listener goes on.
    """

    def __init__(
        self,
        handler: Handler | asyncio.Queue[DweFragment] | None = None,
        *,
        config: DweConfig | None = None,
        verifier: FragmentVerifier | None = None,
        telemetry: DweTelemetry | None = None,
        on_verdict: Callable[[Verdict], None] | None = None,
        require_key: bool = False,
    ) -> None:
        self.config = config if config is not None else DweConfig()
        if require_key and self.config.keys is None and (verifier is None or verifier.keys is None):
            raise DeltaConfigError("this listener requires a fleet key and none is configured")
        self.verifier = verifier or FragmentVerifier(
            keys=self.config.keys, gap_policy=self.config.gap_policy
        )
        self.telemetry_recorder = telemetry if telemetry is not None else DweTelemetry()
        self._queue = handler if isinstance(handler, asyncio.Queue) else None
        self._handler = None if isinstance(handler, asyncio.Queue) else handler
        self._on_verdict = on_verdict
        self._apply_lock = asyncio.Lock()
        self.tcp_listener: TcpListener | None = None
        """The transport listener serving the connections (cap, eviction), once started."""
        self._closed = asyncio.Event()
        self.endpoint: Endpoint | None = None

    def telemetry(self) -> TelemetrySnapshot:
        """Counters now."""
        return self.telemetry_recorder.snapshot()

    async def start(self, host: str | None = None, port: int | None = None) -> Endpoint:
        """Bind (default: ``config.listen``, else 127.0.0.1 on a free port) and start serving."""
        if self.tcp_listener is not None or self._closed.is_set():
            raise DeltaError("listener already started or closed")
        default = self.config.listen or Endpoint("127.0.0.1", 0)
        bind_host = host if host is not None else default.host
        bind_port = port if port is not None else default.port
        try:
            self.tcp_listener = await serve_tcp(
                self._serve,
                bind_host,
                bind_port,
                max_connections=self.config.max_connections,
                min_idle=0.0,  # any connection between frames may make room
                on_refused=self._refused,
                on_evicted=self._evicted,
            )
        except TransportError as exc:
            raise DeltaError(f"cannot listen on {bind_host}:{bind_port}: {exc}") from exc
        self.endpoint = Endpoint(self.tcp_listener.host, self.tcp_listener.port)
        return self.endpoint

    async def wait_closed(self) -> None:
        """Wait until :meth:`aclose` has been called."""
        await self._closed.wait()

    async def aclose(self) -> None:
        """Stop accepting, end every connection task and close every socket."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self.tcp_listener is not None:
            await self.tcp_listener.aclose()

    async def __aenter__(self) -> DweListener:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # ── connections ─────────────────────────────────────────────────────────
    async def _refused(self, transport: Transport) -> None:
        self.telemetry_recorder.record_error(
            f"dwe listener: refused a connection beyond {self.config.max_connections} "
            "(every connection has a frame in progress)"
        )

    def _evicted(self, transport: Transport) -> None:
        self.telemetry_recorder.record_idle_closed()
        log.info("dwe listener: closing idle connection %s to make room", transport.peer)

    async def _serve(self, transport: Transport) -> None:
        try:
            await self._serve_frames(transport)
        except TransportError as exc:  # reset, broken pipe: this connection only
            self.telemetry_recorder.record_error(f"dwe listener {transport.peer}: {exc!r}")
        except Exception as exc:  # a bug must cost this connection only, never the listener
            log.exception("dwe listener %s: connection failed", transport.peer)
            self.telemetry_recorder.record_failure(f"dwe listener {transport.peer}: {exc!r}")

    async def _serve_frames(self, transport: Transport) -> None:
        loop = asyncio.get_running_loop()
        turn = loop.time()
        prefix = bytearray(FRAME_PREFIX_BYTES)
        first, rest = memoryview(prefix)[:1], memoryview(prefix)[1:]
        while True:
            if loop.time() - turn >= _TURN_SECONDS:  # let every other connection and task run
                await asyncio.sleep(0)
                turn = loop.time()
            try:  # idle here (no frame in progress): the listener may evict this connection
                async with asyncio.timeout(self.config.idle_timeout):
                    got = await transport.receive_into(first)
            except TimeoutError:
                self.telemetry_recorder.record_idle_closed()
                log.info(
                    "dwe listener: %s idle for %ss, closed",
                    transport.peer,
                    self.config.idle_timeout,
                )
                return
            if not got:
                return  # closed between frames
            with transport.busy():  # a frame in progress: never evicted
                body = await self._read_frame(transport, prefix, rest)
            if body is None:
                return
            try:
                await self._process(body, transport.peer)
            except Exception as exc:  # the stream is still in step: keep the connection
                log.exception("dwe listener %s: frame processing failed", transport.peer)
                detail = f"internal error: {exc!r}"
                self._reject(transport.peer, RejectReason.INTERNAL_ERROR, detail, len(body))

    async def _read_frame(
        self, transport: Transport, prefix: bytearray, rest: memoryview
    ) -> memoryview | None:
        """The body of the frame whose first prefix byte is in ``prefix``, or None (then close).

        ``rest`` is the view of ``prefix`` after its first byte. The body is a read-only view
        of a buffer of its own, received in place.
        """
        peer = transport.peer
        length: int | None = None
        try:
            async with asyncio.timeout(self.config.frame_timeout):
                if await transport.receive_into(rest) < rest.nbytes:
                    self._reject(
                        peer, RejectReason.TRUNCATED, "connection closed inside a prefix", 0
                    )
                    return None
                try:
                    length = read_frame_length(prefix, self.config.max_fragment_bytes)
                except FragmentTooLarge as exc:  # refused before reading or allocating the body
                    self._reject(peer, RejectReason.TOO_LARGE, str(exc), exc.size)
                    return None
                body = bytearray(length)
                got = await transport.receive_into(body)
        except TimeoutError:
            what = "length prefix" if length is None else f"frame of {length} bytes"
            detail = f"{what} not complete in {self.config.frame_timeout}s"
            self._reject(peer, RejectReason.TIMEOUT, detail, length or 0)
            return None
        if got < length:
            detail = f"connection closed after {got} of {length} bytes"
            self._reject(peer, RejectReason.TRUNCATED, detail, length)
            return None
        return memoryview(body).toreadonly()

    async def _process(self, body: memoryview, peer: str) -> None:
        self.telemetry_recorder.record_received(len(body))
        try:
            decoded = decode_fragment_signed(
                body,
                max_bytes=self.config.max_fragment_bytes,
                max_layers=self.config.max_layers,
            )
        except (MalformedFragment, FragmentTooLarge) as exc:
            self._reject(peer, RejectReason.MALFORMED, str(exc), len(body))
            return
        fragment = decoded.fragment
        try:
            if len(body) > _OFFLOAD_BYTES:
                used = await asyncio.to_thread(
                    self.verifier.check_integrity, fragment, decoded.signed
                )
            else:
                used = self.verifier.check_integrity(fragment, decoded.signed)
        except FragmentRejected as exc:
            self._reject(peer, exc.reason, exc.detail, len(body), fragment)
            return
        async with self._apply_lock:
            await self._hand_off(fragment, peer, len(body), used)

    async def _hand_off(self, fragment: DweFragment, peer: str, size: int, used: KeyUsed) -> None:
        try:
            skipped = self.verifier.check_sequence(fragment)
        except FragmentRejected as exc:
            self._reject(peer, exc.reason, exc.detail, size, fragment)
            return
        self.telemetry_recorder.record_accepted(fragment.session_id)
        if self._queue is not None:
            # Never wait for room: every connection waits behind this lock.
            try:
                self._queue.put_nowait(fragment)
            except asyncio.QueueFull:
                detail = f"handler queue is full ({self._queue.maxsize} fragments waiting)"
                self._reject(peer, RejectReason.HANDLER_ERROR, detail, size, fragment)
                return
            self.telemetry_recorder.record_applied()
        elif self._handler is not None:
            limit = self.config.handler_timeout
            deadline = asyncio.timeout(limit)
            try:
                result = self._handler(fragment)
                if inspect.isawaitable(result):
                    async with deadline:
                        await result
            except DeltaError as exc:
                self._reject(peer, RejectReason.APPLY_FAILED, str(exc), size, fragment)
                return
            except Exception as exc:  # a faulty handler must not take the listener down
                if deadline.expired():
                    detail = f"handler did not finish within {limit:g} s"
                else:
                    detail = f"handler raised {exc!r}"
                self._reject(peer, RejectReason.HANDLER_ERROR, detail, size, fragment)
                return
            self.telemetry_recorder.record_applied()
        try:
            self.verifier.commit(fragment)
        except FragmentRejected as exc:  # only if the verifier is shared beyond this listener
            self._reject(peer, exc.reason, exc.detail, size, fragment)
            return
        self.telemetry_recorder.record_gap(skipped)
        self._emit(
            Verdict(
                peer,
                True,
                None,
                "",
                size,
                fragment.session_id,
                fragment.sequence,
                len(fragment.layers),
                fragment.value_count,
                used,
                skipped,
            )
        )

    def _reject(
        self,
        peer: str,
        reason: RejectReason,
        detail: str,
        size: int,
        fragment: DweFragment | None = None,
    ) -> None:
        self.telemetry_recorder.record_rejected(reason, f"dwe listener {peer}: {detail}")
        if fragment is None:
            self._emit(Verdict(peer, False, reason, detail, size))
            return
        self._emit(
            Verdict(
                peer,
                False,
                reason,
                detail,
                size,
                fragment.session_id,
                fragment.sequence,
                len(fragment.layers),
                fragment.value_count,
            )
        )

    def _emit(self, verdict: Verdict) -> None:
        if self._on_verdict is None:
            return
        try:
            self._on_verdict(verdict)
        except Exception as exc:  # a faulty callback must not take the listener down
            log.exception("dwe listener: on_verdict raised for %s", verdict.describe())
            self.telemetry_recorder.record_failure(f"dwe listener: on_verdict raised {exc!r}")
