"""The hybrid flow backend: corpus-ipc's ZmqHybridFlowBackend behaviours, over real sockets and
through test doubles where the order of frames must be exact."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest
import zmq

from helpers.net import IpcEndpoints
from tensorswap.flow import (
    CommunicationError,
    EmbeddingBatch,
    FieldTypeError,
    FlowClosed,
    GradientBatch,
    GradientUpdate,
    HybridFlowBackend,
    InitializationError,
    InvalidConfig,
    InvalidInput,
    IpcMessage,
    Loss,
    MalformedMessage,
    Ping,
    ProtocolError,
    Publisher,
    SetupError,
    SlotOccupied,
    SpikeBatch,
    SpikeEvent,
    Subscriber,
    TraceBatch,
    TraceData,
    TransportConfig,
    UnexpectedVariant,
    ValidationError,
)

T = TypeVar("T")


def sample_gradients(batch_id: int = 1) -> GradientBatch:
    return GradientBatch(
        session_id="session",
        batch_id=batch_id,
        gradients=[GradientUpdate(layer_id="layer", gradients=[0.5], eligibility_trace=None)],
    )


def sample_traces(batch_id: int = 1) -> TraceBatch:
    return TraceBatch(
        session_id="session",
        batch_id=batch_id,
        traces=[TraceData(channel_id=1, trace_value=0.25, last_spike_time=1)],
    )


SPIKES = SpikeBatch(
    session_id="s", batch_id=9, timestamp=10, spikes=[SpikeEvent(channel=2, time=3, strength=0.5)]
)
EMBEDDINGS = EmbeddingBatch(session_id=None, batch_id=4, embedding=[0.25], sequence_length=1)


# ── real sockets ────────────────────────────────────────────────────────────────────────────────
def cfg(endpoint: str) -> TransportConfig:
    return TransportConfig(endpoint, linger_ms=0)


@pytest.fixture
def opened(
    ipc_endpoint: IpcEndpoints,
) -> Iterator[tuple[HybridFlowBackend, Publisher, str]]:
    """A backend, the peer publisher bound on its inbound endpoint, its outbound endpoint."""
    outbound, inbound = ipc_endpoint(), ipc_endpoint()
    peer = Publisher.bind(cfg(inbound))
    try:
        backend = HybridFlowBackend.open(cfg(outbound), cfg(inbound))
        try:
            yield backend, peer, outbound
        finally:
            backend.close()
    finally:
        peer.close()


def _wait_inbound(backend: HybridFlowBackend) -> None:
    inbound = backend.inbound
    assert isinstance(inbound, Subscriber)
    inbound.poll(0.001)


def publish_until(
    backend: HybridFlowBackend,
    send: Callable[[], None],
    poll: Callable[[HybridFlowBackend], T | None],
) -> T:
    """Publish until ``poll`` returns something or raises (the peer may join late)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        send()
        outcome = poll(backend)
        if outcome is not None:
            return outcome
        _wait_inbound(backend)
    pytest.fail("timed out waiting for an inbound outcome")


def quiet_gradients(backend: HybridFlowBackend) -> None:
    """Drain gradients until none has arrived for 40 ms (bounded to 300 ms)."""
    started = quiet_since = time.monotonic()
    while time.monotonic() - started < 0.3:
        if backend.try_receive_gradients() is not None:
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since >= 0.04:
            return
        _wait_inbound(backend)


def test_unexpected_inbound_variants_are_protocol_errors(
    opened: tuple[HybridFlowBackend, Publisher, str],
) -> None:
    backend, peer, _ = opened
    assert repr(backend) == "<HybridFlowBackend open>"
    with pytest.raises(UnexpectedVariant) as info:
        publish_until(backend, lambda: peer.send(Ping()), HybridFlowBackend.try_receive_gradients)
    assert (info.value.found, info.value.expected) == ("Ping", "GradientUpdate")
    assert isinstance(info.value, ProtocolError)
    with pytest.raises(UnexpectedVariant) as trace_info:
        publish_until(backend, lambda: peer.send(Ping()), HybridFlowBackend.try_receive_traces)
    assert (trace_info.value.found, trace_info.value.expected) == ("Ping", "EligibilityTraces")


def test_open_reports_a_failed_inbound_connect(ipc_endpoint: IpcEndpoints) -> None:
    outbound = ipc_endpoint()
    with pytest.raises(SetupError) as info:
        HybridFlowBackend.open(cfg(outbound), cfg("not-an-endpoint"))
    assert isinstance(info.value, InitializationError)
    with Publisher.bind(cfg(outbound)):  # nothing was left bound
        pass


def test_open_rejects_equal_endpoints(ipc_endpoint: IpcEndpoints) -> None:
    shared = ipc_endpoint()
    with pytest.raises(InvalidConfig) as info:
        HybridFlowBackend.open(cfg(shared), shared)
    assert str(info.value) == "outbound and inbound endpoints must differ"


