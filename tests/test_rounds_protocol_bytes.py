"""The rounds protocol's bytes: every request and answer kind encodes to the bytes the
protocol had before it was typed (captured from that code), and decodes back to itself."""

from __future__ import annotations

import msgspec
import pytest

from tensorswap.cid import Cid
from tensorswap.rounds.core import (
    Aggregating,
    Collecting,
    Complete,
    DuplicateContribution,
    Failed,
    InvalidRoundSpec,
    LayerSpec,
    Pending,
    RoundId,
    RoundInfo,
    RoundSpec,
    RoundStatus,
    RoundTimeout,
    UnknownUpdate,
)
from tensorswap.rounds.protocol.codec import (
    RoundAnswer,
    RoundCall,
    RoundRequest,
    StartRequest,
    StatusRequest,
    SubmitRequest,
    WaitRequest,
    decode_answer,
    decode_call,
    encode_answer,
    encode_call,
    error_info,
    layout_of,
    row_of,
    spec_to_wire,
    status_to_wire,
)
from tensorswap.rounds.protocol.messages import _StatusWire

CID = Cid.of(b"tensorswap golden update")
AGG = Cid.of(b"tensorswap golden aggregate")
RID = RoundId(7, "lead")
FULL = RoundSpec(
    4,
    quorum=3,
    timeout_s=120.0,
    strategy="trimmed_mean",
    params={"trim_fraction": 0.25, "trim_count": 1, "dtype": "float64"},
    layout=(LayerSpec("w", "float32", (4, 3)), LayerSpec("b", "float32", (3,))),
)

# Captured with the untyped protocol (RoundCall / RoundAnswer with dict statuses), before
# these messages were typed: msgpack maps, hex.
GOLDEN_CALLS = {
    "start_minimal": (
        "88a26f70a57374617274a5726f756e6407a9696e69746961746f72a46c656164a470656572a0a4737065"
        "6386ae65787065637465645f706565727302a671756f72756d02a974696d656f75745f73c0a873747261"
        "74656779a6666564617667a6706172616d7380a66c61796f7574c0a774696d656f7574c0a3616c6cc2a6"
        "757064617465c0"
    ),
    "start_full": (
        "88a26f70a57374617274a5726f756e6407a9696e69746961746f72a46c656164a470656572a0a4737065"
        "6386ae65787065637465645f706565727304a671756f72756d03a974696d656f75745f73cb405e000000"
        "000000a87374726174656779ac7472696d6d65645f6d65616ea6706172616d7383ad7472696d5f667261"
        "6374696f6ecb3fd0000000000000aa7472696d5f636f756e7401a56474797065a7666c6f61743634a66c"
        "61796f75749293a177a7666c6f6174333292040393a162a7666c6f617433329103a774696d656f7574c0"
        "a3616c6cc2a6757064617465c0"
    ),
    "submit": (
        "88a26f70a67375626d6974a5726f756e6407a9696e69746961746f72a46c656164a470656572a6736974"
        "652d33a473706563c0a774696d656f7574c0a3616c6cc2a6757064617465c42401551e2006828549a4eb"
        "10058806a1446a684e8212922f4df6dbd60cb57c24b9f9c3552c"
    ),
    "status": (
        "88a26f70a6737461747573a5726f756e6407a9696e69746961746f72a46c656164a470656572a0a47370"
        "6563c0a774696d656f7574c0a3616c6cc2a6757064617465c0"
    ),
    "status_all": (
        "88a26f70a6737461747573a5726f756e6400a9696e69746961746f72a0a470656572a0a473706563c0a7"
        "74696d656f7574c0a3616c6cc3a6757064617465c0"
    ),
    "wait": (
        "88a26f70a477616974a5726f756e6407a9696e69746961746f72a46c656164a470656572a0a473706563"
        "c0a774696d656f7574cb4004000000000000a3616c6cc2a6757064617465c0"
    ),
    "wait_forever": (
        "88a26f70a477616974a5726f756e6407a9696e69746961746f72a46c656164a470656572a0a473706563"
        "c0a774696d656f7574c0a3616c6cc2a6757064617465c0"
    ),
}

