"""Flow validation: every rule passes at its exact boundary and fails one past it."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorswap.errors import FlowError, TensorSwapError
from tensorswap.flow import (
    DEFAULT_LIMITS,
    BatchMetadata,
    Bytes,
    ConfigPayload,
    Count,
    EmbeddingBatch,
    FieldTypeError,
    Float,
    GradientBatch,
    GradientUpdate,
    InvalidInput,
    IpcMessage,
    Loss,
    NeuromodulatorSnapshot,
    Ping,
    ProtocolLimits,
    Range,
    SpikeBatch,
    SpikeEvent,
    StimulusBatch,
    TraceBatch,
    TraceData,
    ValidationError,
    ValidationKind,
    decode,
    encode,
    f32,
    validate,
)
from tensorswap.flow.floats import F32_MAX
from tensorswap.flow.messages import U16_MAX, U32_MAX
from tensorswap.flow.validate import _Checker

N = 65_536  # the default cap of channel values, spike events, traces and gradient rows
AGGREGATE = 131_072
BELOW_ZERO = -1.401298464324817e-45  # the f32 just below 0.0
ABOVE_ONE = 1.0000001192092896  # the f32 just above 1.0


def spikes(n: int = 1, **fields: Any) -> SpikeBatch:
    events = [SpikeEvent(channel=i % 65_536, time=i, strength=0.5) for i in range(n)]
    return SpikeBatch(
        **{"session_id": None, "batch_id": 1, "timestamp": 2, "spikes": events, **fields}
    )


def fails(message: IpcMessage, text: str, limits: ProtocolLimits = DEFAULT_LIMITS) -> None:
    """``message`` fails validation with exactly ``text``, on encode too (default limits)."""
    with pytest.raises(ValidationError) as info:
        validate(message, limits)
    assert str(info.value) == text
    if limits is DEFAULT_LIMITS:
        with pytest.raises(ValidationError) as again:
            encode(message)
        assert str(again.value) == text


def passes(message: IpcMessage) -> None:
    assert validate(message) == message
    assert decode(encode(message)) == message


# ── the error itself ────────────────────────────────────────────────────────────────────────────
def test_a_failure_carries_path_kind_actual_and_limit() -> None:
    with pytest.raises(ValidationError) as info:
        validate(spikes(3), ProtocolLimits(max_spike_events=2))
    error = info.value
    assert (error.path, error.kind, error.actual, error.limit) == (
        "spikes",
        ValidationKind.LIMIT_EXCEEDED,
        Count(3),
        Count(2),
    )
    assert str(error) == "limit_exceeded at `spikes`, actual=3, limit=2"
    assert isinstance(error, InvalidInput)
    assert isinstance(error, ValueError)
    assert isinstance(error, FlowError)
    assert isinstance(error, TensorSwapError)


def test_kind_names_are_stable() -> None:
    assert [str(kind) for kind in ValidationKind] == [
        "non_finite",
        "out_of_range",
        "length_mismatch",
        "limit_exceeded",
        "nested_metadata",
        "duplicate_identifier",
    ]


def test_measures_print_as_rust_prints_them() -> None:
    assert str(Range(0.5, 2.0)) == "[0.5, 2]"
    assert str(Float(math.inf)) == "inf"
    assert str(Float(math.nan)) == "NaN"
    assert Float(math.nan) == Float(math.nan)  # compared by bits
    assert Count(1) != Bytes(1)


def test_default_limits() -> None:
    assert (
        ProtocolLimits()
        == DEFAULT_LIMITS
        == ProtocolLimits(
            max_channel_values=65_536,
            max_spike_events=65_536,
            max_traces=65_536,
            max_gradients=65_536,
            max_metadata_entries=256,
            max_string_bytes=1_024,
            max_aggregate_records=131_072,
        )
    )


# ── strings ─────────────────────────────────────────────────────────────────────────────────────
def test_string_limits_count_utf8_bytes() -> None:
    passes(spikes(session_id="a" * 1024))
    passes(spikes(session_id="é" * 512))
    fails(spikes(session_id="a" * 1025), "limit_exceeded at `session_id`, actual=1025, limit=1024")
    fails(
        spikes(session_id="é" * 512 + "a"),
        "limit_exceeded at `session_id`, actual=1025, limit=1024",
    )
    passes(spikes(session_id=""))


# ── spikes and metadata ─────────────────────────────────────────────────────────────────────────
def test_spike_event_count() -> None:
    passes(spikes(N))
    fails(spikes(N + 1), f"limit_exceeded at `spikes`, actual={N + 1}, limit={N}")
    passes(spikes(0))


@pytest.mark.parametrize(
    ("value", "shown"), [(math.nan, "NaN"), (math.inf, "inf"), (-math.inf, "-inf"), (3.5e38, "inf")]
)
def test_spike_strength_must_be_finite(value: float, shown: str) -> None:
    batch = spikes(3)
    batch.spikes[1] = SpikeEvent(channel=1, time=1, strength=value)
    fails(batch, f"non_finite at `spikes[1].strength`, actual={shown}")


def test_the_largest_f32_is_finite() -> None:
    batch = spikes(1)
    batch.spikes[0] = SpikeEvent(channel=0, time=0, strength=-3.4028234663852886e38)
    passes(batch)


def test_metadata_source_and_custom() -> None:
    def meta(**fields: Any) -> SpikeBatch:
        return spikes(1, metadata=BatchMetadata(**fields))

    passes(meta(source="s" * 1024, custom={f"k{i}": "v" for i in range(256)}))
    fails(meta(source="s" * 1025), "limit_exceeded at `source`, actual=1025, limit=1024")
    fails(
        meta(custom={f"k{i}": "v" for i in range(257)}),
        "limit_exceeded at `custom`, actual=257, limit=256",
    )
    fails(meta(custom={"": "v"}), "nested_metadata at `custom.<empty>`")
    passes(meta(custom={"k" * 1024: "v" * 1024}))
    fails(
        meta(custom={"k" * 1025: "v"}), "limit_exceeded at `custom.<key>`, actual=1025, limit=1024"
    )
    fails(
        meta(custom={"k": "v" * 1025}),
        "limit_exceeded at `custom.<value>`, actual=1025, limit=1024",
    )
    passes(meta(processing_latency_ns=2**64 - 1))


# ── embeddings ──────────────────────────────────────────────────────────────────────────────────
def embeddings(n: int = 1, sequence_length: int = 1) -> EmbeddingBatch:
    return EmbeddingBatch(
        session_id=None, batch_id=1, embedding=[0.25] * n, sequence_length=sequence_length
    )


def test_embedding_length_and_sequence_length() -> None:
    passes(embeddings(N, AGGREGATE))
    fails(embeddings(N + 1), f"limit_exceeded at `embedding`, actual={N + 1}, limit={N}")
    fails(
        embeddings(1, AGGREGATE + 1),
        f"limit_exceeded at `sequence_length`, actual={AGGREGATE + 1}, limit={AGGREGATE}",
    )
    message = embeddings(4)
    message.embedding[3] = math.nan
    fails(message, "non_finite at `embedding[3]`, actual=NaN")


# ── stimuli ─────────────────────────────────────────────────────────────────────────────────────
def stimuli(values: list[float], mask: list[bool] | None) -> StimulusBatch:
    return StimulusBatch(
        session_id=None, batch_id=1, timestamp=0, values=values, valid_mask=mask, metadata=None
    )


def test_stimulus_values_and_mask() -> None:
    passes(stimuli([0.0] * N, [True] * N))
    passes(stimuli([0.5, 0.0], [True, False]))
    passes(stimuli([], []))
    fails(stimuli([0.0] * (N + 1), None), f"limit_exceeded at `values`, actual={N + 1}, limit={N}")
    fails(
        stimuli([0.0] * N, [True] * (N + 1)),
        f"limit_exceeded at `valid_mask`, actual={N + 1}, limit={N}",
    )
    fails(stimuli([0.0] * 3, [True] * 2), "length_mismatch at `valid_mask`, actual=2, limit=3")
    fails(stimuli([0.0, math.inf], None), "non_finite at `values[1]`, actual=inf")


# ── neuromodulators and loss ────────────────────────────────────────────────────────────────────
def levels(**fields: float) -> NeuromodulatorSnapshot:
    base = {"dopamine": 0.5, "cortisol": 0.5, "acetylcholine": 0.5, "tempo": 1.0}
    return NeuromodulatorSnapshot(tick=-5, **{**base, **fields})


@pytest.mark.parametrize("name", ["dopamine", "cortisol", "acetylcholine"])
def test_unit_levels_are_within_zero_and_one(name: str) -> None:
    passes(levels(**{name: 0.0}))
    passes(levels(**{name: 1.0}))
    passes(levels(**{name: -0.0}))
    fails(
        levels(**{name: BELOW_ZERO}),
        f"out_of_range at `{name}`, actual=-{'0.' + '0' * 44 + '1'}, limit=[0, 1]",
    )
    fails(levels(**{name: ABOVE_ONE}), f"out_of_range at `{name}`, actual=1.0000001, limit=[0, 1]")
    fails(levels(**{name: math.nan}), f"non_finite at `{name}`, actual=NaN")


def test_tempo_is_within_half_and_two() -> None:
    passes(levels(tempo=0.5))
    passes(levels(tempo=2.0))
    fails(levels(tempo=0.49999997), "out_of_range at `tempo`, actual=0.49999997, limit=[0.5, 2]")
    fails(levels(tempo=2.0000002), "out_of_range at `tempo`, actual=2.0000002, limit=[0.5, 2]")
    fails(levels(tempo=-math.inf), "non_finite at `tempo`, actual=-inf")


def test_loss_must_be_finite() -> None:
    passes(Loss(-3.4028234663852886e38))
    fails(Loss(math.inf), "non_finite at `Loss`, actual=inf")


# ── config ──────────────────────────────────────────────────────────────────────────────────────
def config(entries: dict[str, Any]) -> ConfigPayload:
    return ConfigPayload(session_id="s", config=entries)


def test_config_entries_and_keys() -> None:
    passes(config({f"k{i}": 0.5 for i in range(256)}))
    fails(
        config({f"k{i}": 0.5 for i in range(257)}),
        "limit_exceeded at `config`, actual=257, limit=256",
    )
    fails(config({"": 0.5}), "nested_metadata at `config.<empty>`")
    fails(config({"k" * 1025: 0.5}), "limit_exceeded at `config.<key>`, actual=1025, limit=1024")


def test_config_values() -> None:
    passes(config({"s": "v" * 1024, "a": [0.5] * N, "b": True}))
    fails(config({"s": "v" * 1025}), "limit_exceeded at `config.s.value`, actual=1025, limit=1024")
    fails(config({"f": math.nan}), "non_finite at `config.f.value`, actual=NaN")
    fails(
        config({"a": [0.5] * (N + 1)}),
        f"limit_exceeded at `config.a.value`, actual={N + 1}, limit={N}",
    )
    fails(config({"a": [0.0, 0.0, -math.inf]}), "non_finite at `config.a.value[2]`, actual=-inf")


def test_config_aggregate() -> None:
    # 2 entries + 2 arrays of 65,535 values = 131,072 records
    passes(config({"a": [0.5] * (N - 1), "b": [0.5] * (N - 1)}))
    fails(
        config({"a": [0.5] * (N - 1), "b": [0.5] * N}),
        f"limit_exceeded at `aggregate`, actual={AGGREGATE + 1}, limit={AGGREGATE}",
    )


# ── gradients ───────────────────────────────────────────────────────────────────────────────────
def gradients(*rows: GradientUpdate) -> GradientBatch:
    return GradientBatch(session_id="s", batch_id=1, gradients=list(rows))


def row(layer_id: str, n: int = 1, trace: int | None = None) -> GradientUpdate:
    return GradientUpdate(
        layer_id=layer_id,
        gradients=[0.5] * n,
        eligibility_trace=None if trace is None else [0.25] * trace,
    )


def test_gradient_rows() -> None:
    passes(gradients(*(row(str(i), 0) for i in range(N))))
    fails(
        gradients(*(row(str(i), 0) for i in range(N + 1))),
        f"limit_exceeded at `gradients`, actual={N + 1}, limit={N}",
    )


def test_gradient_values_and_traces_per_row() -> None:
    passes(gradients(row("a", N), row("b", 0, N - 2)))
    fails(
        gradients(row("a", N + 1)),
        f"limit_exceeded at `gradients[0].gradients`, actual={N + 1}, limit={N}",
    )
    fails(
        gradients(row("a"), row("b", 1, N + 1)),
        f"limit_exceeded at `gradients[1].eligibility_trace`, actual={N + 1}, limit={N}",
    )
    bad = row("b", 3)
    bad.gradients[2] = math.inf
    fails(gradients(row("a"), bad), "non_finite at `gradients[1].gradients[2]`, actual=inf")
    bad_trace = row("a", 1, 1)
    assert bad_trace.eligibility_trace is not None
    bad_trace.eligibility_trace[0] = math.nan
    fails(gradients(bad_trace), "non_finite at `gradients[0].eligibility_trace[0]`, actual=NaN")
    fails(
        gradients(row("a" * 1025)),
        "limit_exceeded at `gradients[0].layer_id`, actual=1025, limit=1024",
    )


def test_gradient_aggregate_counts_rows_values_and_traces() -> None:
    # 2 rows + 65,535 values + 65,535 trace values = 131,072 records
    passes(gradients(row("a", N - 1), row("b", 0, N - 1)))
    fails(
        gradients(row("a", N - 1), row("b", 0, N)),
        f"limit_exceeded at `aggregate`, actual={AGGREGATE + 1}, limit={AGGREGATE}",
    )


def test_layer_ids_are_unique() -> None:
    passes(gradients(row("layer-a"), row("layer-b")))
    fails(
        gradients(row("x"), row("layer"), row("layer")),
        "duplicate_identifier at `gradients[2]:layer`",
    )
    # a numeric id is reported as ``actual``
    fails(gradients(row("7"), row("7")), "duplicate_identifier at `gradients[1]`, actual=7")
    # corpus-ipc only appends the id when the path does not already contain it
    fails(gradients(row("s"), row("s")), "duplicate_identifier at `gradients[1]`")


# ── traces ──────────────────────────────────────────────────────────────────────────────────────
def traces(*channels: int, value: float = 0.5) -> TraceBatch:
    rows = [TraceData(channel_id=c, trace_value=value, last_spike_time=c) for c in channels]
    return TraceBatch(session_id="s", batch_id=1, traces=rows)


def test_trace_count_and_unique_channels() -> None:
    passes(traces(*range(N)))
    fails(traces(*range(N), 0), f"limit_exceeded at `traces`, actual={N + 1}, limit={N}")
    fails(traces(5, 6, 5), "duplicate_identifier at `traces[2]`, actual=5")
    fails(traces(1, value=math.inf), "non_finite at `traces[0].trace_value`, actual=inf")


def test_empty_collections_are_allowed() -> None:
    passes(gradients())
    passes(traces())
    passes(config({}))
    passes(embeddings(0, 0))


# ── custom limits ───────────────────────────────────────────────────────────────────────────────
def test_custom_limits_apply_to_validate() -> None:
    tight = ProtocolLimits(max_string_bytes=3, max_aggregate_records=4)
    fails(spikes(1, session_id="abcd"), "limit_exceeded at `session_id`, actual=4, limit=3", tight)
    fails(spikes(5), "limit_exceeded at `aggregate`, actual=5, limit=4", tight)
    assert validate(spikes(4), tight) is not None


# ── rounding ────────────────────────────────────────────────────────────────────────────────────
def test_validate_returns_the_same_object_when_every_float_is_f32() -> None:
    message = spikes(4)
    assert validate(message) is message


def test_validate_returns_a_rounded_copy_and_leaves_the_original() -> None:
    message = gradients(GradientUpdate(layer_id="a", gradients=[0.1, 0.5], eligibility_trace=[1]))
    result = validate(message)
    assert isinstance(result, GradientBatch)
    assert result.gradients[0].gradients == [f32(0.1), 0.5]
    assert result.gradients[0].eligibility_trace == [1.0]
    assert message.gradients[0].gradients == [0.1, 0.5]


# ── values the wire cannot carry ────────────────────────────────────────────────────────────────
@pytest.mark.parametrize(
    ("message", "path"),
    [
        (
            SpikeBatch(
                session_id=None,
                batch_id=1,
                timestamp=0,
                spikes=[SpikeEvent(channel=70_000, time=0, strength=0.5)],
            ),
            "spikes[0].channel",
        ),
        (
            SpikeBatch(
                session_id=None,
                batch_id=1,
                timestamp=0,
                spikes=[SpikeEvent(channel=True, time=0, strength=0.5)],
            ),
            "spikes[0].channel",
        ),
        (
            SpikeBatch(
                session_id=None,
                batch_id=1,
                timestamp=0,
                spikes=[SpikeEvent(channel=1, time=-1, strength=0.5)],
            ),
            "spikes[0].time",
        ),
        (
            SpikeBatch(
                session_id=None,
                batch_id=1,
                timestamp=0,
                spikes=[SpikeEvent(channel=1, time=0, strength="0.5")],
            ),  # type: ignore[arg-type]
            "spikes[0].strength",
        ),
        (
            SpikeBatch(
                session_id=None,
                batch_id=1,
                timestamp=0,
                spikes=[SpikeEvent(channel=1, time=0, strength=True)],
            ),
            "spikes[0].strength",
        ),
        (
            SpikeBatch(session_id=None, batch_id=1, timestamp=0, spikes=[Ping()]),  # type: ignore[list-item]
            "spikes[0]",
        ),
        (
            SpikeBatch(session_id=7, batch_id=1, timestamp=0, spikes=[]),  # type: ignore[arg-type]
            "session_id",
        ),
        (SpikeBatch(session_id=None, batch_id=-1, timestamp=0, spikes=[]), "batch_id"),
        (SpikeBatch(session_id=None, batch_id=2**64, timestamp=0, spikes=[]), "batch_id"),
        (
            SpikeBatch(session_id=None, batch_id=1, timestamp=0, spikes=(1,)),  # type: ignore[arg-type]
            "spikes",
        ),
        (
            NeuromodulatorSnapshot(tick=2**63, dopamine=0, cortisol=0, acetylcholine=0, tempo=1),
            "tick",
        ),
        (stimuli([0.5], [1]), "valid_mask[0]"),  # type: ignore[list-item]
        (config({"n": -1}), "config.n"),
        (config({"n": None}), "config.n"),
        (config({1: 0.5}), "config.<key>"),  # type: ignore[dict-item]
        (traces(70_000), "traces[0].channel_id"),
        (
            GradientBatch(session_id=None, batch_id=1, gradients=[]),  # type: ignore[arg-type]
            "session_id",
        ),
        (Loss("x"), "Loss"),  # type: ignore[arg-type]
    ],
)
def test_values_the_wire_cannot_carry_are_field_type_errors(message: Any, path: str) -> None:
    for attempt in (validate, encode):
        with pytest.raises(FieldTypeError) as info:
            attempt(message)
        assert info.value.path == path
        assert isinstance(info.value, TypeError)
        assert isinstance(info.value, InvalidInput)


def test_python_ints_are_accepted_as_floats() -> None:
    data = encode(Loss(3))  # type: ignore[arg-type]
    assert data == b'{"payload":{"Loss":3.0},"wire_version":1}'
    assert decode(encode(spikes(1, spikes=[SpikeEvent(channel=1, time=1, strength=1)]))) == spikes(
        1, spikes=[SpikeEvent(channel=1, time=1, strength=1.0)]
    )


def test_only_messages_validate() -> None:
    with pytest.raises(FieldTypeError):
        validate(object())  # type: ignore[arg-type]
    assert validate(Ping()) == Ping()


# ── decoding applies the same rules ─────────────────────────────────────────────────────────────
def test_decode_applies_the_limits() -> None:
    events = [{"channel": 0, "time": 0, "strength": 0.5}] * (N + 1)
    doc = {
        "Spikes": {
            "session_id": None,
            "batch_id": 1,
            "timestamp": 0,
            "spikes": events,
            "metadata": None,
        }
    }
    with pytest.raises(ValidationError, match="limit_exceeded at `spikes`"):
        decode(json.dumps(doc))
    doc["Spikes"]["spikes"] = events[:N]
    assert isinstance(decode(json.dumps(doc)), SpikeBatch)


def test_decode_checks_unique_ids_and_mask_length() -> None:
    with pytest.raises(ValidationError, match="duplicate_identifier at `traces\\[1\\]`, actual=4"):
        decode(
            '{"EligibilityTraces":{"session_id":"s","batch_id":1,"traces":['
            '{"channel_id":4,"trace_value":0.5,"last_spike_time":1},'
            '{"channel_id":4,"trace_value":0.5,"last_spike_time":1}]}}'
        )
    with pytest.raises(ValidationError, match="length_mismatch at `valid_mask`"):
        decode(
            '{"Stimuli":{"session_id":null,"batch_id":1,"timestamp":0,"values":[0.5],'
            '"valid_mask":[true,false],"metadata":null}}'
        )
    with pytest.raises(ValidationError, match=r"nested_metadata at `config\.<empty>`"):
        decode('{"ConfigUpdate":{"session_id":null,"config":{"":1}}}')


# ── the fast spike path agrees with the precise checks ─────────────────────────────────────────
class _Level(int):
    """An int subclass: accepted where an integer is wanted, like any int."""


class _Real(float):
    """A float subclass: accepted as a float and replaced by a plain one."""


_INTEGERS = st.one_of(
    st.integers(-2, 2**33),
    st.sampled_from([0, 1, U16_MAX, U16_MAX + 1, U32_MAX, U32_MAX + 1, -1]),
    st.booleans(),
    st.integers(0, U16_MAX).map(_Level),
    st.just(0.0),
    st.just("1"),
)
_STRENGTHS = st.one_of(
    st.floats(width=32),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 0.1, 1e16, -1e16, F32_MAX, -F32_MAX, 3.5e38, math.inf, 1e-46]),
    st.integers(-(2**130), 2**130),
    st.booleans(),
    st.floats(width=32, allow_nan=False).map(_Real),
    st.just("0.5"),
    st.none(),
)


def _outcome(message: SpikeBatch) -> tuple[str, object]:
    try:
        result = validate(message)
    except InvalidInput as exc:
        return type(exc).__name__, str(exc)
    body = [(type(e.strength), e.strength, e.channel, e.time) for e in result.spikes]
    try:
        data: object = encode(result)
    except TypeError as exc:  # msgspec cannot encode an int subclass that is not an enum
        data = str(exc)
    return "ok", (result is message, body, data)


_WELL_TYPED = st.tuples(
    st.integers(0, U16_MAX),
    st.integers(0, U32_MAX),
    st.one_of(st.floats(width=32), st.floats(allow_nan=True, allow_infinity=True)),
)


@settings(max_examples=400, deadline=None)
@given(
    st.one_of(
        st.lists(st.tuples(_INTEGERS, _INTEGERS, _STRENGTHS), max_size=6),
        st.lists(_WELL_TYPED, max_size=70),  # the fast path's own domain, rounding included
    )
)
def test_the_fast_spike_path_agrees_with_the_precise_checks(
    columns: list[tuple[Any, Any, Any]],
) -> None:
    events = [SpikeEvent(channel=c, time=t, strength=s) for c, t, s in columns]
    message = spikes(0, spikes=events)
    fast = _outcome(message)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_Checker, "spike_columns", lambda self, *columns: None)
        precise = _outcome(message)
    assert fast == precise


@pytest.mark.parametrize("sign", [1, -1])
def test_an_int_beyond_the_f64_range_is_non_finite(sign: int) -> None:
    huge = sign * 10**400
    shown = "inf" if sign > 0 else "-inf"
    fails(Loss(huge), f"non_finite at `Loss`, actual={shown}")  # type: ignore[arg-type]
    fails(
        spikes(1, spikes=[SpikeEvent(channel=1, time=1, strength=huge)]),  # type: ignore[arg-type]
        f"non_finite at `spikes[0].strength`, actual={shown}",
    )
    fails(
        GradientBatch(
            session_id="s",
            batch_id=1,
            gradients=[GradientUpdate(layer_id="l", gradients=[0.5, huge])],  # type: ignore[list-item]
        ),
        f"non_finite at `gradients[0].gradients[1]`, actual={shown}",
    )
