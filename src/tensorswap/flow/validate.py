"""Message validation, check for check and path for path as corpus-ipc's ``Validate`` does it.

:func:`validate` runs on every encode and decode. It rounds floats to f32 first (a message is
returned as is when every float already is one), then checks the rules in corpus-ipc's order and
raises :class:`~tensorswap.flow.errors.ValidationError` at the first failure. Bounds are strict
(``>`` fails) and empty collections are allowed. Python values the wire cannot carry (a ``str``
channel, a negative id, ``True`` as a float) raise :class:`~tensorswap.flow.errors.FieldTypeError`.

This module holds the rules of each message kind; the checks they share (field types, integer
and float columns, limits, metadata) are in :mod:`tensorswap.flow.checks`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from msgspec.structs import replace

from tensorswap.flow.checks import (
    FieldChecks,
    as_list,
    check_count,
    check_finite,
    check_int,
    check_int_columns,
    check_items,
    check_u64,
    duplicate_identifier,
    first_duplicate,
    same_float,
)
from tensorswap.flow.errors import FieldTypeError, ValidationError, ValidationKind
from tensorswap.flow.limits import DEFAULT_LIMITS, Count, Float, ProtocolLimits, Range
from tensorswap.flow.messages import (
    I64_MAX,
    I64_MIN,
    U16_MAX,
    U32_MAX,
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
_LEVELS = (
    ("dopamine", 0.0, 1.0),
    ("cortisol", 0.0, 1.0),
    ("acetylcholine", 0.0, 1.0),
    ("tempo", 0.5, 2.0),
)


class _Checker(FieldChecks):
    """One validation pass, a method per message; the shared pieces are `FieldChecks`'s."""

    __slots__ = ()

    # ── one method per message ─────────────────────────────────────────────────────────────────
    def spikes(self, m: SpikeBatch) -> SpikeBatch:
        check_u64("batch_id", m.batch_id)
        check_u64("timestamp", m.timestamp)
        self.opt_string("session_id", m.session_id)
        spikes = as_list("spikes", m.spikes)
        check_count("spikes", len(spikes), self.limits.max_spike_events)
        if self.trusted:  # a typed decode has checked the types and integer widths
            strengths = [e.strength for e in spikes]
            rounded = self.floats(strengths, "spikes[{}].strength")
        else:
            if list(map(type, spikes)) != [SpikeEvent] * len(spikes):
                check_items(spikes, "spikes[{}]", SpikeEvent)
            channels = [e.channel for e in spikes]
            times = [e.time for e in spikes]
            strengths = [e.strength for e in spikes]
            fast = self.spike_columns(channels, times, strengths)
            if fast is None:  # something needs a closer look: the precise checks, in order
                check_int_columns(
                    (channels, "spikes[{}].channel", U16_MAX, "u16", "H"),
                    (times, "spikes[{}].time", U32_MAX, "u32", "I"),
                )
                fast = self.floats(strengths, "spikes[{}].strength")
            rounded = fast
        self.metadata(m.metadata, len(spikes))
        if rounded is strengths:
            return m
        events = [
            e if same_float(r, e.strength) else replace(e, strength=r)
            for e, r in zip(spikes, rounded, strict=True)
        ]
        return replace(m, spikes=events)

    def embeddings(self, m: EmbeddingBatch) -> EmbeddingBatch:
        check_u64("batch_id", m.batch_id)
        check_u64("sequence_length", m.sequence_length)
        self.opt_string("session_id", m.session_id)
        embedding = as_list("embedding", m.embedding)
        check_count("embedding", len(embedding), self.limits.max_channel_values)
        check_count("sequence_length", m.sequence_length, self.limits.max_aggregate_records)
        rounded = self.floats(embedding, "embedding[{}]")
        self.add(0, len(rounded))
        return m if rounded is embedding else replace(m, embedding=rounded)

    def stimuli(self, m: StimulusBatch) -> StimulusBatch:
        check_u64("batch_id", m.batch_id)
        check_u64("timestamp", m.timestamp)
        self.opt_string("session_id", m.session_id)
        values = as_list("values", m.values)
        check_count("values", len(values), self.limits.max_channel_values)
        rounded = self.floats(values, "values[{}]")
        mask = m.valid_mask
        if mask is not None:
            mask = as_list("valid_mask", mask, "a list of bools or None")
            if not self.trusted:
                check_items(mask, "valid_mask[{}]", bool)
            check_count("valid_mask", len(mask), self.limits.max_channel_values)
            if len(mask) != len(rounded):
                raise ValidationError(
                    "valid_mask", _K.LENGTH_MISMATCH, Count(len(mask)), Count(len(rounded))
                )
        self.metadata(m.metadata, len(rounded))
        return m if rounded is values else replace(m, values=rounded)

    def neuromodulators(self, m: NeuromodulatorSnapshot) -> NeuromodulatorSnapshot:
        check_int("tick", m.tick, I64_MIN, I64_MAX, "i64")
        changes: dict[str, float] = {}
        for name, low, high in _LEVELS:
            original = getattr(m, name)
            value = self.number(name, original)
            check_finite(name, value)
            if value < low or value > high:
                raise ValidationError(name, _K.OUT_OF_RANGE, Float(value), Range(low, high))
            if not same_float(value, original):
                changes[name] = value
        return replace(m, **changes) if changes else m

    def loss(self, m: Loss) -> Loss:
        value = self.number("Loss", m.value)
        check_finite("Loss", value)
        return m if same_float(value, m.value) else Loss(value)

    def config_value(self, prefix: str, value: object) -> Any:
        """One config value, floats rounded (``value`` itself when unchanged)."""
        if type(value) is bool:
            return value
        if isinstance(value, str):
            self.string(f"{prefix}.value", value)
            return value
        if isinstance(value, list):
            check_count(f"{prefix}.value", len(value), self.limits.max_channel_values)
            return self.floats(value, prefix + ".value[{}]")
        if not self.trusted and isinstance(value, int | np.integer) and not isinstance(value, bool):
            check_u64(prefix, value)  # corpus-ipc's ConfigValue::Integer, numpy integers too
            return value if type(value) is int else int(value)
        number = self.number(prefix, value)
        check_finite(f"{prefix}.value", number)
        return value if same_float(number, value) else number

    def config(self, m: ConfigPayload) -> ConfigPayload:
        self.opt_string("session_id", m.session_id)
        config = m.config
        if not isinstance(config, dict):
            raise FieldTypeError("config", "a dict of str to config values", config)
        check_count("config", len(config), self.limits.max_metadata_entries)
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
        values = as_list(f"{path}.gradients", row.gradients)
        check_count(f"{path}.gradients", len(values), self.limits.max_channel_values)
        rounded = self.floats(values, path + ".gradients[{}]")
        trace = row.eligibility_trace
        rounded_trace = trace
        if trace is not None:
            trace = as_list(f"{path}.eligibility_trace", trace, "a list of floats or None")
            check_count(f"{path}.eligibility_trace", len(trace), self.limits.max_channel_values)
            rounded_trace = self.floats(trace, path + ".eligibility_trace[{}]")
        if rounded is values and rounded_trace is trace:
            return row
        return replace(row, gradients=rounded, eligibility_trace=rounded_trace)

    def gradients(self, m: GradientBatch) -> GradientBatch:
        check_u64("batch_id", m.batch_id)
        self.string("session_id", m.session_id)
        rows = as_list("gradients", m.gradients)
        if not self.trusted:
            check_items(rows, "gradients[{}]", GradientUpdate)
        check_count("gradients", len(rows), self.limits.max_gradients)
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
        repeat = first_duplicate(ids)
        if repeat is not None:
            raise duplicate_identifier(f"gradients[{repeat}]", ids[repeat])
        return m if checked_rows is rows else replace(m, gradients=checked_rows)

    def traces(self, m: TraceBatch) -> TraceBatch:
        check_u64("batch_id", m.batch_id)
        self.string("session_id", m.session_id)
        traces = as_list("traces", m.traces)
        if not self.trusted:
            check_items(traces, "traces[{}]", TraceData)
        check_count("traces", len(traces), self.limits.max_traces)
        self.add(0, len(traces))
        ids = [t.channel_id for t in traces]
        if not self.trusted:
            check_int_columns(
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
        repeat = first_duplicate(ids)
        if repeat is not None:
            raise duplicate_identifier(f"traces[{repeat}]", ids[repeat])
        if rounded is values:
            return m
        rows = [
            t if same_float(r, t.trace_value) else replace(t, trace_value=r)
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
