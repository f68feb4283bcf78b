"""The eleven corpus-ipc training messages as frozen msgspec Structs, one class per variant.

Field names, requiredness and integer widths follow corpus-ipc's ``IpcMessage`` exactly; the
constructors are keyword-only. Fields are declared in sorted order, which is also the canonical
wire order, so encoding needs no sorting. Every float is an f32 on the wire: pass f32 values
(``f32(x)``) when you want ``decode(encode(m)) == m``; other floats are rounded when encoded.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, TypeAlias

import msgspec

U16_MAX = 0xFFFF
U32_MAX = 0xFFFF_FFFF
U64_MAX = 0xFFFF_FFFF_FFFF_FFFF
I64_MIN = -(1 << 63)
I64_MAX = (1 << 63) - 1

U16 = Annotated[int, msgspec.Meta(ge=0, le=U16_MAX)]
U32 = Annotated[int, msgspec.Meta(ge=0, le=U32_MAX)]
# msgspec bounds stop at int64; the u64 ceiling is checked by validation.
U64 = Annotated[int, msgspec.Meta(ge=0)]
I64 = Annotated[int, msgspec.Meta(ge=I64_MIN, le=I64_MAX)]

ConfigValue: TypeAlias = float | str | bool | list[float]
"""A config entry: Float (f32), String, Boolean or FloatArray. A Python ``int`` is sent as
corpus-ipc's ``Integer`` (u64); JSON numbers always decode as Float."""


class SpikeEvent(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """One spike: ``channel`` (u16), ``time`` (u32), ``strength`` (f32, finite)."""

    channel: U16
    strength: float
    time: U32


class BatchMetadata(msgspec.Struct, kw_only=True, frozen=True):
    """Optional batch metadata: latency (u64 ns), a source label, string key/value pairs."""

    custom: dict[str, str] = {}
    processing_latency_ns: U64 | None = None
    source: str | None = None


class SpikeBatch(msgspec.Struct, kw_only=True, frozen=True):
    """``Spikes``: a session-correlated batch of spike events."""

    variant: ClassVar[str] = "Spikes"
    batch_id: U64
    metadata: BatchMetadata | None = None
    session_id: str | None
    spikes: list[SpikeEvent]
    timestamp: U64


class EmbeddingBatch(msgspec.Struct, kw_only=True, frozen=True):
    """``Embeddings``: an embedding vector and its sequence length."""

    variant: ClassVar[str] = "Embeddings"
    batch_id: U64
    embedding: list[float]
    sequence_length: U64
    session_id: str | None


class StimulusBatch(msgspec.Struct, kw_only=True, frozen=True):
    """``Stimuli``: continuous values; ``valid_mask[i] is False`` marks channel ``i`` missing."""

    variant: ClassVar[str] = "Stimuli"
    batch_id: U64
    metadata: BatchMetadata | None = None
    session_id: str | None
    timestamp: U64
    valid_mask: list[bool] | None
    values: list[float]


class NeuromodulatorSnapshot(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """``Neuromodulators``: dopamine, cortisol, acetylcholine in [0, 1]; tempo in [0.5, 2]."""

    variant: ClassVar[str] = "Neuromodulators"
    acetylcholine: float
    cortisol: float
    dopamine: float
    tempo: float
    tick: I64


class Loss(msgspec.Struct, frozen=True, gc=False):
    """``Loss``: one f32, on the wire as ``{"Loss": 0.25}``."""

    variant: ClassVar[str] = "Loss"
    value: float


class ConfigPayload(msgspec.Struct, kw_only=True, frozen=True):
    """``ConfigUpdate``: runtime parameters for one session (``None``: every session)."""

    variant: ClassVar[str] = "ConfigUpdate"
    config: dict[str, ConfigValue]
    session_id: str | None


class GradientUpdate(msgspec.Struct, kw_only=True, frozen=True):
    """One gradient row: a layer id, its values and an optional eligibility trace."""

    eligibility_trace: list[float] | None = None
    gradients: list[float]
    layer_id: str


class GradientBatch(msgspec.Struct, kw_only=True, frozen=True):
    """``GradientUpdate``: gradient rows for one session and batch; layer ids are unique."""

    variant: ClassVar[str] = "GradientUpdate"
    batch_id: U64
    gradients: list[GradientUpdate]
    session_id: str


class TraceData(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """One eligibility trace; ``neuron_id`` is accepted for ``channel_id`` when decoding."""

    channel_id: U16
    last_spike_time: U32
    trace_value: float


class TraceBatch(msgspec.Struct, kw_only=True, frozen=True):
    """``EligibilityTraces``: traces for one session and batch; channel ids are unique."""

    variant: ClassVar[str] = "EligibilityTraces"
    batch_id: U64
    session_id: str
    traces: list[TraceData]


class TrainingComplete(msgspec.Struct, frozen=True, gc=False):
    """``TrainingComplete`` (a unit variant: the JSON string ``"TrainingComplete"``)."""

    variant: ClassVar[str] = "TrainingComplete"


class Shutdown(msgspec.Struct, frozen=True, gc=False):
    """``Shutdown`` (a unit variant)."""

    variant: ClassVar[str] = "Shutdown"


class Ping(msgspec.Struct, frozen=True, gc=False):
    """``Ping`` (a unit variant)."""

    variant: ClassVar[str] = "Ping"


IpcMessage: TypeAlias = (
    SpikeBatch
    | EmbeddingBatch
    | StimulusBatch
    | NeuromodulatorSnapshot
    | Loss
    | ConfigPayload
    | GradientBatch
    | TraceBatch
    | TrainingComplete
    | Shutdown
    | Ping
)
"""Any of the eleven messages."""

MESSAGE_TYPES: tuple[type[IpcMessage], ...] = (
    SpikeBatch,
    EmbeddingBatch,
    StimulusBatch,
    NeuromodulatorSnapshot,
    Loss,
    ConfigPayload,
    GradientBatch,
    TraceBatch,
    TrainingComplete,
    Shutdown,
    Ping,
)
"""The message classes in corpus-ipc's variant order."""

VARIANTS: dict[str, type[IpcMessage]] = {cls.variant: cls for cls in MESSAGE_TYPES}
"""Variant name -> message class."""

UNIT_MESSAGES: dict[str, IpcMessage] = {
    "TrainingComplete": TrainingComplete(),
    "Shutdown": Shutdown(),
    "Ping": Ping(),
}
"""The unit variants by name (field-less and frozen, so one instance each serves)."""
UNIT_VARIANTS: frozenset[str] = frozenset(UNIT_MESSAGES)

if len(VARIANTS) != 11:  # pragma: no cover - a registry check at import
    raise RuntimeError("every IpcMessage variant needs exactly one class")


def variant_name(message: IpcMessage) -> str:
    """The variant name of ``message`` (``"Spikes"``, ``"GradientUpdate"``, ``"Ping"``, ...)."""
    if not isinstance(message, MESSAGE_TYPES):
        raise TypeError(f"not a flow message: {type(message).__name__}")
    return message.variant


__all__ = [
    "MESSAGE_TYPES",
    "UNIT_MESSAGES",
    "UNIT_VARIANTS",
    "VARIANTS",
    "BatchMetadata",
    "ConfigPayload",
    "ConfigValue",
    "EmbeddingBatch",
    "GradientBatch",
    "GradientUpdate",
    "IpcMessage",
    "Loss",
    "NeuromodulatorSnapshot",
    "Ping",
    "Shutdown",
    "SpikeBatch",
    "SpikeEvent",
    "StimulusBatch",
    "TraceBatch",
    "TraceData",
    "TrainingComplete",
    "variant_name",
]
