"""The wire envelope: canonical encode, serde's bare message form, and versioned decode.

``encode`` writes ``{"payload":<message>,"wire_version":1}`` byte for byte as corpus-ipc's
``encode_canonical_ipc_message`` does: compact, keys sorted at every level, UTF-8, each f32
widened to f64 and printed with serde_json's shortest f64 digits (``0.1f32`` is
``0.10000000149011612``), ``-0.0`` kept. ``encode_message`` writes the bare externally tagged
message as ``serde_json::to_vec`` does: fields in declaration order, f32 digits (``0.1``).
``decode`` reads both, checks ``wire_version`` before the payload is interpreted, and validates.
"""

from __future__ import annotations

import operator
import re
from itertools import islice
from typing import Any

import msgspec
import numpy as np
from msgspec import UNSET, UnsetType
from msgspec.structs import astuple

from tensorswap.flow.errors import FieldTypeError, MalformedMessage, WireVersionError
from tensorswap.flow.floats import plus_exponents, serde_f32
from tensorswap.flow.messages import (
    U16,
    U32,
    U32_MAX,
    U64,
    UNIT_MESSAGES,
    UNIT_VARIANTS,
    VARIANTS,
    BatchMetadata,
    ConfigPayload,
    EmbeddingBatch,
    GradientBatch,
    GradientUpdate,
    IpcMessage,
    Loss,
    NeuromodulatorSnapshot,
    SpikeBatch,
    SpikeEvent,
    StimulusBatch,
    TraceBatch,
    TraceData,
)
from tensorswap.flow.validate import checked, validate

WIRE_VERSION = 1
"""The envelope version this module writes."""
MIN_WIRE_VERSION = 1
"""The oldest envelope version it reads; an unversioned (bare) message counts as version 1."""


def _plain(value: Any) -> Any:
    """msgspec's hook for values validation accepts but msgspec cannot write itself: int, float
    and str subclasses (an ``IntEnum`` member, a ``str`` subclass) and numpy scalars."""
    if isinstance(value, str):
        return str(value)
    if isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_):
        return int(value)
    if isinstance(value, float | np.floating):
        return float(value)
    # unreachable for a validated message; msgspec passes this error to the caller
    raise TypeError(f"a flow message cannot carry a {type(value).__name__}")


_ENCODER = msgspec.json.Encoder(enc_hook=_plain)
_SORTED = msgspec.json.Encoder(order="sorted", enc_hook=_plain)


def _payload(message: IpcMessage) -> Any:
    name = message.variant
    if name in UNIT_VARIANTS:
        return name
    if type(message) is Loss:
        return {name: message.value}
    return {name: message}


def _has_unsorted_map(message: IpcMessage) -> bool:
    # Struct fields are declared in sorted order; only dicts with 2+ keys need sorting.
    if type(message) is ConfigPayload:
        return len(message.config) > 1
    metadata = getattr(message, "metadata", None)
    return metadata is not None and len(metadata.custom) > 1


def _canonical(message: IpcMessage, peak: float) -> bytes:
    """Envelope bytes of an already validated message whose floats are at most ``peak``."""
    encoder = _SORTED if _has_unsorted_map(message) else _ENCODER
    data = encoder.encode({"payload": _payload(message), "wire_version": WIRE_VERSION})
    # Only a float of magnitude >= 1e16 is printed with a positive exponent.
    return plus_exponents(data) if peak >= 1e16 else data


def encode(message: IpcMessage) -> bytes:
    """Validate ``message`` and return its canonical wire-version-1 envelope bytes.

    Raises ValidationError or FieldTypeError (both InvalidInput) before any bytes exist.
    """
    return _canonical(*checked(message))


