"""Flow messages: serde-compatible JSON for every variant, the canonical envelope, decoding."""

from __future__ import annotations

import enum
import hashlib
import json
import math
import re
import struct
from decimal import Decimal

import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from helpers.memory import traced
from tensorswap.errors import TensorSwapError
from tensorswap.flow import (
    BatchMetadata,
    CommunicationError,
    ConfigPayload,
    EmbeddingBatch,
    FieldTypeError,
    GradientBatch,
    GradientUpdate,
    Loss,
    MalformedMessage,
    NeuromodulatorSnapshot,
    Ping,
    Shutdown,
    SpikeBatch,
    SpikeEvent,
    StimulusBatch,
    TraceBatch,
    TraceData,
    TrainingComplete,
    ValidationError,
    WireVersionError,
    decode,
    encode,
    encode_message,
    f32,
    validate,
    variant_name,
)
from tensorswap.flow.floats import plus_exponents, rust_display_f32, serde_f32, serde_f64
from tensorswap.flow.messages import MESSAGE_TYPES, VARIANTS

# corpus-ipc's own test: one JSON document per variant, exactly as serde_json writes it.
SEED_DOCUMENTS = [
    (
        "Spikes",
        '{"Spikes":{"session_id":null,"batch_id":1,"timestamp":0,'
        '"spikes":[{"channel":1,"time":1,"strength":0.5}],"metadata":null}}',
    ),
    (
        "Embeddings",
        '{"Embeddings":{"session_id":null,"batch_id":1,"embedding":[0.5],"sequence_length":1}}',
    ),
    (
        "Stimuli",
        '{"Stimuli":{"session_id":null,"batch_id":1,"timestamp":0,"values":[0.5],'
        '"valid_mask":null,"metadata":null}}',
    ),
    (
        "Neuromodulators",
        '{"Neuromodulators":{"tick":1,"dopamine":0.25,"cortisol":0.5,"acetylcholine":0.75,'
        '"tempo":1.0}}',
    ),
    ("Loss", '{"Loss":0.25}'),
    ("ConfigUpdate", '{"ConfigUpdate":{"session_id":null,"config":{"gain":0.5}}}'),
    (
        "GradientUpdate",
        '{"GradientUpdate":{"session_id":"session","batch_id":1,"gradients":'
        '[{"layer_id":"layer","gradients":[0.5],"eligibility_trace":null}]}}',
    ),
    (
        "EligibilityTraces",
        '{"EligibilityTraces":{"session_id":"session","batch_id":1,"traces":'
        '[{"channel_id":1,"trace_value":0.25,"last_spike_time":1}]}}',
    ),
    ("TrainingComplete", '"TrainingComplete"'),
    ("Shutdown", '"Shutdown"'),
    ("Ping", '"Ping"'),
]


# ── every variant ────────────────────────────────────────────────────────────────────────────────
@pytest.mark.parametrize(("name", "document"), SEED_DOCUMENTS, ids=[n for n, _ in SEED_DOCUMENTS])
def test_seed_document_decodes_and_encodes_back_byte_for_byte(name: str, document: str) -> None:
    message = decode(document)
    assert variant_name(message) == name
    assert type(message) is VARIANTS[name]
    assert encode_message(message) == document.encode()


@pytest.mark.parametrize(("name", "document"), SEED_DOCUMENTS, ids=[n for n, _ in SEED_DOCUMENTS])
def test_every_variant_round_trips_through_the_envelope(name: str, document: str) -> None:
    message = decode(document)
    data = encode(message)
    assert json.loads(data)["wire_version"] == 1
    assert decode(data) == message
    assert encode(decode(data)) == data


def test_the_seed_documents_cover_every_variant_once() -> None:
    assert sorted(name for name, _ in SEED_DOCUMENTS) == sorted(VARIANTS)
    assert len(MESSAGE_TYPES) == 11


def test_variant_name_rejects_non_messages() -> None:
    with pytest.raises(TypeError):
        variant_name("Ping")  # type: ignore[arg-type]


@pytest.mark.parametrize("cls", [c for c in MESSAGE_TYPES] + [SpikeEvent, TraceData])
def test_fields_are_declared_in_sorted_wire_order(cls: type) -> None:
    fields = list(cls.__struct_fields__)  # type: ignore[attr-defined]
    assert fields == sorted(fields)


