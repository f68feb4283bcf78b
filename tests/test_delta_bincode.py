"""bincode of DWE fragments: byte vectors built by hand from the spec, both directions."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.memory import traced
from tensorswap.delta import (
    DWE_SCHEMA,
    MAX_DWE_FRAGMENT_BYTES,
    DweFragment,
    DweLayerDelta,
    FragmentTooLarge,
    MalformedFragment,
    TruncatedFragment,
    decode_fragment,
    decode_fragment_file,
    decode_fragment_signed,
    encode_fragment,
    encode_frame,
    encoded_size,
    extract_delta_fragment,
    looks_like_fragment_file,
    make_fragment,
    read_frame_length,
)


def _string(text: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _hand_hash(layers: list[tuple[int, list[int], list[float]]]) -> str:
    h = hashlib.sha256()
    for index, shape, values in layers:
        h.update(struct.pack("<Q", index))
        for dim in shape:
            h.update(struct.pack("<Q", dim))
        for value in values:
            h.update(struct.pack("<f", value))
    return h.hexdigest()


def _hand_bytes(
    schema: str, session: str, seq: int, layers: list[tuple[int, list[int], list[float]]]
) -> bytes:
    out = _string(schema) + _string(session) + struct.pack("<Q", seq)
    out += struct.pack("<Q", len(layers))
    for index, shape, values in layers:
        out += struct.pack("<Q", index)
        out += struct.pack("<Q", len(shape)) + b"".join(struct.pack("<Q", d) for d in shape)
        out += struct.pack("<Q", len(values)) + b"".join(struct.pack("<f", v) for v in values)
    return out + _string(_hand_hash(layers))


SEED_LAYERS = [(0, [2, 2], [1.0, 1.0, 1.0, 1.0])]
MIXED_LAYERS = [
    (0, [3], [-0.0, 1.5, -2.25]),
    (1, [], [3.4e38]),  # a scalar: no dims, one value
    (2, [0, 4], []),  # an empty layer
    (3, [1, 2], [float("inf"), 2.0**-140]),
]


def _fragment(session: str, seq: int, layers: list[tuple[int, list[int], list[float]]]):
    return make_fragment(
        session,
        seq,
        [DweLayerDelta(i, tuple(s), np.array(v, dtype=np.float32)) for i, s, v in layers],
    )


def test_seed_vector_hash_matches_hand_computation() -> None:
    fragment = extract_delta_fragment(
        "dwe", 1, [np.ones((2, 2), np.float32)], [np.zeros((2, 2), np.float32)]
    )
    assert fragment.state_hash == _hand_hash(SEED_LAYERS)
    assert fragment.schema == DWE_SCHEMA == "axiom.dwe.v1"


@pytest.mark.parametrize(
    ("session", "seq", "layers"),
    [("dwe", 1, SEED_LAYERS), ("sessión-7", 2**64 - 1, MIXED_LAYERS)],
)
def test_encode_is_byte_identical_to_hand_bytes(session, seq, layers) -> None:
    expected = _hand_bytes(DWE_SCHEMA, session, seq, layers)
    fragment = _fragment(session, seq, layers)
    assert bytes(encode_fragment(fragment)) == expected
    assert encoded_size(fragment) == len(expected)


@pytest.mark.parametrize(
    ("session", "seq", "layers"),
    [("dwe", 1, SEED_LAYERS), ("sessión-7", 2**64 - 1, MIXED_LAYERS)],
)
def test_decode_hand_bytes(session, seq, layers) -> None:
    decoded = decode_fragment(_hand_bytes(DWE_SCHEMA, session, seq, layers))
    assert decoded.session_id == session
    assert decoded.sequence == seq
    assert decoded.hmac is None
    assert decoded.state_hash == _hand_hash(layers)
    assert [(lay.layer_index, list(lay.shape)) for lay in decoded.layers] == [
        (i, s) for i, s, _ in layers
    ]
    for layer, (_, _, values) in zip(decoded.layers, layers, strict=True):
        assert layer.values.tobytes() == b"".join(struct.pack("<f", v) for v in values)


def test_hmac_option_layout() -> None:
    plain = _hand_bytes(DWE_SCHEMA, "dwe", 1, SEED_LAYERS)
    mac = "0123456789abcdef" * 4
    signed = plain + b"\x01" + _string(mac)
    fragment = _fragment("dwe", 1, SEED_LAYERS).with_hmac(mac)
    assert bytes(encode_fragment(fragment)) == signed
    decoded = decode_fragment_signed(signed)
    assert decoded.fragment.hmac == mac
    assert bytes(decoded.signed) == plain
    assert decoded.has_hmac_field


def test_explicit_none_hmac_field() -> None:
    plain = _hand_bytes(DWE_SCHEMA, "dwe", 1, SEED_LAYERS)
    decoded = decode_fragment_signed(plain + b"\x00")
    assert decoded.fragment.hmac is None and decoded.has_hmac_field
    assert bytes(encode_fragment(decoded.fragment, hmac_field=True)) == plain + b"\x00"
    assert not decode_fragment_signed(plain).has_hmac_field


def test_frame_prefix() -> None:
    plain = _hand_bytes(DWE_SCHEMA, "dwe", 1, SEED_LAYERS)
    frame = encode_frame(_fragment("dwe", 1, SEED_LAYERS))
    assert bytes(frame) == struct.pack("<I", len(plain)) + plain


def test_decode_fragment_file_framed_and_bare() -> None:
    plain = _hand_bytes(DWE_SCHEMA, "dwe", 1, SEED_LAYERS)
    framed = struct.pack("<I", len(plain)) + plain
    assert decode_fragment_file(plain) == decode_fragment_file(framed)
    assert decode_fragment_file(framed).session_id == "dwe"
    with pytest.raises(MalformedFragment):
        decode_fragment_file(b"PAR1 not a fragment at all")


def test_sniffing_fragment_files() -> None:
    plain = _hand_bytes(DWE_SCHEMA, "dwe", 1, SEED_LAYERS)
    assert looks_like_fragment_file(plain)
    assert looks_like_fragment_file(struct.pack("<I", len(plain)) + plain)
    sliced = _hand_bytes("tensorswap.dwe.slice.v1", "dwe", 1, [(0, [4, 0], [1.0])])
    assert looks_like_fragment_file(sliced)
    for other in (b"", b"\x93NUMPY", b"ARROW1\x00\x00", _string("axiom.dwe.v2") + bytes(80)):
        assert not looks_like_fragment_file(other)


def test_values_are_zero_copy_views() -> None:
    data = bytes(encode_fragment(_fragment("dwe", 1, SEED_LAYERS)))
    decoded = decode_fragment(data)
    whole = np.frombuffer(data, dtype=np.uint8)
    assert np.shares_memory(decoded.layers[0].values, whole)
    assert not decoded.layers[0].values.flags.writeable


def test_encode_cap_checked_before_encoding() -> None:
    fragment = _fragment("dwe", 1, SEED_LAYERS)
    size = encoded_size(fragment)
    assert len(encode_fragment(fragment, max_bytes=size)) == size
    with pytest.raises(FragmentTooLarge) as info:
        encode_fragment(fragment, max_bytes=size - 1)
    assert (info.value.size, info.value.limit) == (size, size - 1)


def test_decode_cap() -> None:
    data = _hand_bytes(DWE_SCHEMA, "dwe", 1, SEED_LAYERS)
    with pytest.raises(FragmentTooLarge):
        decode_fragment(data, max_bytes=len(data) - 1)


def test_default_cap_is_8_mib() -> None:
    assert MAX_DWE_FRAGMENT_BYTES == 8 * 1024 * 1024
    assert read_frame_length(struct.pack("<I", MAX_DWE_FRAGMENT_BYTES), MAX_DWE_FRAGMENT_BYTES)
    with pytest.raises(FragmentTooLarge):
        read_frame_length(struct.pack("<I", MAX_DWE_FRAGMENT_BYTES + 1), MAX_DWE_FRAGMENT_BYTES)


def test_every_truncation_is_refused() -> None:
    data = _hand_bytes(DWE_SCHEMA, "sessión", 9, MIXED_LAYERS)
    for cut in range(len(data)):
        with pytest.raises(MalformedFragment):
            decode_fragment(data[:cut])


@pytest.mark.parametrize(
    "tail", [b"\x02", b"\x00\x00", b"\x01" + struct.pack("<Q", 99) + b"ab"], ids=str
)
def test_bad_tails_are_refused(tail: bytes) -> None:
    with pytest.raises(MalformedFragment):
        decode_fragment(_hand_bytes(DWE_SCHEMA, "dwe", 1, SEED_LAYERS) + tail)


def test_invalid_utf8_is_refused() -> None:
    data = struct.pack("<Q", 2) + b"\xff\xfe" + _hand_bytes(DWE_SCHEMA, "dwe", 1, [])[20:]
    with pytest.raises(MalformedFragment, match="UTF-8"):
        decode_fragment(data)


@pytest.mark.parametrize("field", ["layers", "shape", "values", "string"])
def test_huge_counts_refused_without_allocation(field: str) -> None:
    huge = struct.pack("<Q", 2**62)
    head = _string(DWE_SCHEMA) + _string("s") + struct.pack("<Q", 1)
    one_layer = struct.pack("<QQ", 1, 0)
    data = {
        "layers": head + huge,
        "shape": head + one_layer + struct.pack("<Q", 2**61),
        "values": head + one_layer + struct.pack("<Q", 0) + huge,
        "string": _string(DWE_SCHEMA) + huge,
    }[field] + bytes(64)
    with traced() as memory, pytest.raises(TruncatedFragment):
        decode_fragment(data)
    assert memory.peak < 64 * 1024


finite = st.floats(width=32, allow_nan=False)
layer_st = st.builds(
    lambda i, shape, fill: (i, shape, [fill[k % len(fill)] for k in range(int(np.prod(shape)))]),
    st.integers(0, 2**64 - 1),
    st.lists(st.integers(0, 3), max_size=3),
    st.lists(finite, min_size=1, max_size=5),
)


@settings(max_examples=60, deadline=None)
@given(
    session=st.text(max_size=12),
    seq=st.integers(0, 2**64 - 1),
    layers=st.lists(layer_st, max_size=4),
    mac=st.none() | st.text(alphabet="0123456789abcdef", min_size=64, max_size=64),
)
def test_round_trip_both_ways(session, seq, layers, mac) -> None:
    expected = _hand_bytes(DWE_SCHEMA, session, seq, layers)
    if mac is not None:
        expected += b"\x01" + _string(mac)
    fragment = _fragment(session, seq, layers).with_hmac(mac)
    encoded = bytes(encode_fragment(fragment))
    assert encoded == expected
    decoded = decode_fragment(encoded)
    assert decoded == fragment
    assert bytes(encode_fragment(decoded)) == expected


def test_fragment_equality_is_bitwise() -> None:
    a = _fragment("s", 1, [(0, [1], [0.0])])
    b = _fragment("s", 1, [(0, [1], [-0.0])])
    assert a != b
    assert a == DweFragment(a.schema, a.session_id, a.sequence, a.layers, a.state_hash)