# serde's field order (the order of declaration in corpus-ipc) for the bare form.
_SERDE_FIELDS: dict[type, tuple[str, ...]] = {
    SpikeBatch: ("session_id", "batch_id", "timestamp", "spikes", "metadata"),
    SpikeEvent: ("channel", "time", "strength"),
    BatchMetadata: ("processing_latency_ns", "source", "custom"),
    EmbeddingBatch: ("session_id", "batch_id", "embedding", "sequence_length"),
    StimulusBatch: ("session_id", "batch_id", "timestamp", "values", "valid_mask", "metadata"),
    NeuromodulatorSnapshot: ("tick", "dopamine", "cortisol", "acetylcholine", "tempo"),
    ConfigPayload: ("session_id", "config"),
    GradientBatch: ("session_id", "batch_id", "gradients"),
    GradientUpdate: ("layer_id", "gradients", "eligibility_trace"),
    TraceBatch: ("session_id", "batch_id", "traces"),
    TraceData: ("channel_id", "trace_value", "last_spike_time"),
}


def _serde(value: Any) -> Any:
    cls = type(value)
    if cls is float or isinstance(value, float | np.floating):
        return msgspec.Raw(serde_f32(float(value)).encode())
    if cls is list:
        return [_serde(item) for item in value]
    if cls is dict:
        return {key: _serde(item) for key, item in value.items()}
    fields = _SERDE_FIELDS.get(cls)
    if fields is not None:
        return {name: _serde(getattr(value, name)) for name in fields}
    return value


def encode_message(message: IpcMessage) -> bytes:
    """Validate ``message`` and return the bare message as ``serde_json::to_vec`` writes it.

    This is the unversioned form (``{"Loss":0.25}``, ``"Ping"``), read as wire version 1.
    """
    return _ENCODER.encode(_serde(_payload(validate(message))))


# ── decode ─────────────────────────────────────────────────────────────────────────────────────
class _Payload(msgspec.Struct, forbid_unknown_fields=True):
    """An externally tagged message: exactly one of these keys is set."""

    ConfigUpdate: ConfigPayload | UnsetType = UNSET
    EligibilityTraces: TraceBatch | UnsetType = UNSET
    Embeddings: EmbeddingBatch | UnsetType = UNSET
    GradientUpdate: GradientBatch | UnsetType = UNSET
    Loss: float | UnsetType = UNSET
    Neuromodulators: NeuromodulatorSnapshot | UnsetType = UNSET
    Ping: UnsetType | None = UNSET
    Shutdown: UnsetType | None = UNSET
    Spikes: SpikeBatch | UnsetType = UNSET
    Stimuli: StimulusBatch | UnsetType = UNSET
    TrainingComplete: UnsetType | None = UNSET


class _Envelope(msgspec.Struct):
    payload: _Payload | str
    wire_version: int


_FAST = msgspec.json.Decoder(_Envelope)
_PAYLOAD_FIELDS = _Payload.__struct_fields__
_EXPECTED = ", ".join(f"`{name}`" for name in VARIANTS)


def _bad_payload(reason: object) -> MalformedMessage:
    return MalformedMessage(f"failed to decode envelope payload: {reason}")


_ECHO_LIMIT = 200
"""At most this many characters of a peer's value are echoed into an error message."""


def _clip(text: str) -> str:
    return text if len(text) <= _ECHO_LIMIT else text[: _ECHO_LIMIT - 3] + "..."


def _unknown(name: str) -> MalformedMessage:
    return _bad_payload(f"unknown variant `{_clip(name)}`, expected one of {_EXPECTED}")


_PEEK_LIMIT = 4096
"""A JSON value of at most this many bytes may be decoded whole (for an error message, or to
check a unit variant's ``null``); a bigger one is never turned into Python objects."""


class _Unparsed:
    """A JSON value too big to decode whole, standing in for it in an error message."""

    __slots__ = ("text",)

    def __init__(self, raw: msgspec.Raw) -> None:
        self.text = memoryview(raw)[: _ECHO_LIMIT + 1].tobytes().decode("utf-8", "replace")


