"""Flow transport: PUB/SUB over real ipc:// and tcp://127.0.0.1 sockets."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import ClassVar

import pytest
import zmq

from helpers.net import IpcEndpoints
from tensorswap.flow import (
    CommunicationError,
    EmbeddingBatch,
    FlowClosed,
    FramingError,
    InitializationError,
    InvalidArgument,
    InvalidConfig,
    Loss,
    MalformedMessage,
    Ping,
    Publisher,
    SetupError,
    SpikeBatch,
    SpikeEvent,
    Subscriber,
    TransportConfig,
    ValidationError,
    WireVersionError,
    encode,
    encode_message,
)

Pair = tuple[Publisher, Subscriber]


def config(endpoint: str, **options: int) -> TransportConfig:
    return TransportConfig(endpoint, linger_ms=0, **options)


def synchronize(publisher: Publisher, subscriber: Subscriber, seconds: float = 5.0) -> None:
    """Publish pings until one arrives (the slow joiner), then drain the rest."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        publisher.send(Ping())
        if subscriber.recv(timeout=0.01) is not None:
            break
    else:
        pytest.fail("the subscriber never joined")
    while subscriber.recv(timeout=0.05) is not None:
        pass


@pytest.fixture(params=["ipc", "tcp"])
def pair(request: pytest.FixtureRequest, ipc_endpoint: IpcEndpoints) -> Iterator[Pair]:
    endpoint = ipc_endpoint("pair") if request.param == "ipc" else "tcp://127.0.0.1:*"
    publisher = Publisher.bind(config(endpoint))
    try:
        subscriber = Subscriber.connect(config(publisher.endpoint))
        try:
            synchronize(publisher, subscriber)
            yield publisher, subscriber
        finally:
            subscriber.close()
    finally:
        publisher.close()


# ── configuration ───────────────────────────────────────────────────────────────────────────────
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"endpoint": ""}, "endpoint must be non-empty"),
        ({"endpoint": "ipc:///tmp/a\0b"}, "endpoint must not contain NUL"),
        ({"endpoint": 5}, "endpoint must be a str"),
        ({"send_hwm": -1}, "send_hwm must be >= 0"),
        ({"receive_hwm": -1}, "receive_hwm must be >= 0"),
        ({"linger_ms": -2}, "linger_ms must be >= -1"),
        ({"reconnect_interval_ms": -2}, "reconnect_interval_ms must be >= -1"),
        ({"reconnect_interval_max_ms": -1}, "reconnect_interval_max_ms must be >= 0"),
        ({"max_message_bytes": -2}, "max_message_bytes must be >= -1"),
        ({"send_hwm": 1.5}, "send_hwm must be an integer"),
        ({"linger_ms": True}, "linger_ms must be an integer"),
        ({"send_hwm": 2**31}, "send_hwm must be <= 2147483647"),
        ({"receive_hwm": 2**31}, "receive_hwm must be <= 2147483647"),
        ({"linger_ms": 2**40}, "linger_ms must be <= 2147483647"),
        ({"reconnect_interval_ms": 2**31}, "reconnect_interval_ms must be <= 2147483647"),
        ({"reconnect_interval_max_ms": 2**31}, "reconnect_interval_max_ms must be <= 2147483647"),
        ({"max_message_bytes": 2**63}, "max_message_bytes must be <= 9223372036854775807"),
    ],
)
def test_config_is_checked_with_the_seeds_messages(
    options: dict[str, object], message: str
) -> None:
    fields: dict[str, object] = {"endpoint": "ipc:///tmp/x.ipc", **options}
    with pytest.raises(InvalidConfig) as info:
        TransportConfig(**fields)  # type: ignore[arg-type]
    assert str(info.value) == message
    assert isinstance(info.value, InitializationError)
    assert isinstance(info.value, ValueError)


def test_boundary_configs_are_accepted() -> None:
    TransportConfig(
        "tcp://127.0.0.1:*",
        send_hwm=0,
        receive_hwm=0,
        linger_ms=-1,
        reconnect_interval_ms=-1,
        reconnect_interval_max_ms=0,
        max_message_bytes=-1,
    )