# ── canonical bytes: corpus-ipc's published wire-v1 vectors (sha256 from its manifest) ─────────
GOLDEN = [
    (
        NeuromodulatorSnapshot(tick=4096, dopamine=0.8, cortisol=0.1, acetylcholine=0.6, tempo=1.0),
        b'{"payload":{"Neuromodulators":{"acetylcholine":0.6000000238418579,'
        b'"cortisol":0.10000000149011612,"dopamine":0.800000011920929,"tempo":1.0,'
        b'"tick":4096}},"wire_version":1}',
        "c2ed7328c9d97677783efe7a22520d3383cca4f3aee1b56022ce0fe009fc5559",
    ),
    (
        ConfigPayload(session_id=None, config={"pos": 0.0, "neg": -0.0}),
        b'{"payload":{"ConfigUpdate":{"config":{"neg":-0.0,"pos":0.0},"session_id":null}},'
        b'"wire_version":1}',
        "6de72699f23ff5079aca6175ac8457f44eb1bff997bffe5b98a4470aeaf091e1",
    ),
    (
        SpikeBatch(
            session_id=None,
            batch_id=2**64 - 1,
            timestamp=2**64 - 1,
            spikes=[SpikeEvent(channel=65535, time=2**32 - 1, strength=3.4028234663852886e38)],
        ),
        b'{"payload":{"Spikes":{"batch_id":18446744073709551615,"metadata":null,'
        b'"session_id":null,"spikes":[{"channel":65535,"strength":3.4028234663852886e+38,'
        b'"time":4294967295}],"timestamp":18446744073709551615}},"wire_version":1}',
        "139d53159ea8e3e0259383c7035590c78b433c7cd42013a3b19fea71f70f2a31",
    ),
    (
        SpikeBatch(
            session_id="séssion-日本語",
            batch_id=55,
            timestamp=1_700_002_000,
            spikes=[SpikeEvent(channel=1, time=2, strength=0.5)],
            metadata=BatchMetadata(
                custom={"日本語": "spike-viz", "café": "naïve-Ω"},
                processing_latency_ns=42,
                source="encoder-Ω",
            ),
        ),
        '{"payload":{"Spikes":{"batch_id":55,"metadata":{"custom":{"café":"naïve-Ω",'
        '"日本語":"spike-viz"},"processing_latency_ns":42,"source":"encoder-Ω"},'
        '"session_id":"séssion-日本語","spikes":[{"channel":1,"strength":0.5,"time":2}],'
        '"timestamp":1700002000}},"wire_version":1}'.encode(),
        "da4fac593608b0b238cb004cafed10d9c7a832af9e4c017f9b6ebe60842bf82b",
    ),
    (
        ConfigPayload(
            session_id="sess-1",
            config={
                "zeta": 7.0,
                "tau": [0.1, 0.2, 0.3],
                "mode": "replay",
                "depth": 0.25,
                "alpha": True,
            },
        ),
        b'{"payload":{"ConfigUpdate":{"config":{"alpha":true,"depth":0.25,"mode":"replay",'
        b'"tau":[0.10000000149011612,0.20000000298023224,0.30000001192092896],"zeta":7.0},'
        b'"session_id":"sess-1"}},"wire_version":1}',
        "7c509f28002e388d914319112fa092a5bbb901fe5595ff3a216757c3b8f9c7d7",
    ),
    (
        GradientBatch(
            session_id="sess-1",
            batch_id=21,
            gradients=[
                GradientUpdate(
                    layer_id="layer-0", gradients=[0.01, -0.02], eligibility_trace=[0.5, 0.25]
                ),
                GradientUpdate(layer_id="layer-1", gradients=[0.5]),
            ],
        ),
        b'{"payload":{"GradientUpdate":{"batch_id":21,"gradients":[{"eligibility_trace":'
        b'[0.5,0.25],"gradients":[0.009999999776482582,-0.019999999552965164],'
        b'"layer_id":"layer-0"},{"eligibility_trace":null,"gradients":[0.5],'
        b'"layer_id":"layer-1"}],"session_id":"sess-1"}},"wire_version":1}',
        "2c78542f38be18d858f3f7d30f2254f774b7dbca93e25c6f269e5fa91cd5065f",
    ),
    (
        Ping(),
        b'{"payload":"Ping","wire_version":1}',
        "87c9ccce0a3c871b2a6b02fe87b6b278d2d3ca995e4fdcd1b9977cd98d6f11c8",
    ),
]


