"""Hostile rounds messages decode to typed errors: a wrong or missing tag, bad CID bytes,
oversized or empty names, bad round ids and timeouts, bad statuses; never an uncaught one."""

from __future__ import annotations

import math
from typing import Any

import msgspec
import pytest

from tensorswap.cid import Cid
from tensorswap.rounds.protocol.codec import (
    MAX_NAME_BYTES,
    RoundAnswer,
    StartRequest,
    StatusRequest,
    SubmitRequest,
    WaitRequest,
    decode_answer,
    decode_call,
)
from tensorswap.wire.errors import ProtocolViolation

CID = Cid.of(b"update")
GOOD_SUBMIT = {
    "op": "submit",
    "round": 1,
    "initiator": "lead",
    "peer": "a",
    "update": CID.to_bytes(),
}


def body(**fields: Any) -> bytes:
    return msgspec.msgpack.encode(fields)


def submit(**changes: Any) -> bytes:
    return body(**{**GOOD_SUBMIT, **changes})


@pytest.mark.parametrize(
    ("message", "match"),
    [
        (body(op="nope", round=1, initiator="lead"), "Invalid value 'nope'"),
        (body(op=3, round=1, initiator="lead"), "Expected `str`, got `int`"),
        (body(round=1, initiator="lead"), "missing required field `op`"),
        (body(op="Start", round=1, initiator="lead"), "Invalid value 'Start'"),
        (b"\x93\x01\x02\x03", "Expected `object`, got `array`"),
        (b"\xc1", "bad rounds request"),
        (b"", "bad rounds request"),
    ],
)
def test_a_wrong_or_missing_op_is_a_protocol_violation(message: bytes, match: str) -> None:
    with pytest.raises(ProtocolViolation, match=match):
        decode_call(message)


@pytest.mark.parametrize(
    "update",
    [
        b"\x01",
        b"",
        b"\x12\x20" + bytes(32),  # CIDv0
        CID.to_bytes()[:-1],
        CID.to_bytes() + b"\x00",
        b"\x02" + CID.to_bytes()[1:],  # version 2
        str(CID),  # the string form where the binary one belongs
        None,
        7,
    ],
)
def test_a_bad_update_cid_is_a_protocol_violation(update: object) -> None:
    with pytest.raises(ProtocolViolation, match="bad rounds request"):
        decode_call(submit(update=update))