def _peek(raw: msgspec.Raw) -> Any:
    """The value of a small, already well-formed JSON text; an ``_Unparsed`` for a big one."""
    if len(raw) > _PEEK_LIMIT:
        return _Unparsed(raw)
    try:
        return msgspec.json.decode(raw)
    except RecursionError:  # 4 KiB of brackets nest deeper than the interpreter allows
        return _Unparsed(raw)


def _json_text(value: object) -> str:
    """``value`` as JSON for an error message, cut to ``_ECHO_LIMIT`` characters."""
    if isinstance(value, _Unparsed):
        return _clip(value.text)
    return _clip(msgspec.json.encode(value).decode())


def _build(name: str, body: Any) -> IpcMessage:
    """The message for variant ``name`` from its already typed ``body``."""
    cls = VARIANTS[name]
    if name in UNIT_VARIANTS:
        if body is not None:
            raise _bad_payload(f"invalid type: {_json_text(body)}, expected unit variant {name}")
        return UNIT_MESSAGES[name]
    if cls is Loss:
        return Loss(body)
    message: IpcMessage = body
    return message


class _AliasedTrace(msgspec.Struct, kw_only=True, gc=False):
    """A ``TraceData`` row that may name its channel ``neuron_id`` (corpus-ipc's alias)."""

    channel_id: U16 | UnsetType = UNSET
    last_spike_time: U32
    neuron_id: U16 | UnsetType = UNSET
    trace_value: float


class _AliasedTraces(msgspec.Struct, kw_only=True):
    batch_id: U64
    session_id: str
    traces: list[_AliasedTrace]


_ALIASED = msgspec.json.Decoder(_AliasedTraces)


def _unalias(batch: _AliasedTraces) -> TraceBatch:
    """The ``TraceBatch`` of rows that name their channel either way, but not both."""
    rows = []
    for i, row in enumerate(batch.traces):
        channel = row.channel_id
        if row.neuron_id is not UNSET:
            if channel is not UNSET:
                raise _bad_payload("duplicate field `channel_id` (also given as `neuron_id`)")
            channel = row.neuron_id
        elif channel is UNSET:
            raise _bad_payload(
                f"EligibilityTraces: Object missing required field `channel_id` - at "
                f"`$.traces[{i}]`"
            )
        rows.append(
            TraceData(
                channel_id=channel,
                last_spike_time=row.last_spike_time,
                trace_value=row.trace_value,
            )
        )
    return TraceBatch(batch_id=batch.batch_id, session_id=batch.session_id, traces=rows)


# The careful path never builds a generic tree of a peer's JSON: ``[[],[],...]`` in a 64 MiB
# frame took 1.5 GB and 10 s that way. It checks the syntax of the whole text (into a Raw, a
# view of the input), splits objects into Raw members, and decodes each message body straight
# into its typed classes.
_WHOLE = msgspec.json.Decoder(msgspec.Raw)
_SHELL = msgspec.json.Decoder(dict[str, msgspec.Raw] | str)
_BODY = {
    name: msgspec.json.Decoder(float if cls is Loss else cls)
    for name, cls in VARIANTS.items()
    if name not in UNIT_VARIANTS and cls is not TraceBatch
}


def _message(raw: msgspec.Raw) -> IpcMessage:
    """An ``IpcMessage`` from well-formed JSON text, reporting structural faults as serde would."""
    try:
        value = _SHELL.decode(raw)
    except msgspec.ValidationError:  # an array, a number, a bool or null
        raise _bad_payload(
            f"invalid type: {_json_text(_peek(raw))}, expected an IpcMessage"
        ) from None
    if isinstance(value, str):
        if value in UNIT_MESSAGES:
            return UNIT_MESSAGES[value]
        if value in VARIANTS:
            raise _bad_payload(f"invalid type: unit variant, expected variant {value} with data")
        raise _unknown(value)
    if len(value) != 1:
        raise _bad_payload(f"a message object has exactly one variant key, found {len(value)}")
    ((name, body),) = value.items()
    if name not in VARIANTS:
        raise _unknown(name)
    if name in UNIT_VARIANTS:
        return _build(name, _peek(body))
    try:
        if name == TraceBatch.variant:  # rows may name their channel ``neuron_id``
            typed: Any = _unalias(_ALIASED.decode(body))
        else:
            typed = _BODY[name].decode(body)
    except msgspec.ValidationError as exc:
        raise _bad_payload(f"{name}: {exc}") from exc
    except RecursionError as exc:
        raise _bad_payload(f"{name}: nesting too deep") from exc
    return _build(name, typed)