@pytest.mark.parametrize(("message", "expected", "digest"), GOLDEN, ids=lambda v: "")
def test_canonical_encoding_matches_corpus_ipc_vectors(
    message: object, expected: bytes, digest: str
) -> None:
    data = encode(message)  # type: ignore[arg-type]
    assert data == expected
    assert hashlib.sha256(data).hexdigest() == digest
    assert encode(decode(data)) == data


def test_canonical_keys_are_sorted_at_every_level() -> None:
    message = SpikeBatch(
        session_id="s",
        batch_id=1,
        timestamp=2,
        spikes=[],
        metadata=BatchMetadata(custom={"zz": "1", "b": "2", "a": "3", "é": "4"}, source="x"),
    )
    data = encode(message)

    def check(value: object) -> None:
        if isinstance(value, dict):
            keys = list(value)
            assert keys == sorted(keys, key=lambda k: k.encode())
            for item in value.values():
                check(item)
        elif isinstance(value, list):
            for item in value:
                check(item)

    check(json.loads(data))
    assert b'"custom":{"a":"3","b":"2","zz":"1","\xc3\xa9":"4"}' in data


def test_canonical_json_is_compact() -> None:
    data = encode(Loss(0.25))
    assert b" " not in data and b"\n" not in data


def test_negative_zero_is_preserved_both_ways() -> None:
    data = encode(Loss(-0.0))
    assert data == b'{"payload":{"Loss":-0.0},"wire_version":1}'
    value = decode(data)
    assert isinstance(value, Loss)
    assert math.copysign(1.0, value.value) == -1.0
    assert encode_message(Loss(-0.0)) == b'{"Loss":-0.0}'


def test_strings_are_escaped_as_serde_json_escapes_them() -> None:
    message = ConfigPayload(session_id='q"b\\s/\n\t\x01\x7f\u2028é', config={})
    expected = '"q\\"b\\\\s/\\n\\t\\u0001\x7f\u2028é"'.encode()
    assert b'"session_id":' + expected in encode(message)
    assert decode(encode(message)) == message


# ── floats: f32 on the wire ─────────────────────────────────────────────────────────────────────
@pytest.mark.parametrize(
    ("value", "canonical", "bare"),
    [
        (0.1, "0.10000000149011612", "0.1"),
        (1.0, "1.0", "1.0"),
        (0.25, "0.25", "0.25"),
        (1e-6, "9.999999974752427e-7", "0.000001"),
        (1e-7, "1.0000000116860974e-7", "1e-7"),
        (1e12, "999999995904.0", "1000000000000.0"),
        (1e13, "9999999827968.0", "1e+13"),
        (1e16, "1.0000000272564224e+16", "1e+16"),
        (1e20, "1.0000000200408773e+20", "1e+20"),
        (-2.5e-30, "-2.500000007927692e-30", "-2.5e-30"),
        (1.5e-45, "1.401298464324817e-45", "1e-45"),
    ],
)
def test_floats_print_as_serde_json_prints_f32(value: float, canonical: str, bare: str) -> None:
    assert encode(Loss(value)) == f'{{"payload":{{"Loss":{canonical}}},"wire_version":1}}'.encode()
    assert encode_message(Loss(value)) == f'{{"Loss":{bare}}}'.encode()


def test_a_non_f32_float_is_rounded_when_encoded() -> None:
    message = Loss(0.1)
    assert validate(message) == Loss(f32(0.1))
    assert decode(encode(message)) == Loss(0.10000000149011612)
    assert message.value == 0.1  # the caller's object is left alone


def test_decoding_rounds_json_floats_to_f32() -> None:
    assert decode('{"Loss":0.1}') == Loss(f32(0.1))
    assert decode('{"Loss":16777217}') == Loss(16777216.0)


finite_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


@given(finite_f32)
def test_any_finite_f32_round_trips_bit_for_bit(value: float) -> None:
    for data in (encode(Loss(value)), encode_message(Loss(value))):
        decoded = decode(data)
        assert isinstance(decoded, Loss)
        assert struct.pack("<f", decoded.value) == struct.pack("<f", value)


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_msgspec_floats_with_plus_exponents_match_serde_json(value: float) -> None:
    assert plus_exponents(msgspec.json.encode(value)).decode() == serde_f64(value)
    assert float(serde_f64(value)) == value


