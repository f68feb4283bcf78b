"""The DWE listener: reads length-prefixed fragments under the size cap, verifies, hands off.

Each connection may carry any number of frames (one per connection is what axiom 0.1.5 sends).
A frame is read only after its length prefix passed the cap; it is decoded zero-copy, checked by
a :class:`~tensorswap.delta.verify.FragmentVerifier`, then given to the handler. The sequence is
recorded only after the handler returned, under one lock, so a fragment is applied at most once
even when copies arrive on several connections at the same time.

A frame must arrive within ``frame_timeout`` of its first byte; a connection with no frame in
progress is closed after ``idle_timeout``, and when ``max_connections`` are open the longest-idle
one makes room for a newcomer. Nothing a connection or a callback raises stops the listener.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType

from tensorswap.delta.bincode import (
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

Handler = Callable[[DweFragment], Awaitable[object] | object]
# Fragments above this size are hashed and authenticated in a worker thread.
_OFFLOAD_BYTES = 1 << 20
_READ_LIMIT = 1 << 20
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


@dataclass(eq=False)
class _Connection:
    """One served connection; ``idle_since`` is None while a frame is being read or handled."""

    peer: str
    writer: asyncio.StreamWriter
    idle_since: float | None
    task: asyncio.Task[None] | None = None


class DweListener:
    """Serve the DWE protocol on TCP; every connection task is owned by the listener's TaskGroup.

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
        self._server: asyncio.Server | None = None
        self._group: asyncio.TaskGroup | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._connections: set[_Connection] = set()  # open and not evicted
        self._closed = asyncio.Event()
        self.endpoint: Endpoint | None = None

    def telemetry(self) -> TelemetrySnapshot:
        """Counters now."""
        return self.telemetry_recorder.snapshot()

    async def start(self, host: str | None = None, port: int | None = None) -> Endpoint:
        """Bind (default: ``config.listen``, else 127.0.0.1 on a free port) and start serving."""
        if self._server is not None or self._closed.is_set():
            raise DeltaError("listener already started or closed")
        default = self.config.listen or Endpoint("127.0.0.1", 0)
        bind_host = host if host is not None else default.host
        bind_port = port if port is not None else default.port
        self._group = asyncio.TaskGroup()
        await self._group.__aenter__()
        try:
            self._server = await asyncio.start_server(
                self._on_connect, bind_host, bind_port, limit=_READ_LIMIT
            )
        except (OSError, UnicodeError) as exc:  # UnicodeError: a host name IDNA refuses
            await self._group.__aexit__(None, None, None)
            self._group = None
            raise DeltaError(f"cannot listen on {bind_host}:{bind_port}: {exc}") from exc
        sockname = self._server.sockets[0].getsockname()
        self.endpoint = Endpoint(str(sockname[0]), int(sockname[1]))
        return self.endpoint

    async def wait_closed(self) -> None:
        """Wait until :meth:`aclose` has been called."""
        await self._closed.wait()

    async def aclose(self) -> None:
        """Stop accepting, end every connection task and close every socket."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        if self._group is not None:
            await self._group.__aexit__(None, None, None)
        if self._server is not None:
            await self._server.wait_closed()

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
    def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._closed.is_set() or self._group is None:
            writer.close()
            return
        if len(self._connections) >= self.config.max_connections and not self._evict_idle():
            self.telemetry_recorder.record_error(
                f"dwe listener: refused a connection beyond {self.config.max_connections} "
                "(every connection has a frame in progress)"
            )
            writer.close()
            return
        loop = asyncio.get_running_loop()
        conn = _Connection(_peer_name(writer), writer, loop.time())
        task = self._group.create_task(self._serve(reader, conn))
        conn.task = task
        self._connections.add(conn)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _evict_idle(self) -> bool:
        """Close the connection idle the longest to make room; False if none is idle."""
        idle = [c for c in self._connections if c.idle_since is not None]
        if not idle:
            return False
        victim = min(idle, key=lambda c: c.idle_since or 0.0)
        self._connections.discard(victim)
        self.telemetry_recorder.record_idle_closed()
        log.info("dwe listener: closing idle connection %s to make room", victim.peer)
        victim.writer.close()
        if victim.task is not None:
            victim.task.cancel()
        return True

    async def _serve(self, reader: asyncio.StreamReader, conn: _Connection) -> None:
        try:
            await self._serve_frames(reader, conn)
        except OSError as exc:
            self.telemetry_recorder.record_error(f"dwe listener {conn.peer}: {exc!r}")
        except Exception as exc:  # a bug must cost this connection only, never the listener
            log.exception("dwe listener %s: connection failed", conn.peer)
            self.telemetry_recorder.record_failure(f"dwe listener {conn.peer}: {exc!r}")
        finally:
            self._connections.discard(conn)

    async def _serve_frames(self, reader: asyncio.StreamReader, conn: _Connection) -> None:
        loop = asyncio.get_running_loop()
        turn = loop.time()
        try:
            while True:
                now = conn.idle_since = loop.time()
                if now - turn >= _TURN_SECONDS:  # let every other connection and task run
                    await asyncio.sleep(0)
                    turn = loop.time()
                try:
                    async with asyncio.timeout(self.config.idle_timeout):
                        first = await reader.readexactly(1)
                except asyncio.IncompleteReadError:
                    return  # closed between frames
                except TimeoutError:
                    self.telemetry_recorder.record_idle_closed()
                    log.info(
                        "dwe listener: %s idle for %ss, closed", conn.peer, self.config.idle_timeout
                    )
                    return
                conn.idle_since = None
                body = await self._read_frame(reader, conn.peer, first)
                if body is None:
                    return
                try:
                    await self._process(body, conn.peer)
                except Exception as exc:  # the stream is still in step: keep the connection
                    log.exception("dwe listener %s: frame processing failed", conn.peer)
                    detail = f"internal error: {exc!r}"
                    self._reject(conn.peer, RejectReason.INTERNAL_ERROR, detail, len(body))
        finally:
            conn.writer.close()
            with contextlib.suppress(OSError):
                await conn.writer.wait_closed()

    async def _read_frame(
        self, reader: asyncio.StreamReader, peer: str, first: bytes
    ) -> bytes | None:
        """The body of the frame whose first prefix byte is ``first``, or None (then close)."""
        length: int | None = None
        try:
            async with asyncio.timeout(self.config.frame_timeout):
                prefix = first + await reader.readexactly(3)
                try:
                    length = read_frame_length(prefix, self.config.max_fragment_bytes)
                except FragmentTooLarge as exc:  # refused before reading or allocating the body
                    self._reject(peer, RejectReason.TOO_LARGE, str(exc), exc.size)
                    return None
                return await reader.readexactly(length)
        except asyncio.IncompleteReadError as exc:
            if length is None:
                detail = "connection closed inside a prefix"
                self._reject(peer, RejectReason.TRUNCATED, detail, 0)
            else:
                detail = f"connection closed after {len(exc.partial)} of {length} bytes"
                self._reject(peer, RejectReason.TRUNCATED, detail, length)
        except TimeoutError:
            what = "length prefix" if length is None else f"frame of {length} bytes"
            detail = f"{what} not complete in {self.config.frame_timeout}s"
            self._reject(peer, RejectReason.TIMEOUT, detail, length or 0)
        return None

    async def _process(self, body: bytes, peer: str) -> None:
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


def _peer_name(writer: asyncio.StreamWriter) -> str:
    name = writer.get_extra_info("peername")
    if isinstance(name, tuple) and len(name) >= 2:
        return f"{name[0]}:{name[1]}"
    return str(name)
