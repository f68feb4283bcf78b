"""The binary readout backend (corpus-ipc's ``ZmqIpcBackend``): a SUB socket of raw packets.

A packet is ``[i64 LE tick][N x f32 LE]``. Each read drains what is waiting without blocking
(at most 64 packets or 5 ms), keeps the newest valid packet, and counts the valid packets it
passed over (``skipped_readouts``) and the invalid ones (``malformed_readouts``). When nothing
valid arrived, the previous readout is returned again.
"""

from __future__ import annotations

import math
import os
import re
import struct
import time
from collections.abc import Sequence
from typing import Any

import zmq

from tensorswap.flow.errors import (
    CommunicationError,
    FlowError,
    InitializationError,
    InvalidArgument,
    InvalidConfig,
    MalformedReadout,
    ReadoutLimitExceeded,
)

DEFAULT_READOUT_ENDPOINT = "ipc:///tmp/corpus_ipc_readout.ipc"
ENV_READOUT_ENDPOINT = "CORPUS_IPC_ZMQ_READOUT_IPC"
DEFAULT_MAX_READOUT_FLOATS = 1024
ENV_MAX_READOUT_FLOATS = "CORPUS_IPC_ZMQ_MAX_READOUT_FLOATS"
READOUT_RECEIVE_HWM = 16
READOUT_RECONNECT_MS = 100
READOUT_RECONNECT_MAX_MS = 5000
DRAIN_MAX_PACKETS = 64
DRAIN_MAX_SECONDS = 0.005
DEFAULT_READOUT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""ZMQ_MAXMSGSIZE of the readout socket: generous, since libzmq drops the connection on a larger
message, but it keeps a hostile or broken producer from making the receiver allocate any size."""
_INT64_MAX = 2**63 - 1

_TICK = struct.Struct("<q")
_USIZE = re.compile(r"\+?0*([0-9]{1,20})")
"""What Rust's ``str::parse::<usize>`` may accept: a sign, leading zeros, at most 20 digits."""
_USIZE_MAX = 2**64 - 1


def max_readout_floats() -> int:
    """``CORPUS_IPC_ZMQ_MAX_READOUT_FLOATS`` when it is a positive integer that fits a usize
    (64-bit), else 1024, as corpus-ipc falls back when ``parse::<usize>()`` fails."""
    match = _USIZE.fullmatch(os.environ.get(ENV_MAX_READOUT_FLOATS, ""))
    value = int(match[1]) if match else 0  # never more than 20 digits for int()
    return value if 0 < value <= _USIZE_MAX else DEFAULT_MAX_READOUT_FLOATS


def readout_endpoint() -> str:
    """``CORPUS_IPC_ZMQ_READOUT_IPC`` when set, else :data:`DEFAULT_READOUT_ENDPOINT`."""
    return os.environ.get(ENV_READOUT_ENDPOINT) or DEFAULT_READOUT_ENDPOINT


def encode_readout_packet(tick: int, readout: Sequence[float]) -> bytes:
    """The packet for ``tick`` and ``readout`` (floats rounded to f32)."""
    return _TICK.pack(tick) + struct.pack(f"<{len(readout)}f", *readout)


def parse_readout_packet(packet: bytes, max_floats: int) -> tuple[int, list[float]]:
    """Split a packet into its tick and floats.

    Raises MalformedReadout (CommunicationError) for a header shorter than 8 bytes or a float
    area that is not a multiple of 4 bytes, ReadoutLimitExceeded (InvalidInput) for more than
    ``max_floats`` floats; the count is checked before any float is read.
    """
    size = len(packet)
    if size < 8:
        raise MalformedReadout(
            f"ZMQ readout packet too short: {size} bytes (need 8-byte tick header)", size
        )
    payload = size - 8
    if payload % 4:
        raise MalformedReadout(
            f"ZMQ readout payload misaligned: {payload} bytes after header "
            "(must be a multiple of 4)",
            size,
        )
    count = payload // 4
    if count > max_floats:
        raise ReadoutLimitExceeded(count, max_floats)
    (tick,) = _TICK.unpack_from(packet)
    return tick, list(struct.unpack_from(f"<{count}f", packet, 8))


