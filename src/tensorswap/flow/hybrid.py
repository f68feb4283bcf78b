"""The hybrid flow backend: spikes and embeddings out, gradients and traces in (corpus-ipc's
``ZmqHybridFlowBackend``).

Outbound batches go through a bound :class:`Publisher`; inbound ones come from a connected
:class:`Subscriber` whose peer binds the inbound endpoint. Receiving never blocks. A gradient
that arrives while traces are wanted (or the reverse) is held in a one-message slot and returned
by its own method; each receive reads at most two frames. A second sibling while the slot is
full raises SlotOccupied: the new frame is consumed and the held one stays. Any other variant
raises UnexpectedVariant and its frame is consumed, neither dropped quietly nor pushed back.
After :meth:`close` every call raises FlowClosed and held messages are gone.
"""

from __future__ import annotations

from typing import Any, Protocol, cast

import zmq

from tensorswap.flow.errors import (
    FieldTypeError,
    FlowClosed,
    InvalidConfig,
    SlotOccupied,
    UnexpectedVariant,
)
from tensorswap.flow.messages import (
    EmbeddingBatch,
    GradientBatch,
    IpcMessage,
    SpikeBatch,
    TraceBatch,
    variant_name,
)
from tensorswap.flow.transport import Publisher, Subscriber, TransportConfig, as_config

_Wanted = type[GradientBatch] | type[TraceBatch]


class Outbound(Protocol):
    """What the backend sends through (a :class:`Publisher` or a test double)."""

    @property
    def closed(self) -> bool: ...

    def send(self, message: IpcMessage) -> None: ...

    def close(self) -> None: ...


class Inbound(Protocol):
    """What the backend receives from (a :class:`Subscriber` or a test double)."""

    @property
    def closed(self) -> bool: ...

    def try_recv(self) -> IpcMessage | None: ...

    def close(self) -> None: ...


class HybridFlowBackend:
    """Spikes and embeddings out, gradients and eligibility traces in, over ZeroMQ."""

    def __init__(
        self, outbound: Outbound, inbound: Inbound, context: zmq.Context[Any] | None = None
    ) -> None:
        """Wrap an open outbound and inbound; :meth:`open` is the usual way in.

        ``context``, when given, is terminated by :meth:`close` after both transports.
        """
        self._outbound = outbound
        self._inbound = inbound
        self._context = context
        self._held_gradient: GradientBatch | None = None
        self._held_trace: TraceBatch | None = None

    @classmethod
    def open(
        cls, outbound: TransportConfig | str, inbound: TransportConfig | str
    ) -> HybridFlowBackend:
        """Bind ``outbound`` (PUB) and connect ``inbound`` (SUB); the endpoints must differ.

        Peers subscribe to ``outbound`` for spikes and embeddings; the peer publishing
        gradients and traces binds ``inbound``. Raises InvalidConfig or SetupError (both
        InitializationError); nothing stays open after a failure.
        """
        out_config, in_config = as_config(outbound), as_config(inbound)
        if out_config.endpoint == in_config.endpoint:
            raise InvalidConfig("outbound and inbound endpoints must differ")
        context: zmq.Context[Any] = zmq.Context()
        try:
            publisher = Publisher.bind(out_config, context=context)
            try:
                subscriber = Subscriber.connect(in_config, context=context)
            except BaseException:
                publisher.close()
                raise
        except BaseException:
            context.term()
            raise
        return cls(publisher, subscriber, context)

    def __repr__(self) -> str:
        return f"<HybridFlowBackend {'closed' if self.closed else 'open'}>"

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._inbound.closed

    @property
    def inbound(self) -> Inbound:
        """The transport gradients and traces come in on (a Subscriber after :meth:`open`)."""
        return self._inbound

    @property
    def outbound(self) -> Outbound:
        """The transport spikes and embeddings go out on (a Publisher after :meth:`open`)."""
        return self._outbound

    @property
    def context(self) -> zmq.Context[Any] | None:
        """The ZeroMQ context :meth:`close` terminates (the one :meth:`open` made), or None;
        None again once closed."""
        return self._context

    @property
    def held_gradient(self) -> GradientBatch | None:
        """The gradient batch waiting for :meth:`try_receive_gradients`, if any."""
        return self._held_gradient

    @property
    def held_trace(self) -> TraceBatch | None:
        """The trace batch waiting for :meth:`try_receive_traces`, if any."""
        return self._held_trace

    def close(self) -> None:
        """Close both transports and discard held messages; idempotent."""
        self._held_gradient = None
        self._held_trace = None
        self._outbound.close()
        self._inbound.close()
        if self._context is not None:
            self._context.term()
            self._context = None

    def __enter__(self) -> HybridFlowBackend:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ── outbound ──────────────────────────────────────────────────────────────────────────────
    def send_spikes(self, spikes: SpikeBatch) -> None:
        """Publish a spike batch (validated first; a closed backend raises FlowClosed)."""
        self._send(spikes, SpikeBatch)

    def send_embeddings(self, embeddings: EmbeddingBatch) -> None:
        """Publish an embedding batch (validated first)."""
        self._send(embeddings, EmbeddingBatch)

    def _send(self, message: IpcMessage, kind: type) -> None:
        if self._outbound.closed:
            raise FlowClosed("hybrid backend")
        if not isinstance(message, kind):
            raise FieldTypeError("message", f"a {kind.__name__}", message)
        self._outbound.send(message)

    # ── inbound ───────────────────────────────────────────────────────────────────────────────
    def try_receive_gradients(self) -> GradientBatch | None:
        """A gradient batch if one is held or waiting, else ``None``; never blocks."""
        return cast(GradientBatch | None, self._pull(GradientBatch))

    def try_receive_traces(self) -> TraceBatch | None:
        """An eligibility trace batch if one is held or waiting, else ``None``; never blocks."""
        return cast(TraceBatch | None, self._pull(TraceBatch))

    def _pull(self, want: _Wanted) -> IpcMessage | None:
        if self._inbound.closed:
            self._held_gradient = None
            self._held_trace = None
            raise FlowClosed("hybrid backend")
        held = self._take_held(want)
        if held is not None:
            return held
        return self._read_or_defer(want, extra=False)

    def _take_held(self, want: _Wanted) -> IpcMessage | None:
        held: IpcMessage | None
        if want is GradientBatch:
            held, self._held_gradient = self._held_gradient, None
        else:
            held, self._held_trace = self._held_trace, None
        return held

    def _read_or_defer(self, want: _Wanted, extra: bool) -> IpcMessage | None:
        message = self._inbound.try_recv()
        if message is None:
            return None
        if type(message) is want:
            return message
        self._defer_sibling(message, want)
        # A sibling was set aside: look at one more frame, no further.
        return None if extra else self._read_or_defer(want, extra=True)

    def _defer_sibling(self, message: IpcMessage, want: _Wanted) -> None:
        if want is GradientBatch and type(message) is TraceBatch:
            if self._held_trace is not None:
                raise SlotOccupied("eligibility trace")
            self._held_trace = message
        elif want is TraceBatch and type(message) is GradientBatch:
            if self._held_gradient is not None:
                raise SlotOccupied("gradient")
            self._held_gradient = message
        else:
            raise UnexpectedVariant(variant_name(message), want.variant)


__all__ = ["HybridFlowBackend", "Inbound", "Outbound"]
