"""The binary readout backend: ``[i64 LE tick][N x f32 LE]`` packets, limits and draining."""

from __future__ import annotations

import struct
import time
from collections import deque
from collections.abc import Iterator

import pytest
import zmq

from helpers.net import IpcEndpoints
from tensorswap.flow import (
    CommunicationError,
    InitializationError,
    InvalidConfig,
    InvalidInput,
    MalformedReadout,
    ReadoutBackend,
    ReadoutLimitExceeded,
    parse_readout_packet,
)
from tensorswap.flow import readout as readout_module
from tensorswap.flow.readout import (
    DEFAULT_MAX_READOUT_FLOATS,
    DEFAULT_READOUT_ENDPOINT,
    ENV_MAX_READOUT_FLOATS,
    ENV_READOUT_ENDPOINT,
    encode_readout_packet,
    max_readout_floats,
    readout_endpoint,
)


def packet(tick: int, *values: float) -> bytes:
    return struct.pack(f"<q{len(values)}f", tick, *values)


# ── packets ─────────────────────────────────────────────────────────────────────────────────────
def test_the_layout_is_little_endian_tick_then_floats() -> None:
    data = bytes.fromhex("2a000000000000000000803f000000bf")
    assert parse_readout_packet(data, 1024) == (42, [1.0, -0.5])
    assert encode_readout_packet(42, [1.0, -0.5]) == data


@pytest.mark.parametrize("count", [0, 1, 16, 20, 1024])
def test_valid_sizes_parse(count: int) -> None:
    values = [i * 0.25 for i in range(count)]
    tick, readout = parse_readout_packet(packet(-7, *values), 1024)
    assert tick == -7 and readout == values
    assert len(packet(-7, *values)) == 8 + 4 * count


def test_twenty_floats_are_not_split_into_readouts_and_modulators() -> None:
    _, readout = parse_readout_packet(packet(1, *range(20)), 1024)
    assert len(readout) == 20


@pytest.mark.parametrize(
    ("data", "text"),
    [
        (b"", "ZMQ readout packet too short: 0 bytes (need 8-byte tick header)"),
        (bytes(5), "ZMQ readout packet too short: 5 bytes (need 8-byte tick header)"),
        (
            bytes(9),
            "ZMQ readout payload misaligned: 1 bytes after header (must be a multiple of 4)",
        ),
        (
            bytes(15),
            "ZMQ readout payload misaligned: 7 bytes after header (must be a multiple of 4)",
        ),
    ],
)
def test_short_or_misaligned_packets_are_communication_errors(data: bytes, text: str) -> None:
    with pytest.raises(MalformedReadout) as info:
        parse_readout_packet(data, 1024)
    assert str(info.value) == text
    assert info.value.size == len(data)
    assert isinstance(info.value, CommunicationError)


def test_more_floats_than_the_limit_are_invalid_input() -> None:
    assert len(parse_readout_packet(bytes(8 + 4 * 1024), 1024)[1]) == 1024
    with pytest.raises(ReadoutLimitExceeded) as info:
        parse_readout_packet(bytes(8 + 4 * 1025), 1024)
    assert str(info.value) == "ZMQ readout float count 1025 exceeds limit 1024"
    assert (info.value.count, info.value.limit) == (1025, 1024)
    assert isinstance(info.value, InvalidInput)


# ── environment ─────────────────────────────────────────────────────────────────────────────────
@pytest.mark.parametrize(
    ("raw", "limit"),
    [
        (None, 1024),
        ("2048", 2048),
        ("+5", 5),
        ("0", 1024),
        ("-3", 1024),
        ("abc", 1024),
        (" 5", 1024),
        ("", 1024),
        ("9" * 5000, 1024),
        ("18446744073709551615", 2**64 - 1),
        ("18446744073709551616", 1024),
        ("99999999999999999999", 1024),
        ("+0002048", 2048),
        ("0" * 5000 + "7", 7),
        ("+", 1024),
    ],
)
def test_the_float_limit_comes_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, raw: str | None, limit: int
) -> None:
    if raw is None:
        monkeypatch.delenv(ENV_MAX_READOUT_FLOATS, raising=False)
    else:
        monkeypatch.setenv(ENV_MAX_READOUT_FLOATS, raw)
    assert max_readout_floats() == limit
    assert DEFAULT_MAX_READOUT_FLOATS == 1024