def _significant_digits(text: str) -> int:
    return len(text.lstrip("-").split("e")[0].replace(".", "").strip("0")) or 1


def _fewest_digits_that_round_trip(value: float) -> int:
    """Brute force: the fewest significant digits of any decimal that reads back as ``value``."""
    for n in range(1, 10):
        nearest = Decimal(f"{value:.{n - 1}e}")
        step = Decimal(1).scaleb(nearest.adjusted() - (n - 1))
        if any(f32(float(c)) == value for c in (nearest - step, nearest, nearest + step)):
            return n
    raise AssertionError(value)


@given(finite_f32)
def test_serde_f32_is_the_shortest_f32_repr(value: float) -> None:
    text = serde_f32(value)
    assert f32(float(text)) == value
    assert _significant_digits(text) == _fewest_digits_that_round_trip(value)


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (0.5, "0.5"),
        (2.0, "2"),
        (-0.0, "-0"),
        (1e-7, "0.0000001"),
        (1e20, "100000000000000000000"),
        (math.inf, "inf"),
        (-math.inf, "-inf"),
        (math.nan, "NaN"),
    ],
)
def test_rust_display_of_f32(value: float, shown: str) -> None:
    assert rust_display_f32(value) == shown


# ── envelope versions ───────────────────────────────────────────────────────────────────────────
def test_a_bare_message_is_accepted_as_version_one() -> None:
    assert decode('{"Loss":0.25}') == Loss(0.25)
    assert decode('"Ping"') == Ping()
    assert decode(b'{"Ping":null}') == Ping()


@pytest.mark.parametrize(("version", "words"), [(0, "too old"), (2, "too new"), (99, "too new")])
def test_an_unknown_version_is_an_error(version: int, words: str) -> None:
    with pytest.raises(WireVersionError) as info:
        decode(f'{{"payload":"Ping","wire_version":{version}}}')
    assert info.value.found == version
    assert words in str(info.value)
    assert isinstance(info.value, CommunicationError)


def test_the_version_is_checked_before_the_payload() -> None:
    with pytest.raises(WireVersionError):
        decode('{"wire_version":2,"payload":{"Spikes":{"garbage":true}}}')
    with pytest.raises(WireVersionError):
        decode('{"wire_version":2,"payload":{"FutureVariant":{}}}')


@pytest.mark.parametrize(
    ("document", "words"),
    [
        ('{"wire_version":1}', "missing payload"),
        ('{"wire_version":"1","payload":"Ping"}', 'got "1"'),
        ('{"wire_version":1.0,"payload":"Ping"}', "got 1.0"),
        ('{"wire_version":-1,"payload":"Ping"}', "got -1"),
        ('{"wire_version":4294967296,"payload":"Ping"}', "got 4294967296"),
        ('{"wire_version":null,"payload":"Ping"}', "got null"),
        ("[1,2]", "must be a JSON object"),
        ("42", "must be a JSON object"),
        ("null", "must be a JSON object"),
        ('{"Spikes":', "failed to decode envelope JSON"),
        ("", "failed to decode envelope JSON"),
        ('{"payload":"Ping"}', "unknown variant `payload`"),
        ('{"Bogus":{}}', "unknown variant `Bogus`"),
        ('"Bogus"', "unknown variant `Bogus`"),
        ('{"type":"Ping"}', "unknown variant `type`"),
        ('{"Loss":0.25,"Ping":null}', "exactly one variant key, found 2"),
        ("{}", "exactly one variant key, found 0"),
        ('"Spikes"', "expected variant Spikes with data"),
        ('{"Ping":1}', "expected unit variant Ping"),
        ('{"Loss":"x"}', "Loss"),
        ('{"Loss":true}', "Loss"),
    ],
)
def test_structural_faults_are_malformed_messages(document: str, words: str) -> None:
    with pytest.raises(MalformedMessage) as info:
        decode(document)
    assert words in str(info.value)
    assert isinstance(info.value, CommunicationError)
    assert isinstance(info.value, TensorSwapError)


@pytest.mark.parametrize(
    "document",
    [
        b'{"wire_version":1,"payload":"Ping","x":' + b"[" * 1000 + b"]" * 1000 + b"}",
        b'{"wire_version":2,"payload":"Ping","x":' + b"[" * 1000 + b"]" * 1000 + b"}",
        b"[" * 100_000 + b"]" * 100_000,
        b'{"Ping":' + b'{"a":' * 5000 + b"1" + b"}" * 5001,
    ],
    ids=["envelope", "future-envelope", "bare", "objects"],
)
def test_deeply_nested_json_is_a_malformed_message(document: bytes) -> None:
    with pytest.raises(MalformedMessage, match="nesting too deep"):
        decode(document)
    with pytest.raises(MalformedMessage, match="nesting too deep"):
        decode(document.decode())