def test_the_largest_configs_open(ipc_endpoint: IpcEndpoints) -> None:
    top = 2**31 - 1
    options = TransportConfig(
        ipc_endpoint("top"),
        send_hwm=top,
        receive_hwm=top,
        linger_ms=0,
        reconnect_interval_ms=top,
        reconnect_interval_max_ms=top,
        max_message_bytes=2**63 - 1,
    )
    with Subscriber.connect(options) as subscriber:
        applied = subscriber.socket_options()
        assert applied["max_message_bytes"] == 2**63 - 1
        assert applied["send_hwm"] == top


class _RecordingContext(zmq.Context):  # type: ignore[type-arg]
    """A context that remembers itself and its sockets, to check what a failure leaves open."""

    contexts: ClassVar[list[zmq.Context[bytes]]] = []
    sockets: ClassVar[list[zmq.Socket[bytes]]] = []

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        _RecordingContext.contexts.append(self)

    def socket(self, *args: object, **kwargs: object) -> zmq.Socket[bytes]:  # type: ignore[override]
        made: zmq.Socket[bytes] = super().socket(*args, **kwargs)  # type: ignore[arg-type]
        _RecordingContext.sockets.append(made)
        return made


@pytest.mark.parametrize("kind", [Publisher.bind, Subscriber.connect])
def test_a_failed_open_leaves_nothing_open_whatever_failed(
    ipc_endpoint: IpcEndpoints,
    monkeypatch: pytest.MonkeyPatch,
    kind: Callable[[TransportConfig], object],
) -> None:
    options = config(ipc_endpoint("fail"))
    object.__setattr__(options, "receive_hwm", 2**40)  # past the check: setsockopt overflows
    monkeypatch.setattr(_RecordingContext, "contexts", [])
    monkeypatch.setattr(_RecordingContext, "sockets", [])
    monkeypatch.setattr(zmq, "Context", _RecordingContext)
    try:
        with pytest.raises(OverflowError):
            kind(options)
        (context,) = _RecordingContext.contexts
        assert [sock.closed for sock in _RecordingContext.sockets] == [True]
        assert context.closed
    finally:  # without the fix, close what leaked so that the suite's warnings stay clean
        for sock in _RecordingContext.sockets:
            sock.close(linger=0)
        for leaked in _RecordingContext.contexts:
            leaked.term()


def test_options_reach_the_sockets(ipc_endpoint: IpcEndpoints) -> None:
    options = TransportConfig(
        ipc_endpoint("opts"),
        send_hwm=7,
        receive_hwm=9,
        linger_ms=3,
        reconnect_interval_ms=11,
        reconnect_interval_max_ms=13,
        max_message_bytes=4096,
    )
    with Publisher.bind(options) as publisher, Subscriber.connect(options) as subscriber:
        common = {
            "linger_ms": 3,
            "send_hwm": 7,
            "receive_hwm": 9,
            "reconnect_interval_ms": 11,
            "reconnect_interval_max_ms": 13,
        }
        assert publisher.socket_options() == common
        assert subscriber.socket_options() == {**common, "max_message_bytes": 4096}


@pytest.mark.parametrize("endpoint", ["not-an-endpoint", "tcp://", "bogus://x"])
def test_a_refused_bind_or_connect_is_a_setup_error(endpoint: str) -> None:
    with pytest.raises(SetupError) as info:
        Publisher.bind(config(endpoint))
    assert info.value.action == "bind" and info.value.endpoint == endpoint
    with pytest.raises(SetupError):
        Subscriber.connect(config(endpoint))


def test_binding_a_taken_port_is_a_setup_error() -> None:
    with Publisher.bind(config("tcp://127.0.0.1:*")) as first, pytest.raises(SetupError):
        Publisher.bind(config(first.endpoint))


def test_a_wildcard_tcp_port_is_resolved() -> None:
    with Publisher.bind(config("tcp://127.0.0.1:*")) as publisher:
        host, _, port = publisher.endpoint.rpartition(":")
        assert host == "tcp://127.0.0.1" and int(port) > 0


# ── exchanging messages ─────────────────────────────────────────────────────────────────────────
def test_messages_arrive_decoded_and_in_order(pair: Pair) -> None:
    publisher, subscriber = pair
    sent = [
        Loss(0.25),
        SpikeBatch(
            session_id="s",
            batch_id=3,
            timestamp=4,
            spikes=[SpikeEvent(channel=1, time=2, strength=0.5)],
        ),
        EmbeddingBatch(session_id=None, batch_id=5, embedding=[0.5, -1.0], sequence_length=2),
        Ping(),
    ]
    for message in sent:
        publisher.send(message)
    assert [subscriber.recv(timeout=5) for _ in sent] == sent
    assert subscriber.try_recv() is None


