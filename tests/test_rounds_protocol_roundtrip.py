"""Every rounds request and answer kind survives encode -> decode unchanged (hypothesis),
and every request is laid out the way a server of the untyped protocol reads it."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorswap.cid import Cid, HashFunction, Multicodec
from tensorswap.rounds.protocol.codec import (
    MAX_NAME_BYTES,
    AggregatingWire,
    CollectingWire,
    CompleteWire,
    ErrorInfo,
    FailedWire,
    PendingWire,
    RoundAnswer,
    RoundCall,
    RoundRequest,
    RoundRow,
    SpecWire,
    StartRequest,
    StatusRequest,
    StatusWire,
    SubmitRequest,
    WaitRequest,
    decode_answer,
    decode_call,
    encode_answer,
    encode_call,
    layout_of,
    status_to_wire,
)

TEXT = st.characters(exclude_categories=("Cs",))  # lone surrogates are not UTF-8
INT = st.integers(-(2**63), 2**63 - 1)
FLOAT = st.floats(allow_nan=False)  # NaN != NaN; infinities travel fine
PARAM = st.one_of(INT, FLOAT, st.text(TEXT, max_size=8))


def names(min_size: int = 1) -> st.SearchStrategy[str]:
    return st.text(TEXT, min_size=min_size, max_size=12).filter(
        lambda s: len(s.encode()) <= MAX_NAME_BYTES
    )


cids = st.builds(
    Cid,
    st.sampled_from(list(Multicodec)),
    st.sampled_from(list(HashFunction)),
    st.binary(min_size=32, max_size=32),
)
specs = st.builds(
    SpecWire,
    INT,
    st.none() | INT,
    st.none() | FLOAT,
    st.text(TEXT, max_size=12),
    st.dictionaries(st.text(TEXT, max_size=8), PARAM, max_size=3),
    st.none()
    | st.lists(
        st.tuples(st.text(TEXT, max_size=6), st.text(TEXT, max_size=6), st.lists(INT, max_size=4)),
        max_size=3,
    ),
)
rounds = st.integers(0, 2**64 - 1)
requests: st.SearchStrategy[RoundRequest] = st.one_of(
    st.builds(StartRequest, round=rounds, initiator=names(), spec=specs),
    st.builds(
        lambda r, i, p, c: SubmitRequest(round=r, initiator=i, peer=p, update=c.to_bytes()),
        rounds,
        names(),
        names(),
        cids,
    ),
    st.builds(StatusRequest, round=rounds, initiator=names()),
    st.builds(StatusRequest, round=rounds, initiator=names(0), all=st.just(True)),
    st.builds(
        WaitRequest,
        round=rounds,
        initiator=names(),
        timeout=st.none() | st.floats(min_value=0, allow_infinity=False),
    ),
)
statuses: st.SearchStrategy[StatusWire] = st.one_of(
    st.just(PendingWire()),
    st.builds(CollectingWire, INT, INT),
    st.just(AggregatingWire()),
    st.builds(lambda c: CompleteWire(str(c)), cids),
    st.builds(FailedWire, st.text(TEXT, max_size=20)),
)
rows = st.builds(
    RoundRow,
    rounds,
    names(),
    statuses,
    INT,
    INT,
    INT,
    names(),
    INT,
    st.lists(names(), max_size=4),
    FLOAT,
    st.none() | FLOAT,
)
errors = st.builds(
    ErrorInfo,
    st.text(TEXT, max_size=20),
    st.text(TEXT, max_size=40),
    st.dictionaries(st.text(TEXT, max_size=8), st.none() | PARAM, max_size=4),
)
answers = st.one_of(
    st.builds(RoundAnswer, error=errors),
    st.builds(RoundAnswer, started=st.booleans(), status=st.none() | statuses),
    st.builds(RoundAnswer, status=statuses),
    st.builds(RoundAnswer, rounds=st.lists(rows, max_size=3), status=st.none() | statuses),
    st.builds(
        RoundAnswer,
        rounds=st.lists(rows, max_size=3),
        stats=st.dictionaries(st.text(TEXT, max_size=10), PARAM, max_size=5),
        omitted=st.none() | st.integers(0, 2**32),
    ),
)


@settings(max_examples=300)
@given(requests)
def test_every_request_round_trips(request: RoundRequest) -> None:
    body = encode_call(request)
    assert decode_call(body) == request
    # a server of the untyped protocol reads every key it always read
    old = msgspec.msgpack.decode(body, type=RoundCall)
    assert old == layout_of(request)
    assert list(msgspec.msgpack.decode(body)) == ["op", *RoundCall.__struct_fields__[1:]]


@settings(max_examples=300)
@given(answers)
def test_every_answer_round_trips(answer: RoundAnswer) -> None:
    assert decode_answer(encode_answer(answer)) == answer


@given(statuses)
def test_a_wire_status_round_trips_through_the_round_status(status: StatusWire) -> None:
    assert status_to_wire(status.to_status()) == status
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(status)) == status.to_dict()