@pytest.mark.parametrize(
    "filler",
    [b"[]", b"{}", b"[0]", b'{"a":[]}'],
    ids=["lists", "objects", "numbers", "nested"],
)
def test_a_broken_message_is_refused_without_building_its_json(filler: bytes) -> None:
    # A 4 MiB body that the typed decode refuses used to be decoded into a generic Python
    # tree first (about 20x its size: 1.5 GB for a 64 MiB frame); now the careful path only
    # checks its syntax and decodes each body into its typed classes. (150,000 items stay
    # under the JSON value budget; a frame beyond it is refused before the typed decode, see
    # test_flow_oversized_frames.py.)
    items = b",".join([filler] * 150_000)
    frame = (
        b'{"payload":{"Spikes":{"batch_id":1,"session_id":null,"timestamp":1,"spikes":['
        + items
        + b']}},"wire_version":1}'
    )
    where = r"Spikes: .* at `\$\.spikes\[0\]"
    with traced() as memory, pytest.raises(MalformedMessage, match=where):
        decode(frame)
    assert memory.peak < len(frame) // 4


def test_big_values_in_error_messages_are_clipped_not_decoded() -> None:
    big = b"[" + b"1," * 50_000 + b"1]"
    for document, words in [
        (b'{"wire_version":' + big + b',"payload":"Ping"}', "got [1,1,1"),
        (b'{"Ping":' + big + b"}", "invalid type: [1,1,1"),
        (b'{"wire_version":1,"payload":' + big + b"}", "invalid type: [1,1,1"),
    ]:
        with pytest.raises(MalformedMessage, match=re.escape(words)) as info:
            decode(document)
        assert len(str(info.value)) < 400


def test_a_trace_row_with_no_channel_is_named_in_every_form() -> None:
    for row in ('{"trace_value":0.5,"last_spike_time":3}', '{"neuron_id":"7"}'):
        body = '{"EligibilityTraces":{"session_id":"s","batch_id":1,"traces":[' + row + "]}}"
        with pytest.raises(MalformedMessage, match=r"at `\$\.traces\[0\]"):
            decode(body)
    body = (
        '{"EligibilityTraces":{"session_id":"s","batch_id":1,"traces":['
        '{"channel_id":1,"trace_value":0.5,"last_spike_time":3},'
        '{"trace_value":0.5,"last_spike_time":3}]}}'
    )
    with pytest.raises(
        MalformedMessage, match=r"missing required field `channel_id` - at `\$\.traces\[1\]`"
    ):
        decode(body)


def test_a_str_with_a_lone_surrogate_is_a_malformed_message() -> None:
    envelope = (
        '{"wire_version":1,"payload":{"Spikes":{"session_id":"\ud800","batch_id":1,'
        '"timestamp":1,"spikes":[]}}}'
    )
    bare = '{"Loss":0.5,"x":"\udfff"}'
    for document in (envelope, bare):
        with pytest.raises(MalformedMessage, match="not valid UTF-8"):
            decode(document)


@pytest.mark.parametrize(
    "document",
    [
        '{"wire_version":"' + "x" * 100_000 + '","payload":"Ping"}',
        '{"Ping":"' + "x" * 100_000 + '"}',
        '{"' + "X" * 100_000 + '":{}}',
        '"' + "Y" * 100_000 + '"',
        '{"wire_version":1,"payload":[' + "1," * 50_000 + "1]}",
    ],
    ids=["version", "unit-body", "variant-key", "variant-string", "payload"],
)
def test_malformed_messages_echo_at_most_a_bounded_excerpt(document: str) -> None:
    with pytest.raises(MalformedMessage) as info:
        decode(document)
    assert len(str(info.value)) < 500


def _spikes_json(**overrides: object) -> str:
    body: dict[str, object] = {
        "session_id": None,
        "batch_id": 1,
        "timestamp": 0,
        "spikes": [{"channel": 1, "time": 1, "strength": 0.5}],
        "metadata": None,
    }
    body.update(overrides)
    return json.dumps({"wire_version": 1, "payload": {"Spikes": body}})