def test_close_discards_a_held_sibling(opened: tuple[HybridFlowBackend, Publisher, str]) -> None:
    backend, peer, _ = opened
    publish_until(
        backend, lambda: peer.send(sample_gradients()), HybridFlowBackend.try_receive_gradients
    )
    quiet_gradients(backend)
    peer.send(sample_traces())  # exactly one trace, so exactly one is held
    deadline = time.monotonic() + 5
    while backend.held_trace is None and time.monotonic() < deadline:
        _wait_inbound(backend)
        assert backend.try_receive_gradients() is None
    assert backend.held_trace == sample_traces()
    backend.close()
    with pytest.raises(FlowClosed) as info:
        backend.try_receive_traces()
    assert isinstance(info.value, CommunicationError)
    assert backend.held_trace is None
    assert repr(backend) == "<HybridFlowBackend closed>"


def test_a_trace_ahead_of_a_gradient_stays_available(
    opened: tuple[HybridFlowBackend, Publisher, str],
) -> None:
    backend, peer, _ = opened
    gradient, trace = sample_gradients(), sample_traces()
    publish_until(backend, lambda: peer.send(gradient), HybridFlowBackend.try_receive_gradients)
    quiet_gradients(backend)
    peer.send(trace)
    got = publish_until(
        backend, lambda: peer.send(gradient), HybridFlowBackend.try_receive_gradients
    )
    assert got == gradient
    held = backend.try_receive_traces()
    if held is None:  # the trace may still have been on its way
        held = publish_until(
            backend, lambda: peer.send(trace), HybridFlowBackend.try_receive_traces
        )
    assert held == trace


def test_spikes_and_embeddings_reach_a_subscribed_peer(
    opened: tuple[HybridFlowBackend, Publisher, str],
) -> None:
    backend, _, outbound = opened
    with Subscriber.connect(cfg(outbound)) as peer:
        deadline = time.monotonic() + 5
        first = None
        while first is None and time.monotonic() < deadline:
            backend.send_spikes(SPIKES)
            first = peer.recv(timeout=0.01)
        assert first == SPIKES
        while peer.recv(timeout=0.05) is not None:
            pass
        backend.send_embeddings(EMBEDDINGS)
        assert peer.recv(timeout=5) == EMBEDDINGS


def test_inbound_validation_failures_are_invalid_input(
    opened: tuple[HybridFlowBackend, Publisher, str],
) -> None:
    backend, peer, _ = opened
    duplicate = (
        b'{"GradientUpdate":{"session_id":"s","batch_id":1,"gradients":['
        b'{"layer_id":"x","gradients":[]},{"layer_id":"x","gradients":[]}]}}'
    )
    with pytest.raises(ValidationError) as info:
        publish_until(
            backend, lambda: peer.send_frame(duplicate), HybridFlowBackend.try_receive_gradients
        )
    assert isinstance(info.value, InvalidInput)
    assert str(info.value) == "duplicate_identifier at `gradients[1]:x`"


def test_structurally_broken_payloads_are_communication_errors(
    opened: tuple[HybridFlowBackend, Publisher, str],
) -> None:
    backend, peer, _ = opened
    missing = b'{"GradientUpdate":{"session_id":"s","batch_id":1}}'
    with pytest.raises(MalformedMessage) as info:
        publish_until(
            backend, lambda: peer.send_frame(missing), HybridFlowBackend.try_receive_gradients
        )
    assert isinstance(info.value, CommunicationError)


def test_sends_are_validated_and_typed(opened: tuple[HybridFlowBackend, Publisher, str]) -> None:
    backend, _, _ = opened
    bad = SpikeBatch(session_id="s" * 1025, batch_id=1, timestamp=1, spikes=[])
    with pytest.raises(ValidationError):
        backend.send_spikes(bad)
    with pytest.raises(FieldTypeError):
        backend.send_spikes(EMBEDDINGS)  # type: ignore[arg-type]
    with pytest.raises(FieldTypeError):
        backend.send_embeddings(SPIKES)  # type: ignore[arg-type]


def test_every_call_after_close_is_a_communication_error(
    opened: tuple[HybridFlowBackend, Publisher, str],
) -> None:
    backend, _, _ = opened
    backend.close()
    backend.close()
    invalid = SpikeBatch(session_id="s" * 1025, batch_id=1, timestamp=1, spikes=[])
    for call in (
        lambda: backend.send_spikes(invalid),  # closed wins over an invalid payload
        lambda: backend.send_embeddings(EMBEDDINGS),
        backend.try_receive_gradients,
        backend.try_receive_traces,
    ):
        with pytest.raises(FlowClosed):
            call()