GOLDEN_ANSWERS = {
    "started": (
        "86a56572726f72c0a773746172746564c3a673746174757381a6737461747573a750656e64696e67a672"
        "6f756e6473c0a57374617473c0a76f6d6974746564c0"
    ),
    "joined": (
        "86a56572726f72c0a773746172746564c2a673746174757383a6737461747573aa436f6c6c656374696e"
        "67a8726563656976656401a8657870656374656404a6726f756e6473c0a57374617473c0a76f6d697474"
        "6564c0"
    ),
    "submitted": (
        "86a56572726f72c0a773746172746564c0a673746174757383a6737461747573aa436f6c6c656374696e"
        "67a8726563656976656402a8657870656374656404a6726f756e6473c0a57374617473c0a76f6d697474"
        "6564c0"
    ),
    "aggregating": (
        "86a56572726f72c0a773746172746564c0a673746174757381a6737461747573ab416767726567617469"
        "6e67a6726f756e6473c0a57374617473c0a76f6d6974746564c0"
    ),
    "complete": (
        "86a56572726f72c0a773746172746564c0a673746174757382a6737461747573a8436f6d706c657465a3"
        "636964d93b6261666b7234696576746d7a78727876376773666f6232363461773767613632676b6b676d"
        "6f6873377570356875366364357775726d35686e7561a6726f756e6473c0a57374617473c0a76f6d6974"
        "746564c0"
    ),
    "failed": (
        "86a56572726f72c0a773746172746564c0a673746174757382a6737461747573a64661696c6564a67265"
        "61736f6eb574696d656f75743a2031206f662034207065657273a6726f756e6473c0a57374617473c0a7"
        "6f6d6974746564c0"
    ),
    "status_one": (
        "86a56572726f72c0a773746172746564c0a673746174757383a6737461747573aa436f6c6c656374696e"
        "67a8726563656976656402a8657870656374656404a6726f756e6473918ba5726f756e6407a9696e6974"
        "6961746f72a46c656164a673746174757383a6737461747573aa436f6c6c656374696e67a87265636569"
        "76656402a8657870656374656404a8726563656976656402a8657870656374656404a671756f72756d03"
        "a87374726174656779ac7472696d6d65645f6d65616ea66e6279746573cd1000a5706565727392a161a1"
        "62aa637265617465645f6174cb41d954fc40100000a8646561646c696e65cb41d954fc5e200000a57374"
        "617473c0a76f6d6974746564c0"
    ),
    "status_all": (
        "86a56572726f72c0a773746172746564c0a6737461747573c0a6726f756e6473928ba5726f756e6407a9"
        "696e69746961746f72a46c656164a673746174757382a6737461747573a8436f6d706c657465a3636964"
        "d93b6261666b7234696576746d7a78727876376773666f6232363461773767613632676b6b676d6f6873"
        "377570356875366364357775726d35686e7561a8726563656976656402a8657870656374656404a67175"
        "6f72756d03a87374726174656779ac7472696d6d65645f6d65616ea66e6279746573cd1000a570656572"
        "7392a161a162aa637265617465645f6174cb41d954fc40100000a8646561646c696e65c08ba5726f756e"
        "6407a9696e69746961746f72a46c656164a673746174757381a6737461747573a750656e64696e67a872"
        "6563656976656400a8657870656374656404a671756f72756d03a87374726174656779ac7472696d6d65"
        "645f6d65616ea66e6279746573cd1000a5706565727390aa637265617465645f6174cb41d954fc401000"
        "00a8646561646c696e65cb41d954fc5e200000a5737461747389ad636f6e747269627574696f6e7302a8"
        "72656a656374656400b86c6173745f6167677265676174696f6e5f7365636f6e6473cb3fc00000000000"
        "00a862797465735f696ecd3039a962797465735f6f7574cd02a6ab636f6e6e656374696f6e7303b06f70"
        "656e5f636f6e6e656374696f6e7301ad626c6f636b735f73746f72656409ad626c6f636b735f73657276"
        "656404a76f6d6974746564c0"
    ),
    "status_trimmed": (
        "86a56572726f72c0a773746172746564c0a6737461747573c0a6726f756e6473918ba5726f756e6407a9"
        "696e69746961746f72a46c656164a673746174757382a6737461747573a64661696c6564a6726561736f"
        "6ea4676f6e65a8726563656976656402a8657870656374656404a671756f72756d03a873747261746567"
        "79ac7472696d6d65645f6d65616ea66e6279746573cd1000a5706565727392a161a162aa637265617465"
        "645f6174cb41d954fc40100000a8646561646c696e65cb41d954fc5e200000a5737461747389ad636f6e"
        "747269627574696f6e7302a872656a656374656400b86c6173745f6167677265676174696f6e5f736563"
        "6f6e6473cb3fc0000000000000a862797465735f696ecd3039a962797465735f6f7574cd02a6ab636f6e"
        "6e656374696f6e7303b06f70656e5f636f6e6e656374696f6e7301ad626c6f636b735f73746f72656409"
        "ad626c6f636b735f73657276656404a76f6d697474656403"
    ),
    "refused_duplicate": (
        "86a56572726f7283a4636f6465b54475706c6963617465436f6e747269627574696f6ea76d6573736167"
        "65d931706565722027736974652d332720616c726561647920636f6e747269627574656420746f20726f"
        "756e6420372d6c656164a5666163747382a36b6579a6372d6c656164a470656572a6736974652d33a773"
        "746172746564c0a6737461747573c0a6726f756e6473c0a57374617473c0a76f6d6974746564c0"
    ),
    "refused_timeout": (
        "86a56572726f7283a4636f6465ac526f756e6454696d656f7574a76d657373616765d937726f756e6420"
        "372d6c656164206e6f742066696e697368656420616674657220333030207320287374617475733a2050"
        "656e64696e6729a5666163747383a36b6579a6372d6c656164a774696d656f7574cb4072c00000000000"
        "a6737461747573a750656e64696e67a773746172746564c0a6737461747573c0a6726f756e6473c0a573"
        "74617473c0a76f6d6974746564c0"
    ),
    "refused_unknown": (
        "86a56572726f7283a4636f6465ad556e6b6e6f776e557064617465a76d657373616765d9827570646174"
        "65206261666b7234696167716b6375746a686c63616379716276626972766771747563636b6a63367470"
        "7733706c617a6e6c34657334377471327666712066726f6d20706565722027612720666f7220726f756e"
        "6420372d6c656164206973206e6f7420696e207468652073746f72653a206c61636b7320626c6f636ba5"
        "666163747384a36b6579a6372d6c656164a470656572a161a3636964d93b6261666b7234696167716b63"
        "75746a686c63616379716276626972766771747563636b6a633674707733706c617a6e6c346573343774"
        "7132766671a664657461696cab6c61636b7320626c6f636ba773746172746564c0a6737461747573c0a6"
        "726f756e6473c0a57374617473c0a76f6d6974746564c0"
    ),
    "refused_spec": (
        "86a56572726f7283a4636f6465b0496e76616c6964526f756e6453706563a76d657373616765d9267175"
        "6f72756d206d75737420626520616e20696e7420696e205b312c20325d2c20676f742033a56661637473"
        "80a773746172746564c0a6737461747573c0a6726f756e6473c0a57374617473c0a76f6d6974746564c0"
    ),
}