@pytest.mark.parametrize(
    "overrides",
    [
        {"spikes": [{"channel": 65536, "time": 1, "strength": 0.5}]},
        {"spikes": [{"channel": -1, "time": 1, "strength": 0.5}]},
        {"spikes": [{"channel": True, "time": 1, "strength": 0.5}]},
        {"spikes": [{"channel": 1.0, "time": 1, "strength": 0.5}]},
        {"spikes": [{"channel": 1, "time": 2**32, "strength": 0.5}]},
        {"spikes": [{"channel": 1, "time": 1, "strength": "0.5"}]},
        {"spikes": [{"channel": 1, "time": 1}]},
        {"batch_id": 2**64},
        {"batch_id": -1},
        {"timestamp": None},
        {"session_id": 5},
        {"spikes": None},
        {"metadata": {"custom": {"k": 1}}},
    ],
)
def test_wrong_types_and_integer_widths_are_malformed(overrides: dict[str, object]) -> None:
    with pytest.raises(MalformedMessage):
        decode(_spikes_json(**overrides))


def test_integer_boundaries_decode() -> None:
    message = decode(_spikes_json(batch_id=2**64 - 1, timestamp=0))
    assert isinstance(message, SpikeBatch) and message.batch_id == 2**64 - 1
    for tick in (-(2**63), 2**63 - 1):
        doc = (
            f'{{"Neuromodulators":{{"tick":{tick},"dopamine":0,"cortisol":0,'
            '"acetylcholine":0,"tempo":1}}'
        )
        assert decode(doc) == NeuromodulatorSnapshot(
            tick=tick, dopamine=0.0, cortisol=0.0, acetylcholine=0.0, tempo=1.0
        )
    with pytest.raises(MalformedMessage):
        decode(
            '{"Neuromodulators":{"tick":9223372036854775808,"dopamine":0,"cortisol":0,'
            '"acetylcholine":0,"tempo":1}}'
        )


def test_required_and_optional_fields_follow_serde() -> None:
    no_session = json.loads(_spikes_json())
    del no_session["payload"]["Spikes"]["session_id"]
    with pytest.raises(MalformedMessage):
        decode(json.dumps(no_session))
    no_metadata = json.loads(_spikes_json())
    del no_metadata["payload"]["Spikes"]["metadata"]
    assert decode(json.dumps(no_metadata)) == decode(_spikes_json())
    with pytest.raises(MalformedMessage):  # valid_mask has no default in corpus-ipc
        decode('{"Stimuli":{"session_id":null,"batch_id":1,"timestamp":0,"values":[]}}')
    row = decode(
        '{"GradientUpdate":{"session_id":"s","batch_id":1,'
        '"gradients":[{"layer_id":"l","gradients":[]}]}}'
    )
    assert isinstance(row, GradientBatch) and row.gradients[0].eligibility_trace is None
    meta = decode(_spikes_json(metadata={}))
    assert isinstance(meta, SpikeBatch) and meta.metadata == BatchMetadata()


def test_unknown_fields_are_ignored() -> None:
    doc = json.loads(_spikes_json(extra_field=[1, 2]))
    doc["another"] = "x"
    doc["payload"]["Spikes"]["spikes"][0]["future"] = {"a": 1}
    assert decode(json.dumps(doc)) == decode(_spikes_json())


def test_neuron_id_is_an_alias_of_channel_id() -> None:
    doc = (
        '{"EligibilityTraces":{"session_id":"s","batch_id":1,"traces":'
        '[{"neuron_id":7,"trace_value":0.5,"last_spike_time":3}]}}'
    )
    message = decode(doc)
    assert message == TraceBatch(
        session_id="s",
        batch_id=1,
        traces=[TraceData(channel_id=7, trace_value=0.5, last_spike_time=3)],
    )
    assert b'"channel_id":7' in encode(message)
    with pytest.raises(MalformedMessage, match="duplicate field"):
        decode(doc.replace('"neuron_id":7', '"neuron_id":7,"channel_id":7'))