def test_initialize_with_a_float_limit_of_thousands_of_digits_uses_the_default(
    monkeypatch: pytest.MonkeyPatch, ipc_endpoint: IpcEndpoints
) -> None:
    monkeypatch.setenv(ENV_MAX_READOUT_FLOATS, "9" * 5000)
    with ReadoutBackend(ipc_endpoint("env")) as backend:
        assert backend.max_floats is None  # read at initialize
        backend.initialize()
        assert backend.max_floats == DEFAULT_MAX_READOUT_FLOATS


def test_the_endpoint_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_READOUT_ENDPOINT, raising=False)
    assert readout_endpoint() == DEFAULT_READOUT_ENDPOINT == "ipc:///tmp/corpus_ipc_readout.ipc"
    monkeypatch.setenv(ENV_READOUT_ENDPOINT, "tcp://127.0.0.1:5999")
    assert readout_endpoint() == "tcp://127.0.0.1:5999"
    assert ReadoutBackend().endpoint == "tcp://127.0.0.1:5999"
    assert ReadoutBackend("ipc:///tmp/other.ipc").endpoint == "ipc:///tmp/other.ipc"


# ── draining, deterministically through a stand-in socket ───────────────────────────────────────
class FakeSocket:
    """Queued frames (a tuple is one multipart message); ``recv`` raises Again when empty."""

    def __init__(self, *frames: bytes | tuple[bytes, ...]) -> None:
        self.frames: deque[bytes | tuple[bytes, ...]] = deque(frames)
        self.parts: deque[bytes] = deque()

    @property
    def rcvmore(self) -> bool:
        return bool(self.parts)

    def recv(self, flags: int = 0) -> bytes:
        if self.parts:
            return self.parts.popleft()
        if not self.frames:
            raise zmq.Again()
        frame = self.frames.popleft()
        if isinstance(frame, tuple):
            self.parts.extend(frame[1:])
            return frame[0]
        return frame


def drain(backend: ReadoutBackend, socket: FakeSocket, limit: int = 4) -> None:
    backend._drain(socket, limit)  # type: ignore[arg-type]


def test_a_read_keeps_the_newest_valid_packet_and_counts_the_rest() -> None:
    backend = ReadoutBackend()
    socket = FakeSocket(
        packet(1, 0.1),
        bytes(5),
        packet(2, 0.2),
        bytes(9),
        packet(3, *[0.0] * 5),  # over the limit of 4
        (packet(4, 0.4), b"x"),  # multipart
        packet(5, 0.9, 0.25),
    )
    drain(backend, socket)
    assert backend.tick == 5
    assert backend.last_readout == [pytest.approx(0.9), 0.25]
    assert backend.skipped_readouts == 2
    assert backend.malformed_readouts == 4
    assert backend.get_spike_states() == [True, False]


def test_a_read_without_a_valid_packet_keeps_the_last_readout() -> None:
    backend = ReadoutBackend()
    drain(backend, FakeSocket(packet(8, 1.0)))
    drain(backend, FakeSocket(bytes(3)))
    drain(backend, FakeSocket())
    assert (backend.tick, backend.last_readout, backend.malformed_readouts) == (8, [1.0], 1)


def test_a_read_takes_at_most_64_packets() -> None:
    backend = ReadoutBackend()
    socket = FakeSocket(*(packet(i, float(i)) for i in range(100)))
    drain(backend, socket)
    assert backend.tick == 63 and backend.skipped_readouts == 63
    assert len(socket.frames) == 36