# ── exact frame orders, through test doubles ────────────────────────────────────────────────────
class FakeInbound:
    """Hands out queued messages (or raises queued errors); counts reads."""

    def __init__(self, *items: IpcMessage | Exception) -> None:
        self.queue: deque[IpcMessage | Exception] = deque(items)
        self.reads = 0
        self.closed = False

    def try_recv(self) -> IpcMessage | None:
        self.reads += 1
        if not self.queue:
            return None
        item = self.queue.popleft()
        if isinstance(item, Exception):
            raise item
        return item

    def close(self) -> None:
        self.closed = True


class FakeOutbound:
    def __init__(self) -> None:
        self.sent: list[IpcMessage] = []
        self.closed = False

    def send(self, message: IpcMessage) -> None:
        self.sent.append(message)

    def close(self) -> None:
        self.closed = True


def backend_with(*items: IpcMessage | Exception) -> tuple[HybridFlowBackend, FakeInbound]:
    inbound = FakeInbound(*items)
    return HybridFlowBackend(FakeOutbound(), inbound), inbound


def test_a_sibling_is_held_and_one_more_frame_is_read() -> None:
    backend, inbound = backend_with(sample_traces(), sample_gradients(), sample_gradients(2))
    assert backend.try_receive_gradients() == sample_gradients()
    assert backend.held_trace == sample_traces()
    assert inbound.reads == 2
    assert backend.try_receive_traces() == sample_traces()  # from the slot, no read
    assert inbound.reads == 2
    assert backend.held_trace is None
    assert backend.try_receive_gradients() == sample_gradients(2)


def test_at_most_two_frames_are_read_per_call() -> None:
    backend, inbound = backend_with(sample_gradients(1), sample_traces(1), sample_traces(2))
    assert backend.try_receive_traces() == sample_traces(1)
    assert backend.held_gradient == sample_gradients(1)
    assert list(inbound.queue) == [sample_traces(2)]
    lone, lone_inbound = backend_with(sample_gradients(1))
    assert lone.try_receive_traces() is None  # held the gradient, the extra read found nothing
    assert lone_inbound.reads == 2
    assert lone.try_receive_gradients() == sample_gradients(1)
    assert lone_inbound.reads == 2  # served from the slot


def test_a_second_sibling_while_the_slot_is_full_keeps_the_held_batch() -> None:
    backend, inbound = backend_with(sample_traces(1), sample_traces(2), sample_gradients())
    with pytest.raises(SlotOccupied) as info:
        backend.try_receive_gradients()
    assert str(info.value) == "inbound eligibility trace slot already holds a message"
    assert isinstance(info.value, CommunicationError)
    assert backend.held_trace == sample_traces(1)
    assert list(inbound.queue) == [sample_gradients()]  # trace 2 was consumed
    assert backend.try_receive_gradients() == sample_gradients()


def test_the_gradient_slot_has_its_own_label() -> None:
    backend, _ = backend_with(sample_gradients(1), sample_gradients(2))
    with pytest.raises(SlotOccupied, match="inbound gradient slot already holds a message"):
        backend.try_receive_traces()


@pytest.mark.parametrize("other", [Ping(), Loss(0.5), SPIKES])
def test_any_other_variant_is_consumed_and_reported(other: IpcMessage) -> None:
    backend, inbound = backend_with(other, sample_gradients())
    with pytest.raises(UnexpectedVariant):
        backend.try_receive_gradients()
    assert list(inbound.queue) == [sample_gradients()]
    assert backend.try_receive_gradients() == sample_gradients()


def test_an_unexpected_variant_in_the_extra_read_keeps_the_held_sibling() -> None:
    backend, _ = backend_with(sample_traces(), Ping())
    with pytest.raises(UnexpectedVariant) as info:
        backend.try_receive_gradients()
    assert info.value.found == "Ping"
    assert backend.held_trace == sample_traces()


def test_inbound_errors_pass_through_unchanged() -> None:
    failure = MalformedMessage("broken")
    backend, _ = backend_with(failure, sample_gradients())
    with pytest.raises(MalformedMessage):
        backend.try_receive_gradients()
    assert backend.try_receive_gradients() == sample_gradients()


def test_nothing_waiting_is_none() -> None:
    backend, inbound = backend_with()
    assert backend.try_receive_gradients() is None
    assert backend.try_receive_traces() is None
    assert inbound.reads == 2


def test_close_closes_both_transports_and_empties_the_slots() -> None:
    outbound, inbound = FakeOutbound(), FakeInbound(sample_traces(), sample_gradients())
    backend = HybridFlowBackend(outbound, inbound)
    backend.try_receive_gradients()
    with backend:
        pass
    assert outbound.closed and inbound.closed
    assert backend.held_trace is None and backend.held_gradient is None


def test_open_owns_and_ends_its_context(ipc_endpoint: IpcEndpoints) -> None:
    backend = HybridFlowBackend.open(ipc_endpoint(), ipc_endpoint())
    context: Any = backend.context
    assert isinstance(context, zmq.Context) and not context.closed
    backend.close()
    assert context.closed and backend.context is None