@pytest.mark.parametrize(
    "row",
    [
        '{"neuron_id":7,"channel_id":7,"trace_value":0.5,"last_spike_time":3}',
        '{"channel_id":2,"trace_value":0.5,"last_spike_time":3,"neuron_id":1}',
        '{"channel_id":2,"trace_value":0.5,"last_spike_time":3,"neuron\\u005fid":1}',
    ],
    ids=["first", "last", "escaped"],
)
def test_neuron_id_beside_channel_id_is_refused_in_every_form(row: str) -> None:
    body = '{"EligibilityTraces":{"session_id":"s","batch_id":1,"traces":[' + row + "]}}"
    envelope = '{"wire_version":1,"payload":' + body + "}"
    for document in (body, envelope, envelope.encode(), body.encode()):
        with pytest.raises(MalformedMessage, match="duplicate field `channel_id`"):
            decode(document)


def test_config_numbers_decode_as_float_and_python_ints_encode_as_integer() -> None:
    message = ConfigPayload(session_id="s", config={"n": 42, "big": 16777217})
    data = encode(message)
    assert b'"big":16777217' in data and b'"n":42' in data
    decoded = decode(data)
    assert isinstance(decoded, ConfigPayload)
    assert decoded.config == {"big": 16777216.0, "n": 42.0}
    assert type(decoded.config["n"]) is float
    assert b'"n":42.0' in encode(decoded)


def test_config_values_of_every_kind_round_trip() -> None:
    message = ConfigPayload(
        session_id=None, config={"f": 0.5, "s": "x", "b": False, "a": [0.25, -1.0], "e": []}
    )
    assert decode(encode(message)) == message
    assert decode(encode_message(message)) == message


def test_decode_accepts_bytes_str_bytearray_and_memoryview() -> None:
    data = encode(Loss(0.5))
    for form in (data, data.decode(), bytearray(data), memoryview(data)):
        assert decode(form) == Loss(0.5)


def test_encode_validates_and_never_writes_nan_as_null() -> None:
    with pytest.raises(ValidationError):
        encode(Loss(math.nan))
    with pytest.raises(ValidationError):
        encode_message(
            SpikeBatch(
                session_id=None,
                batch_id=0,
                timestamp=0,
                spikes=[SpikeEvent(channel=0, time=0, strength=math.inf)],
            )
        )
    with pytest.raises(FieldTypeError):
        encode("Ping")  # type: ignore[arg-type]


def test_decode_validates() -> None:
    with pytest.raises(ValidationError, match="out_of_range at `dopamine`"):
        decode(
            '{"Neuromodulators":{"tick":1,"dopamine":1.5,"cortisol":0,"acetylcholine":0,"tempo":1}}'
        )
    with pytest.raises(ValidationError, match="non_finite at `Loss`, actual=inf"):
        decode('{"Loss":1e39}')


# ── random messages ─────────────────────────────────────────────────────────────────────────────
u16 = st.integers(0, 2**16 - 1)
u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
text = st.text(max_size=20)
small = st.lists(finite_f32, max_size=8)
metadata = st.none() | st.builds(
    BatchMetadata,
    custom=st.dictionaries(st.text(min_size=1, max_size=8), text, max_size=4),
    processing_latency_ns=st.none() | u64,
    source=st.none() | text,
)
unit_interval = st.floats(0, 1, width=32)

messages = st.one_of(
    st.builds(
        SpikeBatch,
        session_id=st.none() | text,
        batch_id=u64,
        timestamp=u64,
        spikes=st.lists(
            st.builds(SpikeEvent, channel=u16, time=u32, strength=finite_f32), max_size=8
        ),
        metadata=metadata,
    ),
    st.builds(
        EmbeddingBatch,
        session_id=st.none() | text,
        batch_id=u64,
        embedding=small,
        sequence_length=st.integers(0, 131_072),
    ),
    small.flatmap(
        lambda values: st.builds(
            StimulusBatch,
            session_id=st.none() | text,
            batch_id=u64,
            timestamp=u64,
            values=st.just(values),
            valid_mask=st.none()
            | st.lists(st.booleans(), min_size=len(values), max_size=len(values)),
            metadata=metadata,
        )
    ),
    st.builds(
        NeuromodulatorSnapshot,
        tick=st.integers(-(2**63), 2**63 - 1),
        dopamine=unit_interval,
        cortisol=unit_interval,
        acetylcholine=unit_interval,
        tempo=st.floats(0.5, 2.0, width=32),
    ),
    st.builds(Loss, finite_f32),
    st.builds(
        ConfigPayload,
        session_id=st.none() | text,
        config=st.dictionaries(
            st.text(min_size=1, max_size=8), finite_f32 | text | st.booleans() | small, max_size=4
        ),
    ),
    st.builds(
        GradientBatch,
        session_id=text,
        batch_id=u64,
        gradients=st.lists(
            st.builds(
                GradientUpdate, layer_id=text, gradients=small, eligibility_trace=st.none() | small
            ),
            max_size=4,
            unique_by=lambda row: row.layer_id,
        ),
    ),
    st.builds(
        TraceBatch,
        session_id=text,
        batch_id=u64,
        traces=st.lists(
            st.builds(TraceData, channel_id=u16, trace_value=finite_f32, last_spike_time=u32),
            max_size=6,
            unique_by=lambda row: row.channel_id,
        ),
    ),
    st.sampled_from([TrainingComplete(), Shutdown(), Ping()]),
)


