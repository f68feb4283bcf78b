"""Verification: state hash recompute, HMAC-SHA256 with key rotation, per-session sequences."""

from __future__ import annotations

import hashlib
import hmac
import struct

import numpy as np
import pytest

from tensorswap.delta import (
    SLICE_SCHEMA,
    DweFragment,
    DweLayerDelta,
    FleetKeys,
    FragmentVerifier,
    GapPolicy,
    HmacMismatch,
    InvalidLayout,
    KeyUsed,
    RejectReason,
    SequenceRejected,
    SequenceTracker,
    StateHashMismatch,
    StateMismatch,
    UnknownSchema,
    apply_fragment,
    decode_fragment_signed,
    encode_fragment,
    extract_delta_fragment,
    fragment_hmac,
    make_fragment,
    sign_fragment,
)

KEY = b"fleet-key-2024"
OLD_KEY = b"fleet-key-2023"


def _fragment(seq: int = 1, session: str = "s") -> DweFragment:
    return extract_delta_fragment(
        session, seq, [np.arange(4, dtype=np.float32).reshape(2, 2)], [np.zeros((2, 2))]
    )


def test_hmac_is_over_the_unsigned_bincode() -> None:
    fragment = _fragment()
    unsigned = bytes(encode_fragment(fragment))
    expected = hmac.new(KEY, unsigned, hashlib.sha256).hexdigest()
    assert fragment_hmac(fragment, KEY) == expected
    signed = sign_fragment(fragment, KEY)
    assert bytes(encode_fragment(signed)) == unsigned + b"\x01" + struct.pack("<Q", 64) + (
        expected.encode()
    )


def test_valid_signed_fragment_passes_with_current_key() -> None:
    decoded = decode_fragment_signed(encode_fragment(sign_fragment(_fragment(), KEY)))
    verifier = FragmentVerifier(keys=FleetKeys(KEY, OLD_KEY))
    assert verifier.verify(decoded.fragment, decoded.signed) is KeyUsed.CURRENT


def test_previous_key_accepted_during_rotation() -> None:
    fragment = sign_fragment(_fragment(), OLD_KEY)
    assert FragmentVerifier(keys=FleetKeys(KEY, OLD_KEY)).verify(fragment) is KeyUsed.PREVIOUS
    with pytest.raises(HmacMismatch) as info:
        FragmentVerifier(keys=FleetKeys(KEY)).verify(fragment)
    assert info.value.reason is RejectReason.HMAC_MISMATCH


def test_wrong_and_missing_hmac_rejected() -> None:
    verifier = FragmentVerifier(keys=FleetKeys(KEY))
    with pytest.raises(HmacMismatch) as wrong:
        verifier.verify(sign_fragment(_fragment(), b"intruder"))
    assert wrong.value.reason is RejectReason.HMAC_MISMATCH
    with pytest.raises(HmacMismatch) as missing:
        verifier.verify(_fragment())
    assert missing.value.reason is RejectReason.HMAC_MISSING
    lenient = FragmentVerifier(keys=FleetKeys(KEY), require_hmac=False)
    assert lenient.verify(_fragment()) is KeyUsed.NONE


def test_hmac_covers_the_sequence() -> None:
    signed = sign_fragment(_fragment(seq=1), KEY)
    moved = DweFragment(
        signed.schema, signed.session_id, 2, signed.layers, signed.state_hash, signed.hmac
    )
    with pytest.raises(HmacMismatch):
        FragmentVerifier(keys=FleetKeys(KEY)).verify(moved)


def test_flipped_value_byte_fails_the_state_hash() -> None:
    data = bytearray(encode_fragment(_fragment()))
    value_start = len(data) - (8 + 64) - 16  # last four f32 values precede the hash string
    data[value_start + 5] ^= 0x01
    decoded = decode_fragment_signed(bytes(data))
    with pytest.raises(StateHashMismatch) as info:
        FragmentVerifier().verify(decoded.fragment, decoded.signed)
    assert info.value.reason is RejectReason.STATE_HASH
    assert info.value.expected == _fragment().state_hash


def test_wrong_state_hash_rejected() -> None:
    fragment = _fragment()
    forged = DweFragment(fragment.schema, "s", 1, fragment.layers, "0" * 64)
    with pytest.raises(StateHashMismatch):
        FragmentVerifier().verify(forged)


def test_unknown_schema_rejected() -> None:
    fragment = make_fragment("s", 1, _fragment().layers, schema="axiom.dwe.v9")
    with pytest.raises(UnknownSchema):
        FragmentVerifier().verify(fragment)


