"""ZeroMQ PUB/SUB transport for flow messages: one canonical envelope per single-frame message.

The publisher binds a PUB socket; subscribers connect a SUB socket with an empty subscription.
Delivery is ZeroMQ's PUB/SUB contract: best effort, at most once, no acknowledgements. A
subscriber loses whatever was published before its connection and subscription were in place
(the slow-joiner effect), and a PUB socket drops messages for a subscriber whose queue is full.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import Any, Self, cast

import zmq

from tensorswap.flow.envelope import decode, encode
from tensorswap.flow.errors import (
    CommunicationError,
    FlowClosed,
    FramingError,
    InvalidArgument,
    InvalidConfig,
    SetupError,
)
from tensorswap.flow.messages import IpcMessage

_MAX_WAIT_MS = 2**31 - 1
"""The longest ZMQ_RCVTIMEO; a longer :meth:`Subscriber.recv` timeout waits in several steps."""
_INT_MAX = 2**31 - 1
"""The largest value of an ``int`` socket option (ZMQ_SNDHWM, ZMQ_LINGER, ...)."""
_INT64_MAX = 2**63 - 1
"""The largest ZMQ_MAXMSGSIZE (an ``int64_t``)."""
_OPTIONS = (
    ("send_hwm", zmq.SNDHWM),
    ("receive_hwm", zmq.RCVHWM),
    ("linger_ms", zmq.LINGER),
    ("reconnect_interval_ms", zmq.RECONNECT_IVL),
    ("reconnect_interval_max_ms", zmq.RECONNECT_IVL_MAX),
)
"""The socket options every endpoint sets, by :class:`TransportConfig` field."""


@dataclass(frozen=True)
class TransportConfig:
    """Where and how a publisher binds or a subscriber connects; checked when constructed."""

    endpoint: str
    """A ZeroMQ endpoint: ``ipc:///tmp/x.ipc``, ``tcp://127.0.0.1:5555`` (``:*`` to bind any)."""
    send_hwm: int = 1000
    """Messages queued per subscriber before a PUB socket drops (0: no limit)."""
    receive_hwm: int = 1000
    """Messages queued on a SUB socket before its publisher drops (0: no limit)."""
    linger_ms: int = 0
    """How long close waits to flush queued messages (-1: forever, 0: drop them)."""
    reconnect_interval_ms: int = 100
    """First wait before reconnecting a broken connection (-1: never reconnect)."""
    reconnect_interval_max_ms: int = 0
    """Cap of the doubling reconnect wait (0: no doubling, retry every interval)."""
    max_message_bytes: int = 64 * 1024 * 1024
    """Larger inbound messages drop the connection before they are allocated (-1: no limit)."""

    def __post_init__(self) -> None:
        if not isinstance(self.endpoint, str):
            raise InvalidConfig("endpoint must be a str")
        if not self.endpoint:
            raise InvalidConfig("endpoint must be non-empty")
        if "\0" in self.endpoint:
            raise InvalidConfig("endpoint must not contain NUL")
        for name, low, high in (
            ("send_hwm", 0, _INT_MAX),
            ("receive_hwm", 0, _INT_MAX),
            ("linger_ms", -1, _INT_MAX),
            ("reconnect_interval_ms", -1, _INT_MAX),
            ("reconnect_interval_max_ms", 0, _INT_MAX),
            ("max_message_bytes", -1, _INT64_MAX),
        ):
            value = getattr(self, name)
            if type(value) is not int:
                raise InvalidConfig(f"{name} must be an integer")
            if value < low:
                raise InvalidConfig(f"{name} must be >= {low}")
            if value > high:
                raise InvalidConfig(f"{name} must be <= {high}")


def as_config(config: TransportConfig | str) -> TransportConfig:
    """``config`` itself, or a default config for an endpoint string."""
    return config if isinstance(config, TransportConfig) else TransportConfig(config)