def _calls() -> dict[str, RoundRequest]:
    rid = {"round": RID.round, "initiator": RID.initiator}
    return {
        "start_minimal": StartRequest(**rid, spec=spec_to_wire(RoundSpec(2))),
        "start_full": StartRequest(**rid, spec=spec_to_wire(FULL)),
        "submit": SubmitRequest.of(RID, "site-3", CID),
        "status": StatusRequest(**rid),
        "status_all": StatusRequest(all=True),
        "wait": WaitRequest(**rid, timeout=2.5),
        "wait_forever": WaitRequest(**rid, timeout=None),
    }


def _info(
    status: RoundStatus, peers: tuple[str, ...] = ("a", "b"), deadline: float | None = 1.7e9 + 120.5
) -> RoundInfo:
    return RoundInfo(RID, FULL, status, peers, 4096, 1700000000.25, deadline, FULL.layout)


STATS: dict[str, float | int | str] = {
    "contributions": 2,
    "rejected": 0,
    "last_aggregation_seconds": 0.125,
    "bytes_in": 12345,
    "bytes_out": 678,
    "connections": 3,
    "open_connections": 1,
    "blocks_stored": 9,
    "blocks_served": 4,
}


def _answers() -> dict[str, RoundAnswer]:
    def wired(status: RoundStatus) -> RoundAnswer:
        return RoundAnswer(status=status_to_wire(status))

    key = RID.as_key()
    return {
        "started": RoundAnswer(started=True, status=status_to_wire(Pending())),
        "joined": RoundAnswer(started=False, status=status_to_wire(Collecting(1, 4))),
        "submitted": wired(Collecting(2, 4)),
        "aggregating": wired(Aggregating()),
        "complete": wired(Complete(str(AGG))),
        "failed": wired(Failed("timeout: 1 of 4 peers")),
        "status_one": RoundAnswer(
            rounds=[row_of(_info(Collecting(2, 4)))], status=status_to_wire(Collecting(2, 4))
        ),
        "status_all": RoundAnswer(
            rounds=[
                row_of(_info(Complete(str(AGG)), deadline=None)),
                row_of(_info(Pending(), peers=())),
            ],
            stats=STATS,
        ),
        "status_trimmed": RoundAnswer(
            rounds=[row_of(_info(Failed("gone")))], stats=STATS, omitted=3
        ),
        "refused_duplicate": RoundAnswer(error=error_info(DuplicateContribution(key, "site-3"))),
        "refused_timeout": RoundAnswer(error=error_info(RoundTimeout(key, 300.0, "Pending"))),
        "refused_unknown": RoundAnswer(
            error=error_info(UnknownUpdate(key, "a", str(CID), "lacks block"))
        ),
        "refused_spec": RoundAnswer(
            error=error_info(InvalidRoundSpec("quorum must be an int in [1, 2], got 3"))
        ),
    }