def test_try_recv_does_not_block_and_recv_times_out(pair: Pair) -> None:
    _, subscriber = pair
    assert subscriber.try_recv() is None
    start = time.monotonic()
    assert subscriber.recv(timeout=0.05) is None
    assert time.monotonic() - start >= 0.04


def test_recv_without_a_timeout_waits_for_the_next_message(pair: Pair) -> None:
    publisher, subscriber = pair
    publisher.send(Loss(0.25))
    assert subscriber.recv() == Loss(0.25)
    sender = threading.Timer(0.05, publisher.send, (Loss(0.5),))
    sender.start()
    try:
        assert subscriber.recv() == Loss(0.5)  # blocks until the timer's message is in
    finally:
        sender.join()


def test_an_infinite_timeout_waits_like_none(pair: Pair) -> None:
    publisher, subscriber = pair
    publisher.send(Loss(0.25))
    assert subscriber.recv(timeout=math.inf) == Loss(0.25)
    sender = threading.Timer(0.05, publisher.send, (Loss(0.5),))
    sender.start()
    try:
        assert subscriber.recv(timeout=float("inf")) == Loss(0.5)
    finally:
        sender.join()


@pytest.mark.parametrize("timeout", [math.nan, -0.5, -math.inf])
def test_a_nan_or_negative_timeout_is_refused(pair: Pair, timeout: float) -> None:
    publisher, subscriber = pair
    publisher.send(Loss(0.25))
    with pytest.raises(InvalidArgument, match="timeout must be a number of seconds >= 0"):
        subscriber.recv(timeout=timeout)
    assert isinstance(InvalidArgument("x"), ValueError)
    assert subscriber.recv(timeout=5) == Loss(0.25)  # nothing was received


def test_receive_timeouts_leave_try_recv_non_blocking(pair: Pair) -> None:
    publisher, subscriber = pair
    assert subscriber.recv(timeout=0.2) is None  # sets a 200 ms ZMQ_RCVTIMEO
    publisher.send(Loss(0.25))
    assert subscriber.recv(timeout=3600) == Loss(0.25)  # leaves a one-hour ZMQ_RCVTIMEO
    # A blocking try_recv would now hang for an hour and trip the suite's timeout.
    assert subscriber.try_recv() is None
    publisher.send(Loss(0.5))
    assert subscriber.recv(timeout=10**7) == Loss(0.5)  # beyond ZMQ_RCVTIMEO's int range
    assert subscriber.recv(timeout=0) is None


def test_poll_waits_for_a_frame_and_takes_none(pair: Pair) -> None:
    publisher, subscriber = pair
    assert subscriber.poll(0) is False
    publisher.send(Loss(2.0))
    assert subscriber.poll(5) is True
    assert subscriber.poll(0) is True  # still there: poll does not receive
    assert subscriber.try_recv() == Loss(2.0)
    for bad in (-1.0, math.nan):
        with pytest.raises(InvalidArgument):
            subscriber.poll(bad)


def test_a_published_message_is_validated_first(pair: Pair) -> None:
    publisher, subscriber = pair
    with pytest.raises(ValidationError):
        publisher.send(Loss(float("nan")))
    publisher.send(Loss(1.0))
    assert subscriber.recv(timeout=5) == Loss(1.0)


def test_bare_and_canonical_frames_are_both_read(pair: Pair) -> None:
    publisher, subscriber = pair
    publisher.send_frame(encode_message(Loss(0.5)))
    publisher.send_frame(encode(Loss(0.75)))
    assert subscriber.recv(timeout=5) == Loss(0.5)
    assert subscriber.recv(timeout=5) == Loss(0.75)