class _Endpoint:
    """A socket, the context it came from, and whether closing it also ends that context."""

    _what = "transport"
    _options: tuple[tuple[str, int], ...] = _OPTIONS

    def __init__(
        self, socket: zmq.Socket[Any], context: zmq.Context[Any], owns_context: bool
    ) -> None:
        self._socket = socket
        self._context = context
        self._owns_context = owns_context
        self._closed = False

    @classmethod
    def _open(
        cls,
        config: TransportConfig,
        kind: int,
        context: zmq.Context[Any] | None,
        action: str,
    ) -> Self:
        owns = context is None
        ctx: zmq.Context[Any] = zmq.Context() if context is None else context
        socket: zmq.Socket[Any] | None = None
        try:
            socket = ctx.socket(kind)
            socket.setsockopt(zmq.LINGER, config.linger_ms)
            socket.setsockopt(zmq.SNDHWM, config.send_hwm)
            socket.setsockopt(zmq.RCVHWM, config.receive_hwm)
            socket.setsockopt(zmq.RECONNECT_IVL, config.reconnect_interval_ms)
            socket.setsockopt(zmq.RECONNECT_IVL_MAX, config.reconnect_interval_max_ms)
            if kind == zmq.SUB:
                socket.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes)
                socket.setsockopt(zmq.SUBSCRIBE, b"")
            if action == "bind":
                socket.bind(config.endpoint)
            else:
                socket.connect(config.endpoint)
        except Exception as exc:  # leave nothing open, whatever failed
            if socket is not None:
                socket.close(linger=0)
            if owns:
                ctx.term()
            if isinstance(exc, zmq.ZMQError):
                raise SetupError(action, config.endpoint, exc.strerror) from exc
            raise
        return cls(socket, ctx, owns)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    @property
    def endpoint(self) -> str:
        """The endpoint last bound or connected, with a wildcard port resolved."""
        self._check_open()
        value: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        return value

    def socket_options(self) -> dict[str, int]:
        """The options as the socket holds them (read back from libzmq), keyed by their
        :class:`TransportConfig` field: what was applied, not what was asked for."""
        self._check_open()
        return {name: int(self._socket.getsockopt(option)) for name, option in self._options}

    def _check_open(self) -> None:
        if self._closed:
            raise FlowClosed(self._what)

    def close(self) -> None:
        """Close the socket (waiting up to ``linger_ms`` to flush); idempotent."""
        if self._closed:
            return
        self._closed = True
        self._socket.close()
        if self._owns_context:
            self._context.term()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class Publisher(_Endpoint):
    """A bound PUB socket that sends validated, canonically encoded messages."""

    _what = "publisher"

    @classmethod
    def bind(
        cls, config: TransportConfig | str, *, context: zmq.Context[Any] | None = None
    ) -> Publisher:
        """Bind a PUB socket; without ``context`` the publisher owns a private one."""
        return cls._open(as_config(config), zmq.PUB, context, "bind")

    def send(self, message: IpcMessage) -> None:
        """Validate, encode and publish ``message`` as one frame; never blocks.

        A closed publisher raises FlowClosed before the message is looked at.
        """
        self._check_open()
        self._send(encode(message))

    def send_frame(self, frame: bytes) -> None:
        """Publish ``frame`` as it is (already encoded bytes); never blocks."""
        self._check_open()
        self._send(frame)

    def _send(self, frame: bytes) -> None:
        try:
            self._socket.send(frame, zmq.DONTWAIT)
        except zmq.Again:  # PUB drops rather than blocks; a full queue is not an error
            return
        except zmq.ZMQError as exc:
            raise CommunicationError(f"ZeroMQ send failed: {exc.strerror}") from exc