class ReadoutBackend:
    """Subscribes to a compute process's readout PUB socket; returns its latest readout."""

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        max_floats: int | None = None,
        max_message_bytes: int = DEFAULT_READOUT_MAX_MESSAGE_BYTES,
    ) -> None:
        """``endpoint``/``max_floats`` default to the environment, read at :meth:`initialize`.

        ``max_message_bytes`` (-1: no limit) is the socket's ZMQ_MAXMSGSIZE: libzmq refuses a
        larger packet before allocating it, and drops that producer's connection.
        """
        if type(max_message_bytes) is not int:
            raise InvalidConfig("max_message_bytes must be an integer")
        if max_message_bytes < -1:
            raise InvalidConfig("max_message_bytes must be >= -1")
        if max_message_bytes > _INT64_MAX:
            raise InvalidConfig(f"max_message_bytes must be <= {_INT64_MAX}")
        self._max_message_bytes = max_message_bytes
        self._endpoint = endpoint
        self._max_floats = max_floats
        self._context: zmq.Context[Any] | None = None
        self._socket: zmq.Socket[Any] | None = None
        self._tick = 0
        self._readout: list[float] = []
        self._skipped = 0
        self._malformed = 0

    @property
    def initialized(self) -> bool:
        """Whether the SUB socket is connected."""
        return self._socket is not None

    @property
    def endpoint(self) -> str:
        """The endpoint this backend connects (or will connect) to."""
        return self._endpoint or readout_endpoint()

    @property
    def max_message_bytes(self) -> int:
        """The largest packet the socket accepts (ZMQ_MAXMSGSIZE; -1: no limit)."""
        return self._max_message_bytes

    @property
    def max_floats(self) -> int | None:
        """Floats a packet may carry; ``None`` until :meth:`initialize` reads the environment
        (``ENV_MAX_READOUT_FLOATS``) when none was given."""
        return self._max_floats

    @property
    def tick(self) -> int:
        """The tick of the last valid packet (0 before any)."""
        return self._tick

    @property
    def last_readout(self) -> list[float]:
        """A copy of the last valid readout."""
        return list(self._readout)

    @property
    def skipped_readouts(self) -> int:
        """Valid packets passed over because a newer one came in the same read."""
        return self._skipped

    @property
    def malformed_readouts(self) -> int:
        """Packets dropped for a short header, misaligned floats or too many floats."""
        return self._malformed

    def initialize(self) -> None:
        """Create the SUB socket and connect; a second call is a no-op until :meth:`reset`."""
        if self._socket is not None:
            return
        endpoint = self.endpoint
        if self._max_floats is None:
            self._max_floats = max_readout_floats()
        context: zmq.Context[Any] = zmq.Context()
        socket = context.socket(zmq.SUB)
        try:
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.RCVHWM, READOUT_RECEIVE_HWM)
            socket.setsockopt(zmq.RECONNECT_IVL, READOUT_RECONNECT_MS)
            socket.setsockopt(zmq.RECONNECT_IVL_MAX, READOUT_RECONNECT_MAX_MS)
            socket.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
            socket.setsockopt(zmq.SUBSCRIBE, b"")
            socket.connect(endpoint)
        except zmq.ZMQError as exc:
            socket.close(linger=0)
            context.term()
            raise InitializationError(
                f"ZMQ connect to {endpoint}: {exc.strerror} (is the IPC producer running?)"
            ) from exc
        self._context, self._socket = context, socket

    def poll(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds (>= 0) for a packet; whether one is waiting (none
        is read: :meth:`process_batch` reads them). A NaN or negative one: InvalidArgument."""
        if not timeout >= 0:  # also NaN
            raise InvalidArgument(f"timeout must be a number of seconds >= 0, got {timeout!r}")
        socket = self._connected()
        return bool(socket.poll(min(math.ceil(timeout * 1000), 2**31 - 1), zmq.POLLIN))

    def socket_options(self) -> dict[str, int]:
        """The SUB socket's options read back from libzmq: ``linger_ms``, ``receive_hwm``,
        ``reconnect_interval_ms``, ``reconnect_interval_max_ms``, ``max_message_bytes``."""
        socket = self._connected()
        return {
            name: int(socket.getsockopt(option))
            for name, option in (
                ("linger_ms", zmq.LINGER),
                ("receive_hwm", zmq.RCVHWM),
                ("reconnect_interval_ms", zmq.RECONNECT_IVL),
                ("reconnect_interval_max_ms", zmq.RECONNECT_IVL_MAX),
                ("max_message_bytes", zmq.MAXMSGSIZE),
            )
        }

    def _connected(self) -> zmq.Socket[Any]:
        if self._socket is None:
            raise InitializationError("ReadoutBackend not initialized: call initialize() first")
        return self._socket

    def process_batch(self, inputs: Sequence[float] = ()) -> list[float]:
        """Drain waiting packets and return the newest readout (``inputs`` are ignored)."""
        self._drain(self._connected(), self._max_floats or DEFAULT_MAX_READOUT_FLOATS)
        return list(self._readout)

    def _drain(self, socket: zmq.Socket[Any], max_floats: int) -> None:
        deadline = time.monotonic() + DRAIN_MAX_SECONDS
        newest: tuple[int, list[float]] | None = None
        for _ in range(DRAIN_MAX_PACKETS):
            try:
                packet: bytes = socket.recv(zmq.DONTWAIT)
            except zmq.Again:
                break
            except zmq.ZMQError as exc:
                raise CommunicationError(f"ZMQ recv failed: {exc.strerror}") from exc
            multipart = False
            while socket.rcvmore:
                socket.recv()
                multipart = True
            try:
                if multipart:
                    raise MalformedReadout("multipart readout packet", len(packet))
                parsed = parse_readout_packet(packet, max_floats)
            except FlowError:
                self._malformed += 1
            else:
                if newest is not None:
                    self._skipped += 1
                newest = parsed
            if time.monotonic() >= deadline:
                break
        if newest is not None:
            self._tick, self._readout = newest

    def get_spike_states(self) -> list[bool]:
        """Per channel, whether the last readout exceeds 0.5."""
        return [value > 0.5 for value in self._readout]

    def save_state(self, model_path: str) -> None:
        """A no-op: the state lives in the remote compute process."""

    def reset(self) -> None:
        """Forget the cached readout and counters and close the socket; initialize again later."""
        self._tick = 0
        self._readout = []
        self._skipped = 0
        self._malformed = 0
        self.close()

    def close(self) -> None:
        """Close the socket and its context; idempotent."""
        socket, context = self._socket, self._context
        self._socket = self._context = None
        if socket is not None:
            socket.close(linger=0)
        if context is not None:
            context.term()

    def __enter__(self) -> ReadoutBackend:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


__all__ = [
    "DEFAULT_MAX_READOUT_FLOATS",
    "DEFAULT_READOUT_ENDPOINT",
    "DEFAULT_READOUT_MAX_MESSAGE_BYTES",
    "ENV_MAX_READOUT_FLOATS",
    "ENV_READOUT_ENDPOINT",
    "ReadoutBackend",
    "encode_readout_packet",
    "max_readout_floats",
    "parse_readout_packet",
    "readout_endpoint",
]