@given(messages)
def test_random_messages_round_trip_in_both_forms(message: object) -> None:
    data = encode(message)  # type: ignore[arg-type]
    assert decode(data) == message
    assert encode(decode(data)) == data
    assert decode(encode_message(message)) == message  # type: ignore[arg-type]


def test_the_public_names_import() -> None:
    import tensorswap.flow as flow

    assert flow.__all__ == sorted(flow.__all__, key=lambda name: (not name.isupper(), name))
    for name in flow.__all__:
        assert getattr(flow, name) is not None


# ── numbers and strings that are not exactly int / float / str ────────────────────────────────
class _Label(str):
    pass


class _Count(int):
    pass


class _Channel(enum.IntEnum):
    LEFT = 3


@pytest.mark.parametrize(
    ("channel", "time", "strength"),
    [
        (np.int64(1), np.uint32(7), np.float32(0.3)),
        (_Count(1), _Channel.LEFT, np.float64(0.30000001192092896)),
        (np.uint16(65535), np.uint64(2**32 - 1), np.float16(0.5)),
    ],
)
def test_numpy_scalars_and_subclasses_encode_as_plain_numbers(
    channel: object, time: object, strength: object
) -> None:
    plain = SpikeBatch(
        session_id="s",
        batch_id=2**64 - 1,
        timestamp=2,
        spikes=[SpikeEvent(channel=int(channel), time=int(time), strength=f32(float(strength)))],
    )
    odd = SpikeBatch(
        session_id=_Label("s"),
        batch_id=np.uint64(2**64 - 1),
        timestamp=_Count(2),
        spikes=[SpikeEvent(channel=channel, time=time, strength=strength)],
    )
    assert encode(odd) == encode(plain)
    assert encode_message(odd) == encode_message(plain)
    assert decode(encode(odd)) == plain
    assert encode(Loss(np.float32(0.25))) == encode(Loss(0.25))


@pytest.mark.parametrize("channel", [np.bool_(True), np.int64(65536), np.int64(-1), np.float32(1)])
def test_numpy_values_outside_the_field_type_are_refused(channel: object) -> None:
    message = SpikeBatch(
        session_id="s",
        batch_id=1,
        timestamp=2,
        spikes=[SpikeEvent(channel=channel, time=1, strength=0.5)],
    )
    with pytest.raises(FieldTypeError, match=r"spikes\[0\]\.channel"):
        encode(message)


@pytest.mark.parametrize(
    ("value", "written"),
    [
        (np.int64(42), b'"a":42'),
        (np.uint8(7), b'"a":7'),
        (np.uint64(2**64 - 1), b'"a":18446744073709551615'),
        (_Count(5), b'"a":5'),
    ],
)
def test_numpy_integer_config_values_are_written_as_integers(value: object, written: bytes) -> None:
    message = ConfigPayload(session_id=None, config={"a": value})  # type: ignore[dict-item]
    plain = ConfigPayload(session_id=None, config={"a": int(value)})  # type: ignore[call-overload]
    assert written in encode(message)
    assert encode(message) == encode(plain)
    assert encode_message(message) == encode_message(plain)
    checked = validate(message).config["a"]
    assert type(checked) is int and checked == int(value)  # type: ignore[call-overload]


@pytest.mark.parametrize("value", [np.int64(-1), np.int8(-128), -1, 2**64])
def test_config_integers_outside_u64_are_refused(value: object) -> None:
    message = ConfigPayload(session_id=None, config={"a": value})  # type: ignore[dict-item]
    with pytest.raises(FieldTypeError, match=r"`config\.a` must be an integer in 0\.\.="):
        encode(message)