class Subscriber(_Endpoint):
    """A connected SUB socket (empty subscription) that receives and decodes messages."""

    _what = "subscriber"
    _options = (*_OPTIONS, ("max_message_bytes", zmq.MAXMSGSIZE))

    def __init__(
        self, socket: zmq.Socket[Any], context: zmq.Context[Any], owns_context: bool
    ) -> None:
        super().__init__(socket, context, owns_context)
        self._wait_ms = -1  # the socket's ZMQ_RCVTIMEO
        self._waiter: tuple[asyncio.AbstractEventLoop, int, asyncio.Future[None]] | None = None

    @classmethod
    def connect(
        cls, config: TransportConfig | str, *, context: zmq.Context[Any] | None = None
    ) -> Subscriber:
        """Connect a SUB socket; without ``context`` the subscriber owns a private one."""
        return cls._open(as_config(config), zmq.SUB, context, "connect")

    def try_recv_frame(self) -> bytes | None:
        """The next frame, or ``None`` when none is waiting; framing faults raise."""
        self._check_open()
        return self._frame(zmq.DONTWAIT)

    def _frame(self, flags: int) -> bytes | None:
        """Receive one frame with ``flags`` (``None``: would block, or the receive timeout)."""
        socket = self._socket
        try:
            frame: bytes = socket.recv(flags)
        except zmq.Again:
            return None
        except zmq.ZMQError as exc:
            raise CommunicationError(f"ZeroMQ receive failed: {exc.strerror}") from exc
        # getsockopt, not the ``rcvmore`` attribute: pyzmq's attribute lookup is slow.
        if socket.getsockopt(zmq.RCVMORE):
            frames = 1
            while socket.getsockopt(zmq.RCVMORE):  # the rest is already here
                socket.recv()
                frames += 1
            raise FramingError(frames)
        if not frame:
            raise FramingError(1)
        return frame

    def poll(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a frame; whether one is waiting (none is taken).

        A NaN or negative ``timeout`` raises InvalidArgument.
        """
        if not timeout >= 0:  # also NaN
            raise InvalidArgument(f"timeout must be a number of seconds >= 0, got {timeout!r}")
        self._check_open()
        wait = min(math.ceil(timeout * 1000), _MAX_WAIT_MS)
        return bool(self._socket.poll(wait, zmq.POLLIN))

    def try_recv(self) -> IpcMessage | None:
        """Receive and decode one message without blocking; ``None`` means none is waiting.

        A frame that fails to decode or validate is consumed and its error raised:
        CommunicationError for framing, version and structure, InvalidInput for rules.
        """
        frame = self.try_recv_frame()
        return None if frame is None else decode(frame)

    def recv(self, timeout: float | None = None) -> IpcMessage | None:
        """Block until a message arrives (``None`` after ``timeout`` seconds without one).

        ``timeout`` None or infinite waits as long as it takes; 0 only looks; a NaN or negative
        one raises InvalidArgument before anything is received.
        """
        if timeout is not None:
            if not timeout >= 0:  # also NaN
                raise InvalidArgument(
                    f"timeout must be a number of seconds >= 0 or None, got {timeout!r}"
                )
            if timeout == math.inf:
                timeout = None
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._check_open()
            if deadline is None:
                wait = -1
            else:
                remaining = deadline - time.monotonic()
                wait = 0 if remaining <= 0 else min(max(1, int(remaining * 1000)), _MAX_WAIT_MS)
            if wait == 0:
                frame = self._frame(zmq.DONTWAIT)
                return None if frame is None else decode(frame)
            # A blocking receive that waits at most ``wait`` ms (ZMQ_RCVTIMEO): no poll, and
            # no exception per message, when frames arrive slower than they are decoded.
            if wait != self._wait_ms:
                self._socket.setsockopt(zmq.RCVTIMEO, wait)
                self._wait_ms = wait
            frame = self._frame(0)
            if frame is not None:
                return decode(frame)

    async def arecv(self) -> IpcMessage:
        """Await the next message without blocking the event loop (cancel to stop waiting)."""
        loop = asyncio.get_running_loop()
        while True:
            message = self.try_recv()
            if message is not None:
                return message
            await self._readable(loop)

    async def _readable(self, loop: asyncio.AbstractEventLoop) -> None:
        # ZMQ_FD only signals that ZMQ_EVENTS may have changed: register first, then look.
        fd = cast(int, self._socket.getsockopt(zmq.FD))
        ready: asyncio.Future[None] = loop.create_future()
        loop.add_reader(fd, _wake, ready)
        self._waiter = (loop, fd, ready)
        try:
            if cast(int, self._socket.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                return
            await ready
        finally:
            if self._waiter is not None:
                self._waiter = None
                loop.remove_reader(fd)

    def close(self) -> None:
        """Close the socket; a pending :meth:`arecv` then raises FlowClosed."""
        if self._waiter is not None:
            loop, fd, ready = self._waiter
            self._waiter = None
            loop.remove_reader(fd)
            _wake(ready)
        super().close()


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


__all__ = ["Publisher", "Subscriber", "TransportConfig", "as_config"]