def test_a_submit_without_an_update_is_a_protocol_violation() -> None:
    fields = dict(GOOD_SUBMIT)
    del fields["update"]
    with pytest.raises(ProtocolViolation, match="missing required field `update`"):
        decode_call(body(**fields))


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"initiator": "x" * (MAX_NAME_BYTES + 1)}, "initiator is 257 bytes"),
        ({"initiator": "é" * (MAX_NAME_BYTES // 2 + 1)}, "initiator is 258 bytes"),
        ({"initiator": ""}, "bad round id"),
        ({"round": -1}, "bad round id"),
        ({"round": True}, "Expected `int`, got `bool`"),
        ({"peer": "p" * (MAX_NAME_BYTES + 1)}, "peer name is 257 bytes"),
        ({"peer": ""}, "peer name is 0 bytes"),
        ({"peer": b"a"}, "Expected `str`, got `bytes`"),
    ],
)
def test_bad_names_and_round_ids_are_protocol_violations(
    changes: dict[str, Any], match: str
) -> None:
    with pytest.raises(ProtocolViolation, match=match):
        decode_call(submit(**changes))


def test_names_of_exactly_the_limit_are_accepted() -> None:
    name = "é" * (MAX_NAME_BYTES // 2)
    call = decode_call(submit(initiator=name, peer=name))
    assert isinstance(call, SubmitRequest) and call.peer == name and call.cid == CID


@pytest.mark.parametrize("timeout", [math.nan, math.inf, -math.inf, -1.0, "1", True])
def test_a_bad_wait_timeout_is_a_protocol_violation(timeout: object) -> None:
    with pytest.raises(ProtocolViolation, match="bad rounds request"):
        decode_call(body(op="wait", round=1, initiator="lead", timeout=timeout))


def test_a_wait_timeout_of_zero_or_nil_is_accepted() -> None:
    for timeout in (0, 0.0, None, 2**40):
        call = decode_call(body(op="wait", round=1, initiator="lead", timeout=timeout))
        assert call == WaitRequest(round=1, initiator="lead", timeout=timeout)


@pytest.mark.parametrize(
    "spec", [None, 3, "spec", {"quorum": 1}, {"expected_peers": "2"}, {"expected_peers": 2.5}]
)
def test_a_start_without_a_usable_spec_is_a_protocol_violation(spec: object) -> None:
    with pytest.raises(ProtocolViolation, match="bad rounds request"):
        decode_call(body(op="start", round=1, initiator="lead", spec=spec))


def test_status_of_every_round_needs_no_round_id() -> None:
    assert decode_call(body(op="status", round=0, initiator="", all=True)) == StatusRequest(
        all=True
    )
    with pytest.raises(ProtocolViolation, match="bad round id"):
        decode_call(body(op="status", round=0, initiator="", all=False))


def test_unknown_keys_and_other_ops_keys_are_ignored() -> None:
    call = decode_call(
        body(
            op="start",
            round=1,
            initiator="lead",
            spec={"expected_peers": 2, "new": [1]},
            update=b"not a cid",
            timeout="later",
            future={"x": 1},
        )
    )
    assert isinstance(call, StartRequest) and call.spec.expected_peers == 2


def test_building_a_bad_request_locally_raises_value_error() -> None:
    with pytest.raises(ValueError, match="invalid CID"):
        SubmitRequest(round=1, initiator="lead", peer="a", update=b"\x01")
    with pytest.raises(ValueError, match="peer name"):
        SubmitRequest.of(StatusRequest(round=1, initiator="x").round_id, "", CID)
    with pytest.raises(ValueError, match="wait timeout"):
        WaitRequest(round=1, initiator="lead", timeout=math.nan)


# ── answers ──────────────────────────────────────────────────────────────────
def answer(**fields: Any) -> bytes:
    base: dict[str, Any] = dict.fromkeys(RoundAnswer.__struct_fields__)
    return body(**{**base, **fields})


ROW = {
    "round": 1,
    "initiator": "lead",
    "received": 0,
    "expected": 2,
    "quorum": 2,
    "strategy": "fedavg",
    "nbytes": 0,
    "peers": [],
    "created_at": 0.0,
    "deadline": None,
}


@pytest.mark.parametrize(
    ("status", "match"),
    [
        ({"status": "Cancelled"}, "Invalid value 'Cancelled'"),
        ({"state": "Pending"}, "missing required field `status`"),
        ({"status": "Complete", "cid": "not-a-cid"}, "invalid CID"),
        ({"status": "Complete", "cid": CID.to_bytes()}, "Expected `str`, got `bytes`"),
        ({"status": "Complete"}, "missing required field `cid`"),
        ({"status": "Collecting", "received": True, "expected": 2}, "got `bool`"),
        ({"status": "Failed", "reason": None}, "Expected `str`, got `None`"),
        ("Pending", "got `str`"),
    ],
)
def test_a_bad_status_in_an_answer_is_a_protocol_violation(status: object, match: str) -> None:
    with pytest.raises(ProtocolViolation, match=match):
        decode_answer(answer(status=status))
    with pytest.raises(ProtocolViolation, match="bad rounds answer"):
        decode_answer(answer(rounds=[{**ROW, "status": status}]))


def test_a_status_with_an_unknown_key_decodes() -> None:
    got = decode_answer(answer(status={"status": "Aggregating", "x": 1}))
    assert got.status is not None and got.status.to_dict() == {"status": "Aggregating"}


def test_a_bad_error_in_an_answer_is_a_protocol_violation() -> None:
    for error in (
        {"code": 1, "message": "m"},
        {"code": "X"},
        {"code": "X", "message": "m", "facts": {"k": [1]}},
    ):
        with pytest.raises(ProtocolViolation, match="bad rounds answer"):
            decode_answer(answer(error=error))