def _check_version(value: object) -> None:
    if type(value) is not int or not 0 <= value <= U32_MAX:
        raise MalformedMessage(
            f"wire_version must be a non-negative integer fitting u32, got {_json_text(value)}"
        )
    if not MIN_WIRE_VERSION <= value <= WIRE_VERSION:
        raise WireVersionError(value, MIN_WIRE_VERSION, WIRE_VERSION)


# A valid message holds at most about 400,000 JSON values (65,536 rows or events of a few
# fields each, 131,072 records in all), while a typed decode turns each value into a Python
# object: ``0,`` into a 32-byte float, ``"k":0,`` into a key and a Raw (16x and more of the
# frame). A text with more JSON values than this is refused before any of them is built.
_VALUE_BUDGET = 1 << 19
# A string, or a comma or opening bracket outside strings (group 1).
_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|([,\[{])')
_TOKEN_TEXT = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|([,\[{])')
_GROUP = operator.itemgetter(1)


def _value_bound(text: bytes | str | memoryview) -> int:
    """An upper bound on the JSON values in ``text``: its commas and opening brackets, plus 1.

    Every value but the outermost is an array element or a member value, and a container of
    ``k`` of them holds ``k - 1`` commas; counting bytes inside strings too only adds to it.
    """
    if isinstance(text, memoryview):
        return len(text) + 1
    if isinstance(text, bytes):
        return text.count(b",") + text.count(b"[") + text.count(b"{") + 1
    return text.count(",") + text.count("[") + text.count("{") + 1


def _over_budget(text: bytes | str | memoryview) -> bool:
    """Whether well-formed JSON ``text`` holds more than ``_VALUE_BUDGET`` values, not counting
    commas and brackets inside strings; linear, and nothing is kept while counting."""
    if len(text) <= _VALUE_BUDGET or _value_bound(text) <= _VALUE_BUDGET:
        return False
    pattern = _TOKEN_TEXT if isinstance(text, str) else _TOKEN
    outside = filter(None, map(_GROUP, pattern.finditer(text)))  # type: ignore[arg-type]
    return next(islice(outside, _VALUE_BUDGET - 1, None), None) is not None


def _refuse_over_budget(text: bytes | str | memoryview) -> None:
    if _over_budget(text):
        raise _bad_payload(
            f"more than {_VALUE_BUDGET} JSON values, far beyond the protocol limits; "
            "refused before decoding"
        )


class _Top(msgspec.Struct):
    """The envelope's two members as raw text; other members are skipped, never built."""

    payload: msgspec.Raw | UnsetType = UNSET
    wire_version: msgspec.Raw | UnsetType = UNSET


_TOP = msgspec.json.Decoder(_Top | str)


def _decode_big(whole: msgspec.Raw) -> IpcMessage:
    """The careful path for well-formed text with more JSON values than the budget: the
    version is still checked before the payload, and no member or element is built."""
    try:
        top = _TOP.decode(whole)
    except msgspec.ValidationError:  # an array, a number, a bool or null
        raise MalformedMessage("compatibility envelope must be a JSON object") from None
    if isinstance(top, _Top) and top.wire_version is not UNSET:
        _check_version(_peek(top.wire_version))
        if top.payload is UNSET:
            raise MalformedMessage("missing payload on compatibility envelope")
        body = top.payload
    else:
        body = whole
    _refuse_over_budget(memoryview(body))  # a view: no copy of the text
    return _message(body)


def _decode_careful(data: bytes | str) -> IpcMessage:
    """corpus-ipc's decode order: JSON, version (before the payload), then the payload."""
    try:
        whole = _WHOLE.decode(data)
    except msgspec.DecodeError as exc:
        raise MalformedMessage(f"failed to decode envelope JSON: {exc}") from exc
    except RecursionError as exc:  # msgspec recurses once per array/object level
        raise MalformedMessage("failed to decode envelope JSON: nesting too deep") from exc
    except UnicodeEncodeError as exc:  # a str holding a lone surrogate is not UTF-8
        raise MalformedMessage(
            f"failed to decode envelope JSON: not valid UTF-8 ({exc.reason} "
            f"at position {exc.start})"
        ) from exc
    if _over_budget(data):
        return _decode_big(whole)
    try:
        value = _SHELL.decode(whole)
    except msgspec.ValidationError:  # an array, a number, a bool or null
        raise MalformedMessage("compatibility envelope must be a JSON object") from None
    if isinstance(value, dict) and "wire_version" in value:
        _check_version(_peek(value["wire_version"]))
        if "payload" not in value:
            raise MalformedMessage("missing payload on compatibility envelope")
        return _message(value["payload"])
    return _message(whole)  # a bare message: legacy, unversioned, version 1


def _may_alias(data: bytes | str) -> bool:
    """Whether ``data`` may hold a ``neuron_id`` key, spelled out or with ``\\u`` escapes."""
    if isinstance(data, bytes):
        return b"neuron_id" in data or b"\\u" in data
    return "neuron_id" in data or "\\u" in data


def _decode_fast(data: bytes | str) -> IpcMessage | None:
    """One typed pass for a well-formed current envelope; ``None`` sends it the careful way."""
    try:
        envelope = _FAST.decode(data)
    except (msgspec.MsgspecError, RecursionError, UnicodeEncodeError):
        return None
    if envelope.wire_version != WIRE_VERSION:
        return None
    payload = envelope.payload
    if isinstance(payload, str):
        return UNIT_MESSAGES.get(payload)
    values = astuple(payload)
    if values.count(UNSET) != len(values) - 1:
        return None
    spikes = payload.Spikes
    if spikes is not UNSET:  # the common case, as ``_build`` would return it
        return spikes
    if payload.EligibilityTraces is not UNSET and _may_alias(data):
        # The typed pass ignored ``neuron_id`` as an unknown field; the careful path refuses it
        # beside ``channel_id`` (serde's duplicate field), so let that path decide.
        return None
    for name, value in zip(_PAYLOAD_FIELDS, values, strict=True):
        if value is not UNSET:
            return _build(name, value)
    return None  # pragma: no cover - exactly one value is set


def decode(data: bytes | bytearray | memoryview | str) -> IpcMessage:
    """Decode a canonical envelope or a bare (unversioned) message, then validate it.

    Raises MalformedMessage (JSON, shape, types, integer widths) or WireVersionError, both
    CommunicationError; ValidationError (InvalidInput) when a well-formed message breaks a rule.
    """
    if type(data) is not bytes and isinstance(data, bytearray | memoryview):
        data = bytes(data)
    if len(data) > _VALUE_BUDGET and _value_bound(data) > _VALUE_BUDGET:
        message = None  # maybe more JSON values than any valid message: never typed whole
    else:
        message = _decode_fast(data)
    if message is None:
        message = _decode_careful(data)
    try:
        return checked(message, trusted=True, track_peak=False)[0]
    except FieldTypeError as exc:  # a u64 above 2**64 - 1: the wire type cannot hold it
        raise _bad_payload(exc) from exc


__all__ = ["MIN_WIRE_VERSION", "WIRE_VERSION", "decode", "encode", "encode_message"]