@pytest.mark.parametrize("kind", ["ipc", "tcp"])
def test_empty_and_multipart_messages_are_framing_faults(
    kind: str, ipc_endpoint: IpcEndpoints
) -> None:
    """A Publisher sends one frame per message; a foreign PUB socket may send several."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    raw = context.socket(zmq.PUB)
    raw.setsockopt(zmq.LINGER, 0)
    try:
        raw.bind(ipc_endpoint("raw") if kind == "ipc" else "tcp://127.0.0.1:*")
        with Subscriber.connect(config(raw.getsockopt_string(zmq.LAST_ENDPOINT))) as subscriber:
            deadline = time.monotonic() + 5
            while subscriber.recv(timeout=0.01) is None:  # the slow joiner
                assert time.monotonic() < deadline, "the subscriber never joined"
                raw.send(encode(Ping()))
            while subscriber.recv(timeout=0.05) is not None:
                pass
            raw.send(b"")
            raw.send_multipart([encode(Ping()), b"b", b"c"])
            raw.send(encode(Loss(0.5)))
            _expect_framing_faults(subscriber)
    finally:
        raw.close()
        context.term()


def _expect_framing_faults(subscriber: Subscriber) -> None:
    assert subscriber.poll(5)
    with pytest.raises(FramingError) as empty:
        subscriber.recv(timeout=5)
    assert empty.value.frames == 1
    with pytest.raises(FramingError) as multipart:
        subscriber.recv(timeout=5)
    assert multipart.value.frames == 3
    assert isinstance(multipart.value, CommunicationError)
    assert subscriber.recv(timeout=5) == Loss(0.5)  # the faulty frames were consumed whole


@pytest.mark.parametrize(
    ("frame", "error"),
    [
        (b"not json", MalformedMessage),
        (b'{"payload":"Ping","wire_version":7}', WireVersionError),
        (b'{"Spikes":{"session_id":null}}', MalformedMessage),
        (b'{"Loss":1e39}', ValidationError),
    ],
)
def test_a_bad_frame_raises_and_is_consumed(pair: Pair, frame: bytes, error: type) -> None:
    publisher, subscriber = pair
    publisher.send_frame(frame)
    publisher.send(Ping())
    assert subscriber.poll(5)
    with pytest.raises(error):
        subscriber.recv(timeout=5)
    assert subscriber.recv(timeout=5) == Ping()


def test_an_oversized_message_drops_the_connection_unread(ipc_endpoint: IpcEndpoints) -> None:
    endpoint = ipc_endpoint("big")
    with (
        Publisher.bind(config(endpoint)) as publisher,
        Subscriber.connect(config(endpoint, max_message_bytes=200)) as subscriber,
    ):
        synchronize(publisher, subscriber)
        big = EmbeddingBatch(session_id=None, batch_id=1, embedding=[0.5] * 100, sequence_length=1)
        publisher.send(big)
        publisher.send(Ping())
        # Nothing can arrive: the frame is refused by size and libzmq drops that connection.
        assert subscriber.recv(timeout=0.3) is None


def test_a_shared_context_outlives_its_sockets(ipc_endpoint: IpcEndpoints) -> None:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        publisher = Publisher.bind(config(ipc_endpoint("shared")), context=context)
        publisher.close()
        assert not context.closed
    finally:
        context.term()


# ── closing ─────────────────────────────────────────────────────────────────────────────────────
def test_every_call_after_close_is_transport_closed(pair: Pair) -> None:
    publisher, subscriber = pair
    publisher.close()
    subscriber.close()
    publisher.close()  # idempotent
    assert publisher.closed and subscriber.closed
    with pytest.raises(FlowClosed):
        publisher.send(Loss(float("nan")))  # closed wins over an invalid payload
    with pytest.raises(FlowClosed):
        publisher.send_frame(b"x")
    with pytest.raises(FlowClosed):
        subscriber.try_recv()
    with pytest.raises(FlowClosed, match="the subscriber is closed"):
        subscriber.recv(timeout=0.01)
    with pytest.raises(FlowClosed):
        _ = publisher.endpoint


# ── asyncio ─────────────────────────────────────────────────────────────────────────────────────
async def test_arecv_awaits_the_next_message(pair: Pair) -> None:
    publisher, subscriber = pair
    waiter = asyncio.ensure_future(subscriber.arecv())
    await asyncio.sleep(0)
    assert not waiter.done()
    publisher.send(Loss(0.5))
    assert await asyncio.wait_for(waiter, 5) == Loss(0.5)


async def test_arecv_can_be_cancelled_and_used_again(pair: Pair) -> None:
    publisher, subscriber = pair
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(subscriber.arecv(), 0.05)
    publisher.send(Ping())
    assert await asyncio.wait_for(subscriber.arecv(), 5) == Ping()


async def test_close_wakes_a_pending_arecv(pair: Pair) -> None:
    _, subscriber = pair
    waiter = asyncio.ensure_future(subscriber.arecv())
    await asyncio.sleep(0.01)
    subscriber.close()
    with pytest.raises(FlowClosed):
        await asyncio.wait_for(waiter, 5)