def test_a_read_stops_at_its_time_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(readout_module, "DRAIN_MAX_SECONDS", 0.0)
    backend = ReadoutBackend()
    socket = FakeSocket(packet(1), packet(2))
    drain(backend, socket)
    assert backend.tick == 1 and len(socket.frames) == 1


# ── the backend over a real socket ──────────────────────────────────────────────────────────────
@pytest.fixture
def producer(ipc_endpoint: IpcEndpoints) -> Iterator[tuple[zmq.Socket[bytes], str]]:
    endpoint = ipc_endpoint("readout")
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    socket = context.socket(zmq.PUB)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        socket.bind(endpoint)
        yield socket, endpoint
    finally:
        socket.close()
        context.term()


@pytest.mark.parametrize(("given", "applied"), [(None, 64 * 1024 * 1024), (4104, 4104), (-1, -1)])
def test_max_message_bytes_reaches_the_readout_socket(
    given: int | None, applied: int, ipc_endpoint: IpcEndpoints
) -> None:
    endpoint = ipc_endpoint("cap")
    backend = (
        ReadoutBackend(endpoint)
        if given is None
        else ReadoutBackend(endpoint, max_message_bytes=given)
    )
    assert backend.max_message_bytes == applied
    with backend:
        backend.initialize()
        assert backend.socket_options()["max_message_bytes"] == applied


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (-2, "max_message_bytes must be >= -1"),
        (2**63, "max_message_bytes must be <= 9223372036854775807"),
        (1.5, "max_message_bytes must be an integer"),
        (True, "max_message_bytes must be an integer"),
    ],
)
def test_an_unusable_max_message_bytes_is_invalid_config(value: object, text: str) -> None:
    with pytest.raises(InvalidConfig) as info:
        ReadoutBackend("ipc:///tmp/never.ipc", max_message_bytes=value)  # type: ignore[arg-type]
    assert str(info.value) == text
    assert isinstance(info.value, InitializationError)


def test_process_batch_needs_initialize() -> None:
    backend = ReadoutBackend("ipc:///tmp/never.ipc")
    with pytest.raises(InitializationError, match="initialize"):
        backend.process_batch([1.0])
    with pytest.raises(InitializationError, match="initialize"):
        backend.poll(0)
    with pytest.raises(InitializationError, match="initialize"):
        backend.socket_options()


def test_a_refused_connect_is_an_initialization_error() -> None:
    backend = ReadoutBackend("not-an-endpoint")
    with pytest.raises(InitializationError, match="is the IPC producer running"):
        backend.initialize()
    assert not backend.initialized


def test_the_backend_reads_the_newest_packet_from_a_producer(
    producer: tuple[zmq.Socket[bytes], str],
) -> None:
    socket, endpoint = producer
    with ReadoutBackend(endpoint, max_floats=4) as backend:
        backend.initialize()
        backend.initialize()  # idempotent
        deadline = time.monotonic() + 5
        while backend.process_batch() == [] and time.monotonic() < deadline:
            socket.send(packet(0, 0.75))
            backend.poll(0.01)
        assert backend.tick == 0 and backend.last_readout == [0.75]
        malformed_before = backend.malformed_readouts
        for frame in (
            bytes(5),
            packet(1, 0.5),
            bytes(9),
            packet(2, *[0.0] * 5),
            packet(3, 1.0, 0.25),
        ):
            socket.send(frame)
        while backend.tick != 3 and time.monotonic() < deadline:
            backend.poll(0.01)
            backend.process_batch()
        assert backend.process_batch() == [1.0, 0.25]
        assert backend.malformed_readouts - malformed_before == 3
        assert backend.get_spike_states() == [True, False]
        backend.save_state("/nowhere")  # a no-op
        backend.reset()
        assert (backend.tick, backend.last_readout, backend.initialized) == (0, [], False)
        assert backend.skipped_readouts == backend.malformed_readouts == 0
        with pytest.raises(InitializationError):
            backend.process_batch()
        backend.initialize()
        assert backend.initialized