@pytest.mark.parametrize(
    ("schema", "shape", "count", "reason"),
    [
        ("axiom.dwe.v1", (2, 3), 5, RejectReason.LAYOUT),
        (SLICE_SCHEMA, (4, 3), 2, RejectReason.LAYOUT),  # [offset 3, +2) beyond 4 values
        (SLICE_SCHEMA, (), 1, RejectReason.LAYOUT),
    ],
)
def test_inconsistent_layers_rejected(schema, shape, count, reason) -> None:
    layer = DweLayerDelta(0, shape, np.zeros(count, np.float32))
    with pytest.raises(InvalidLayout) as info:
        FragmentVerifier().verify(make_fragment("s", 1, [layer], schema=schema))
    assert info.value.reason is reason


# About what one 8 MiB frame can carry: 10**6 dims. Their exact product is a big int whose
# computation grows quadratically (minutes); checking the layout must stay linear.
MANY_HUGE_DIMS = (2**64 - 1,) * 200_000


@pytest.mark.timeout(10)
def test_a_shape_of_many_huge_dims_is_refused_quickly() -> None:
    layer = DweLayerDelta(0, MANY_HUGE_DIMS, np.zeros(1, np.float32))
    with pytest.raises(InvalidLayout) as info:
        FragmentVerifier().verify(make_fragment("s", 1, [layer]))
    assert info.value.reason is RejectReason.LAYOUT
    assert "200000 dims" in str(info.value) and len(str(info.value)) < 1000


@pytest.mark.timeout(10)
def test_a_slice_of_a_shape_of_many_huge_dims_is_checked_quickly() -> None:
    layer = DweLayerDelta(0, (*MANY_HUGE_DIMS, 0), np.zeros(1, np.float32))
    fragment = make_fragment("s", 1, [layer], schema=SLICE_SCHEMA)
    assert FragmentVerifier().verify(fragment) is KeyUsed.NONE  # in bounds of that shape
    with pytest.raises(StateMismatch):
        apply_fragment([np.zeros(1, np.float32)], fragment)


def test_non_finite_values_rejected_unless_allowed() -> None:
    layer = DweLayerDelta(0, (2,), np.array([1.0, np.nan], np.float32))
    fragment = make_fragment("s", 1, [layer])
    with pytest.raises(InvalidLayout) as info:
        FragmentVerifier().verify(fragment)
    assert info.value.reason is RejectReason.NON_FINITE
    assert FragmentVerifier(require_finite=False).verify(fragment) is KeyUsed.NONE


def test_replay_and_stale_rejected_after_commit() -> None:
    verifier = FragmentVerifier()
    verifier.verify(_fragment(5))
    verifier.commit(_fragment(5))
    with pytest.raises(SequenceRejected) as replay:
        verifier.verify(_fragment(5))
    assert replay.value.reason is RejectReason.REPLAY and replay.value.last == 5
    with pytest.raises(SequenceRejected) as stale:
        verifier.verify(_fragment(4))
    assert stale.value.reason is RejectReason.STALE
    verifier.verify(_fragment(5, session="other"))  # sessions are independent


def test_verify_without_commit_does_not_consume_the_sequence() -> None:
    verifier = FragmentVerifier()
    verifier.verify(_fragment(1))
    verifier.verify(_fragment(1))
    assert verifier.tracker.last("s") is None


def test_gap_policy() -> None:
    accept = SequenceTracker()
    accept.commit("s", 1)
    assert accept.check("s", 4) == 2
    assert accept.commit("s", 4) == 2
    strict = SequenceTracker(GapPolicy.REJECT)
    strict.commit("s", 1)
    strict.check("s", 2)
    with pytest.raises(SequenceRejected) as info:
        strict.check("s", 3)
    assert info.value.reason is RejectReason.GAP


def test_tracker_forgets_least_recent_sessions_beyond_its_bound() -> None:
    tracker = SequenceTracker(max_sessions=2)
    tracker.commit("a", 1)
    tracker.commit("b", 1)
    tracker.commit("a", 2)
    tracker.commit("c", 1)  # evicts b, the least recently accepted
    assert tracker.last("b") is None and tracker.last("a") == 2
    assert tracker.evicted == 1


def test_fleet_keys_never_print_material() -> None:
    assert "fleet" not in repr(FleetKeys(KEY, OLD_KEY))
    with pytest.raises(ValueError):
        FleetKeys(b"")