def test_every_kind_has_a_golden() -> None:
    assert _calls().keys() == GOLDEN_CALLS.keys()
    assert _answers().keys() == GOLDEN_ANSWERS.keys()
    ops = {layout_of(call).op for call in _calls().values()}
    assert ops == {"start", "submit", "status", "wait"}


@pytest.mark.parametrize("name", sorted(GOLDEN_CALLS))
def test_a_request_keeps_its_bytes(name: str) -> None:
    call, golden = _calls()[name], bytes.fromhex(GOLDEN_CALLS[name])
    assert encode_call(call) == golden
    assert decode_call(golden) == call


@pytest.mark.parametrize("name", sorted(GOLDEN_CALLS))
def test_the_untyped_layout_encodes_the_same_bytes(name: str) -> None:
    call = _calls()[name]
    assert encode_call(layout_of(call)) == bytes.fromhex(GOLDEN_CALLS[name])
    assert isinstance(layout_of(call), RoundCall)


@pytest.mark.parametrize("name", sorted(GOLDEN_ANSWERS))
def test_an_answer_keeps_its_bytes(name: str) -> None:
    answer, golden = _answers()[name], bytes.fromhex(GOLDEN_ANSWERS[name])
    assert encode_answer(answer) == golden
    assert decode_answer(golden) == answer


def test_a_submit_decodes_into_a_cid() -> None:
    call = decode_call(bytes.fromhex(GOLDEN_CALLS["submit"]))
    assert isinstance(call, SubmitRequest)
    assert call.cid == CID and call.round_id == RID and call.peer == "site-3"


def test_statuses_decode_into_round_statuses() -> None:
    for name, status in [
        ("started", Pending()),
        ("submitted", Collecting(2, 4)),
        ("aggregating", Aggregating()),
        ("complete", Complete(str(AGG))),
        ("failed", Failed("timeout: 1 of 4 peers")),
    ]:
        wire = decode_answer(bytes.fromhex(GOLDEN_ANSWERS[name])).status
        assert wire is not None and wire.to_status() == status
        assert wire["status"] == status.name and wire.to_dict() == status.to_dict()


def test_an_optional_status_field_changes_no_bytes_until_it_is_set() -> None:
    """Aggregating gained ``reason`` (a transient failure being retried): the bytes of an
    Aggregating without one are today's, and one with a reason decodes to it."""
    golden = bytes.fromhex(GOLDEN_ANSWERS["aggregating"])
    assert encode_answer(RoundAnswer(status=status_to_wire(Aggregating()))) == golden
    why = "retrying in 0.5 s after attempt 1 failed: No space left on device"
    with_reason = encode_answer(RoundAnswer(status=status_to_wire(Aggregating(why))))
    decoded = decode_answer(with_reason).status
    assert decoded is not None and decoded.to_status() == Aggregating(why)

    class OlderAggregating(_StatusWire, frozen=True, tag="Aggregating"):
        model = Aggregating

    older = msgspec.msgpack.decode(with_reason, type=dict)  # a reader without the field
    assert older["status"]["status"] == "Aggregating"
    assert msgspec.convert(older["status"], OlderAggregating) == OlderAggregating()
