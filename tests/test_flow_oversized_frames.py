"""A flow frame of far more JSON values than any valid message is refused without building them."""

from __future__ import annotations

import pytest

from helpers.memory import peak_of
from tensorswap.flow import GradientBatch, decode
from tensorswap.flow.errors import MalformedMessage, WireVersionError


# ── flow: a well-formed frame with far more JSON values than any valid message ───────────────
def _embedding(count: int, envelope: bool) -> bytes:
    body = (
        b'{"Embeddings":{"batch_id":1,"embedding":['
        + b"0," * (count - 1)
        + b'0],"sequence_length":1,"session_id":null}}'
    )
    return b'{"payload":' + body + b',"wire_version":1}' if envelope else body


def _many_members(count: int, envelope: bool) -> bytes:
    members = b",".join(b'"k%07d":0' % i for i in range(count))
    if envelope:
        return b'{"wire_version":1,"payload":{"Loss":0.5,' + members + b"}}"
    return b"{" + members + b"}"


@pytest.mark.parametrize("envelope", [True, False], ids=["envelope", "bare"])
@pytest.mark.parametrize(
    "frame",
    [lambda e: _embedding(2_000_000, e), lambda e: _many_members(600_000, e)],
    ids=["floats", "members"],
)
def test_a_frame_of_millions_of_values_is_refused_without_building_them(
    frame: object, envelope: bool
) -> None:
    # Each ``0,`` used to become a 32-byte Python float (and each ``"k":0,`` a key and a Raw)
    # before validation counted them: 16x the frame and more (305 MB for 15 MiB of floats).
    data = frame(envelope)  # type: ignore[operator]
    for document in (data, data.decode()):
        error, peak = peak_of(decode, document)
        assert isinstance(error, MalformedMessage), error
        assert "JSON values" in str(error)
        assert peak < len(data) // 2


def test_the_version_is_still_checked_before_a_big_payload() -> None:
    data = b'{"wire_version":2,"payload":{"Loss":0.5,' + b'"k":0,' * 600_000 + b'"z":0}}'
    with pytest.raises(WireVersionError):
        decode(data)
    with pytest.raises(MalformedMessage, match="missing payload"):
        decode(b'{"wire_version":1,"x":[' + b"0," * 600_000 + b"0]}")


def test_commas_inside_strings_do_not_count_against_a_valid_message() -> None:
    # 600 rows whose layer ids are 1,000 commas each: 600,000 commas, all inside strings.
    rows = ",".join(
        '{"gradients":[0.5],"layer_id":"' + "," * 1000 + f'{i:04d}"}}' for i in range(600)
    )
    data = '{"payload":{"GradientUpdate":{"batch_id":1,"gradients":[' + rows
    data += '],"session_id":"s"}},"wire_version":1}'
    for document in (data, data.encode()):
        message = decode(document)
        assert isinstance(message, GradientBatch)
        assert len(message.gradients) == 600
