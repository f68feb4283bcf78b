"""Message validation, check for check and path for path as corpus-ipc's ``Validate`` does it.

:func:`validate` runs on every encode and decode. It rounds floats to f32 first (a message is
returned as is when every float already is one), then checks the rules in corpus-ipc's order and
raises :class:`~tensorswap.flow.errors.ValidationError` at the first failure. Bounds are strict
(``>`` fails) and empty collections are allowed. Python values the wire cannot carry (a ``str``
channel, a negative id, ``True`` as a float) raise :class:`~tensorswap.flow.errors.FieldTypeError`.
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Callable
from itertools import chain
from typing import Any

import numpy as np
from msgspec.structs import replace

from tensorswap.flow.errors import FieldTypeError, ValidationError, ValidationKind
from tensorswap.flow.floats import f32
from tensorswap.flow.limits import DEFAULT_LIMITS, Bytes, Count, Float, ProtocolLimits, Range
from tensorswap.flow.messages import (
    I64_MAX,
    I64_MIN,
    U16_MAX,
    U32_MAX,
    U64_MAX,
    BatchMetadata,
    ConfigPayload,
    EmbeddingBatch,
    GradientBatch,
    GradientUpdate,
    IpcMessage,
    Loss,
    NeuromodulatorSnapshot,
    Ping,
    Shutdown,
    SpikeBatch,
    SpikeEvent,
    StimulusBatch,
    TraceBatch,
    TraceData,
    TrainingComplete,
)

_K = ValidationKind
_pack = struct.pack
_unpack = struct.unpack
_FLOATS = {float}
_INTS = {int}
_U64_LABEL = re.compile(r"\+?[0-9]+")
_LEVELS = (
    ("dopamine", 0.0, 1.0),
    ("cortisol", 0.0, 1.0),
    ("acetylcholine", 0.0, 1.0),
    ("tempo", 0.5, 2.0),
)


_SPIKE_STRUCTS: dict[int, tuple[struct.Struct, struct.Struct]] = {}


def _spike_structs(n: int) -> tuple[struct.Struct, struct.Struct]:
    """Structs for ``n`` spike events: all columns (u16, u32, f32), and the f32 column alone."""
    structs = _SPIKE_STRUCTS.get(n)
    if structs is None:
        structs = (struct.Struct(f"<{n}H{n}I{n}f"), struct.Struct(f"<{n}f"))
        if len(_SPIKE_STRUCTS) < 64:  # the batch sizes in use; others are built on demand
            _SPIKE_STRUCTS[n] = structs
    return structs


# ── failures and stateless checks ─────────────────────────────────────────────────────────────
def _limit(path: str, actual: int, limit: int) -> ValidationError:
    return ValidationError(path, _K.LIMIT_EXCEEDED, Count(actual), Count(limit))


def _duplicate(path: str, identifier: object) -> ValidationError:
    # corpus-ipc reports a numeric identifier as ``actual``, any other one in the path.
    label = str(identifier)
    if _U64_LABEL.fullmatch(label) and int(label) <= U64_MAX:
        return ValidationError(path, _K.DUPLICATE_IDENTIFIER, Count(int(label)))
    if label not in path:
        path = f"{path}:{label}"
    return ValidationError(path, _K.DUPLICATE_IDENTIFIER)


def _first_duplicate(ids: list[Any]) -> int | None:
    if len(set(ids)) == len(ids):
        return None
    seen: set[Any] = set()
    for i, identifier in enumerate(ids):
        if identifier in seen:
            return i
        seen.add(identifier)
    return None  # pragma: no cover - unequal lengths imply a repeat


def _count(path: str, actual: int, limit: int) -> None:
    if actual > limit:
        raise _limit(path, actual, limit)


def _int(path: str, value: object, low: int, high: int, name: str) -> None:
    if type(value) is int and low <= value <= high:
        return
    # int subclasses (IntEnum) and numpy integers are written as plain ints; bools are not ints
    if isinstance(value, int | np.integer) and not isinstance(value, bool) and low <= value <= high:
        return
    raise FieldTypeError(path, f"an integer in {low}..={high} ({name})", value)


def _u64(path: str, value: object) -> None:
    _int(path, value, 0, U64_MAX, "u64")


# (values, item path, maximum, Rust type name, struct code) of one integer column
_Column = tuple[list[Any], str, int, str, str]


def _ints(*columns: _Column) -> None:
    """Every item an ``int`` (not a bool) within its column's range; one struct pack checks
    all ranges at once, the precise per-item check runs only when that fails."""
    codes = "".join(f"{len(values)}{code}" for values, _, _, _, code in columns)
    flat = list(chain.from_iterable(column[0] for column in columns))
    try:
        _pack("<" + codes, *flat)
    except struct.error:
        pass
    else:
        if not flat or set(map(type, flat)) == _INTS:
            return
    for values, item, high, name, _ in columns:
        for i, value in enumerate(values):
            _int(item.format(i), value, 0, high, name)


def _list(path: str, value: object, what: str = "a list") -> list[Any]:
    if not isinstance(value, list):
        raise FieldTypeError(path, what, value)
    return value


def _items(values: list[Any], item: str, cls: type) -> None:
    if values and set(map(type, values)) != {cls}:
        for i, value in enumerate(values):
            if not isinstance(value, cls):
                raise FieldTypeError(item.format(i), f"a {cls.__name__}", value)


def _float(path: str, value: object) -> float:
    """A number (Python or numpy) as a float (not yet rounded); else a FieldTypeError."""
    if isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:  # an int beyond the f64 range (copysign would convert it too)
            return math.inf if value > 0 else -math.inf
    raise FieldTypeError(path, "a float (f32)", value)


def _finite(path: str, value: float) -> None:
    if not math.isfinite(value):
        raise ValidationError(path, _K.NON_FINITE, Float(value))


def _same(a: float, b: object) -> bool:
    return type(b) is float and (a == b or (a != a and b != b))


class _Checker:
    """One validation pass; ``peak`` bounds the magnitude of every float seen."""

    __slots__ = ("limits", "peak", "track_peak", "trusted")

    def __init__(self, limits: ProtocolLimits, trusted: bool, track_peak: bool = True) -> None:
        self.limits = limits
        self.trusted = trusted
        self.track_peak = track_peak
        self.peak = 0.0

    # ── shared pieces ──────────────────────────────────────────────────────────────────────────
    def add(self, total: int, n: int) -> int:
        total += n
        if total > self.limits.max_aggregate_records:
            raise _limit("aggregate", total, self.limits.max_aggregate_records)
        return total

    def string(self, path: str, value: object) -> None:
        if not isinstance(value, str):
            raise FieldTypeError(path, "a str", value)
        if value.isascii():
            size = len(value)
        else:
            try:
                size = len(value.encode("utf-8"))
            except UnicodeEncodeError:
                raise FieldTypeError(path, "valid Unicode (no lone surrogates)", value) from None
        limit = self.limits.max_string_bytes
        if size > limit:
            raise ValidationError(path, _K.LIMIT_EXCEEDED, Bytes(size), Bytes(limit))

    def opt_string(self, path: str, value: object) -> None:
        if value is not None:
            self.string(path, value)

    def number(self, path: str, value: object) -> float:
        """One float rounded to f32; not yet checked for finiteness."""
        if type(value) is not float:
            if self.trusted:
                raise FieldTypeError(path, "a float (f32)", value)
            value = _float(path, value)
        rounded = f32(value)
        magnitude = abs(rounded)
        if magnitude > self.peak:
            self.peak = magnitude
        return rounded

    def floats(self, values: list[Any], item: str) -> list[float]:
        """Finite f32 floats: ``values`` itself when every item already is one, else a copy."""
        if not values:
            return values
        if not self.trusted and set(map(type, values)) != _FLOATS:
            values = [_float(item.format(i), v) for i, v in enumerate(values)]
        fmt = f"<{len(values)}f"
        try:
            rounded: Any = _unpack(fmt, _pack(fmt, *values))
        except OverflowError:  # a finite float beyond the f32 range becomes inf
            rounded = [f32(v) for v in values]
        else:
            if self.trusted and rounded == tuple(values):
                # Decoded JSON holds no inf or NaN, and nothing overflowed: all finite.
                if self.track_peak:
                    self.peak = max(self.peak, max(rounded), -min(rounded))
                return values
        # A sum of f32 magnitudes cannot overflow an f64: only inf or NaN makes it non-finite.
        total = sum(map(abs, rounded))
        if not math.isfinite(total):
            for i, value in enumerate(rounded):
                _finite(item.format(i), value)
        if total > self.peak:
            self.peak = total
        return values if rounded == tuple(values) else list(rounded)

    def spike_columns(
        self, channels: list[Any], times: list[Any], strengths: list[Any]
    ) -> list[float] | None:
        """The common case of the spike columns in one struct pack: every channel an ``int``
        within u16, every time an ``int`` within u32, every strength a finite ``float`` once
        rounded to f32. Returns the rounded strengths (``strengths`` itself when unchanged), or
        ``None`` when any of this does not hold and the precise checks must find the fault."""
        n = len(strengths)
        if not n:
            return strengths
        # Exact types (no bool, no subclass); comparing with a list of types needs no hashing.
        ints = [int] * n
        if list(map(type, channels)) != ints or list(map(type, times)) != ints:
            return None
        if list(map(type, strengths)) != [float] * n:
            return None
        columns, floats = _spike_structs(n)
        try:
            packed = columns.pack(*channels, *times, *strengths)
        except (struct.error, OverflowError):  # an integer out of range, a float beyond f32
            return None
        rounded = floats.unpack_from(packed, 6 * n)
        # The norm bounds every magnitude, and it is finite exactly when every value is (the
        # norm of 65,536 finite f32 values cannot overflow an f64).
        peak = math.hypot(*rounded)
        if not math.isfinite(peak):
            return None
        if peak > self.peak:
            self.peak = peak
        return strengths if rounded == tuple(strengths) else list(rounded)

    def metadata(self, metadata: BatchMetadata | None, counted: int) -> None:
        total = self.add(0, counted)
        if metadata is None:
            return
        if not isinstance(metadata, BatchMetadata):
            raise FieldTypeError("metadata", "a BatchMetadata or None", metadata)
        if metadata.processing_latency_ns is not None:
            _u64("processing_latency_ns", metadata.processing_latency_ns)
        self.opt_string("source", metadata.source)
        custom = metadata.custom
        if not isinstance(custom, dict):
            raise FieldTypeError("custom", "a dict of str to str", custom)
        _count("custom", len(custom), self.limits.max_metadata_entries)
        for key, value in custom.items():
            if key == "":
                raise ValidationError("custom.<empty>", _K.NESTED_METADATA)
            self.string("custom.<key>", key)
            self.string("custom.<value>", value)
        self.add(total, len(custom))

    # ── one method per message ─────────────────────────────────────────────────────────────────
    def spikes(self, m: SpikeBatch) -> SpikeBatch:
        _u64("batch_id", m.batch_id)
        _u64("timestamp", m.timestamp)
        self.opt_string("session_id", m.session_id)
        spikes = _list("spikes", m.spikes)
        _count("spikes", len(spikes), self.limits.max_spike_events)
        if self.trusted:  # a typed decode has checked the types and integer widths
            strengths = [e.strength for e in spikes]
            rounded = self.floats(strengths, "spikes[{}].strength")
        else:
            if list(map(type, spikes)) != [SpikeEvent] * len(spikes):
                _items(spikes, "spikes[{}]", SpikeEvent)
            channels = [e.channel for e in spikes]
            times = [e.time for e in spikes]
            strengths = [e.strength for e in spikes]
            fast = self.spike_columns(channels, times, strengths)
            if fast is None:  # something needs a closer look: the precise checks, in order
                _ints(
                    (channels, "spikes[{}].channel", U16_MAX, "u16", "H"),
                    (times, "spikes[{}].time", U32_MAX, "u32", "I"),
                )
                fast = self.floats(strengths, "spikes[{}].strength")
            rounded = fast
        self.metadata(m.metadata, len(spikes))
        if rounded is strengths:
            return m
        events = [
            e if _same(r, e.strength) else replace(e, strength=r)
            for e, r in zip(spikes, rounded, strict=True)
        ]
        return replace(m, spikes=events)

    def embeddings(self, m: EmbeddingBatch) -> EmbeddingBatch:
        _u64("batch_id", m.batch_id)
        _u64("sequence_length", m.sequence_length)
        self.opt_string("session_id", m.session_id)
        embedding = _list("embedding", m.embedding)
        _count("embedding", len(embedding), self.limits.max_channel_values)
        _count("sequence_length", m.sequence_length, self.limits.max_aggregate_records)
        rounded = self.floats(embedding, "embedding[{}]")
        self.add(0, len(rounded))
        return m if rounded is embedding else replace(m, embedding=rounded)

    def stimuli(self, m: StimulusBatch) -> StimulusBatch:
        _u64("batch_id", m.batch_id)
        _u64("timestamp", m.timestamp)
        self.opt_string("session_id", m.session_id)
        values = _list("values", m.values)
        _count("values", len(values), self.limits.max_channel_values)
        rounded = self.floats(values, "values[{}]")
        mask = m.valid_mask
        if mask is not None:
            mask = _list("valid_mask", mask, "a list of bools or None")
            if not self.trusted:
                _items(mask, "valid_mask[{}]", bool)
            _count("valid_mask", len(mask), self.limits.max_channel_values)
            if len(mask) != len(rounded):
                raise ValidationError(
                    "valid_mask", _K.LENGTH_MISMATCH, Count(len(mask)), Count(len(rounded))
                )
        self.metadata(m.metadata, len(rounded))
        return m if rounded is values else replace(m, values=rounded)

    def neuromodulators(self, m: NeuromodulatorSnapshot) -> NeuromodulatorSnapshot:
        _int("tick", m.tick, I64_MIN, I64_MAX, "i64")
        changes: dict[str, float] = {}
        for name, low, high in _LEVELS:
            original = getattr(m, name)
            value = self.number(name, original)
            _finite(name, value)
            if value < low or value > high:
                raise ValidationError(name, _K.OUT_OF_RANGE, Float(value), Range(low, high))
            if not _same(value, original):
                changes[name] = value
        return replace(m, **changes) if changes else m

    def loss(self, m: Loss) -> Loss:
        value = self.number("Loss", m.value)
        _finite("Loss", value)
        return m if _same(value, m.value) else Loss(value)

    def config_value(self, prefix: str, value: object) -> Any:
        """One config value, floats rounded (``value`` itself when unchanged)."""
        if type(value) is bool:
            return value
        if isinstance(value, str):
            self.string(f"{prefix}.value", value)
            return value
        if isinstance(value, list):
            _count(f"{prefix}.value", len(value), self.limits.max_channel_values)
            return self.floats(value, prefix + ".value[{}]")
        if not self.trusted and isinstance(value, int | np.integer) and not isinstance(value, bool):
            _u64(prefix, value)  # corpus-ipc's ConfigValue::Integer, numpy integers too
            return value if type(value) is int else int(value)
        number = self.number(prefix, value)
        _finite(f"{prefix}.value", number)
        return value if _same(number, value) else number

    def config(self, m: ConfigPayload) -> ConfigPayload:
        self.opt_string("session_id", m.session_id)
        config = m.config
        if not isinstance(config, dict):
            raise FieldTypeError("config", "a dict of str to config values", config)
        _count("config", len(config), self.limits.max_metadata_entries)
        total = self.add(0, len(config))
        changed: dict[str, Any] = {}
        for key, value in config.items():
            if key == "":
                raise ValidationError("config.<empty>", _K.NESTED_METADATA)
            self.string("config.<key>", key)
            checked = self.config_value(f"config.{key}", value)
            if isinstance(checked, list):
                total = self.add(total, len(checked))
            if checked is not value:
                changed[key] = checked
        if not changed:
            return m
        return replace(m, config={key: changed.get(key, value) for key, value in config.items()})

    def row(self, i: int, row: GradientUpdate) -> GradientUpdate:
        """Gradient row ``i`` (paths ``gradients[i].…``), floats rounded."""
        path = f"gradients[{i}]"
        self.string(f"{path}.layer_id", row.layer_id)
        values = _list(f"{path}.gradients", row.gradients)
        _count(f"{path}.gradients", len(values), self.limits.max_channel_values)
        rounded = self.floats(values, path + ".gradients[{}]")
        trace = row.eligibility_trace
        rounded_trace = trace
        if trace is not None:
            trace = _list(f"{path}.eligibility_trace", trace, "a list of floats or None")
            _count(f"{path}.eligibility_trace", len(trace), self.limits.max_channel_values)
            rounded_trace = self.floats(trace, path + ".eligibility_trace[{}]")
        if rounded is values and rounded_trace is trace:
            return row
        return replace(row, gradients=rounded, eligibility_trace=rounded_trace)

    def gradients(self, m: GradientBatch) -> GradientBatch:
        _u64("batch_id", m.batch_id)
        self.string("session_id", m.session_id)
        rows = _list("gradients", m.gradients)
        if not self.trusted:
            _items(rows, "gradients[{}]", GradientUpdate)
        _count("gradients", len(rows), self.limits.max_gradients)
        total = self.add(0, len(rows))
        checked_rows = rows
        for i, row in enumerate(rows):
            checked = self.row(i, row)
            # A row's values, then its trace, join the aggregate: the first overflow wins.
            total = self.add(total, len(row.gradients))
            if row.eligibility_trace is not None:
                total = self.add(total, len(row.eligibility_trace))
            if checked is not row:
                if checked_rows is rows:
                    checked_rows = list(rows)
                checked_rows[i] = checked
        ids = [row.layer_id for row in rows]
        repeat = _first_duplicate(ids)
        if repeat is not None:
            raise _duplicate(f"gradients[{repeat}]", ids[repeat])
        return m if checked_rows is rows else replace(m, gradients=checked_rows)

    def traces(self, m: TraceBatch) -> TraceBatch:
        _u64("batch_id", m.batch_id)
        self.string("session_id", m.session_id)
        traces = _list("traces", m.traces)
        if not self.trusted:
            _items(traces, "traces[{}]", TraceData)
        _count("traces", len(traces), self.limits.max_traces)
        self.add(0, len(traces))
        ids = [t.channel_id for t in traces]
        if not self.trusted:
            _ints(
                (ids, "traces[{}].channel_id", U16_MAX, "u16", "H"),
                (
                    [t.last_spike_time for t in traces],
                    "traces[{}].last_spike_time",
                    U32_MAX,
                    "u32",
                    "I",
                ),
            )
        values = [t.trace_value for t in traces]
        rounded = self.floats(values, "traces[{}].trace_value")
        repeat = _first_duplicate(ids)
        if repeat is not None:
            raise _duplicate(f"traces[{repeat}]", ids[repeat])
        if rounded is values:
            return m
        rows = [
            t if _same(r, t.trace_value) else replace(t, trace_value=r)
            for t, r in zip(traces, rounded, strict=True)
        ]
        return replace(m, traces=rows)

    def unit(self, m: IpcMessage) -> IpcMessage:
        return m


_DISPATCH: dict[type, Callable[[_Checker, Any], Any]] = {
    SpikeBatch: _Checker.spikes,
    EmbeddingBatch: _Checker.embeddings,
    StimulusBatch: _Checker.stimuli,
    NeuromodulatorSnapshot: _Checker.neuromodulators,
    Loss: _Checker.loss,
    ConfigPayload: _Checker.config,
    GradientBatch: _Checker.gradients,
    TraceBatch: _Checker.traces,
    TrainingComplete: _Checker.unit,
    Shutdown: _Checker.unit,
    Ping: _Checker.unit,
}


def checked(
    message: IpcMessage,
    limits: ProtocolLimits = DEFAULT_LIMITS,
    *,
    trusted: bool = False,
    track_peak: bool = True,
) -> tuple[IpcMessage, float]:
    """:func:`validate`, also returning a bound on the magnitude of every float in the result
    (a complete bound only when ``track_peak`` is true)."""
    check = _DISPATCH.get(type(message))
    if check is None:
        raise FieldTypeError("message", "one of the eleven flow messages", message)
    checker = _Checker(limits, trusted, track_peak)
    result: IpcMessage = check(checker, message)
    return result, checker.peak


def validate(
    message: IpcMessage, limits: ProtocolLimits = DEFAULT_LIMITS, *, trusted: bool = False
) -> IpcMessage:
    """Check ``message`` against ``limits``; return it with every float rounded to f32.

    The result is ``message`` itself when nothing needed rounding. ``trusted=True`` skips the
    Python type checks that a typed decode has already made. Raises ValidationError (a rule,
    at the first failure in corpus-ipc's order) or FieldTypeError (a value the wire cannot
    carry); both are InvalidInput.
    """
    return checked(message, limits, trusted=trusted, track_peak=False)[0]


__all__ = ["checked", "validate"]
