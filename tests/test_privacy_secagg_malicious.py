"""SecAgg+ against a malicious peer: a share ciphertext that does not open implicates its
sender (the recipient carries on, the sender is dropped, whatever order the messages come
in), and no sum is unmasked over fewer survivors than the floor, so one peer cannot expose
another's input by making it abort (the probe of issue 23: 3 peers, quorum 0.6)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

pytest.importorskip("cryptography")

from helpers.secagg import DIM, Round
from tensorswap.privacy.secagg import (
    BelowSurvivorFloor,
    SecAggConfigError,
    ServerPhase,
    TooFewSurvivors,
    UnknownParticipant,
    make_config,
)
from tensorswap.privacy.secagg.protocol import (
    MaskedInput,
    Message,
    SharesDelivery,
    SharesUpload,
    UnmaskRequest,
    UnmaskResponse,
)


def _flip(blob: bytes) -> bytes:
    return blob[:-1] + bytes([blob[-1] ^ 1])


def _tamper_upload(attacker: int, victims: set[int] | None = None):  # type: ignore[no-untyped-def]
    """``alter`` for Round.phase: ``attacker``'s share upload with the ciphertexts to
    ``victims`` (all, when None) corrupted."""

    def alter(peer: int, reply: Message) -> Message:
        if peer != attacker or not isinstance(reply, SharesUpload):
            return reply
        bad = {
            d: _flip(c) if victims is None or d in victims else c
            for d, c in reply.ciphertexts.items()
        }
        return msgspec.structs.replace(reply, ciphertexts=bad)

    return alter


def test_the_probe_one_bad_share_among_three_peers_unmasks_nothing() -> None:
    """Before: peer 1 aborted on peer 0's bad ciphertext; the survivors were the attacker
    and peer 2, and the released sum minus the attacker's own input was peer 2's input.
    Now peer 1 carries on and accuses 0; 0 is dropped; two survivors are below the floor of
    three, so the round fails typed and no unmask request is ever sent."""
    r = Round(make_config(range(3), DIM))
    r.phase()
    r.phase(alter=_tamper_upload(0, {1}))
    with pytest.raises(BelowSurvivorFloor) as info:
        r.phase()  # masked inputs: 1 accuses 0
    assert (info.value.survivors, info.value.threshold) == (2, 3)
    assert info.value.implicated == {0: (1,)}
    assert "peer 0 dropped" in str(info.value)
    assert r.server.phase is ServerPhase.FAILED and r.server.result is None
    assert not any(isinstance(m, UnmaskResponse) for sent in r.sent.values() for m in sent)
    accusation = r.sent[1][-1]
    assert isinstance(accusation, MaskedInput) and accusation.accused == (0,)


@pytest.mark.parametrize("order", ["attacker first", "attacker last", "interleaved"])
@pytest.mark.parametrize("how", ["tampered", "swapped"])
def test_the_accused_sender_is_dropped_and_the_honest_sum_is_exact(order: str, how: str) -> None:
    """Whatever order the masked inputs arrive in, an accused sender's vector never enters
    the sum, its neighbours' masks with it are removed, and every honest peer survives."""
    r = Round(make_config(range(8), DIM))
    r.phase()
    attacker = 5
    neighbours = sorted(r.server.graph[attacker])
    v1, v2 = neighbours[:2]
    if how == "tampered":
        alter = _tamper_upload(attacker)
        accusers = set(neighbours)
    else:  # v1 gets the ciphertext meant for v2 and the other way round

        def alter(peer: int, reply: Message) -> Message:
            if peer != attacker or not isinstance(reply, SharesUpload):
                return reply
            c = reply.ciphertexts
            return msgspec.structs.replace(reply, ciphertexts={**c, v1: c[v2], v2: c[v1]})

        accusers = {v1, v2}
    r.phase(alter=alter)
    honest = [p for p in range(8) if p != attacker]
    orders = {
        "attacker first": [attacker, *honest],
        "attacker last": [*honest, attacker],
        "interleaved": [honest[0], attacker, *honest[1:]],
    }
    r.phase(order=orders[order])
    assert all(isinstance(m, UnmaskRequest) for m in r.outbox.values())
    assert attacker not in r.outbox  # it is no survivor: it is asked for nothing
    r.phase()
    result = r.server.result
    assert result is not None
    assert result.survivors == tuple(honest) and result.dropped == (attacker,)
    assert result.implicated == {attacker: tuple(sorted(accusers))}
    assert np.array_equal(result.total, r.plain_sum(honest))  # bit for bit
    for peer in accusers:
        assert r.clients[peer].mask_partners == r.server.graph[peer] - {attacker}


def test_a_false_accusation_drops_an_honest_peer_without_exposing_it() -> None:
    """A malicious peer that claims an honest neighbour's shares failed (and masks without
    it, so the sum stays right) gets that neighbour dropped: the honest peer's masked vector
    never enters the sum and no survivor reveals a share of its self-mask seed, so its input
    stays hidden behind PRG(b). The rest is unmasked exactly."""
    r = Round(make_config(range(8), DIM))
    r.phase()
    r.phase()
    liar = 2
    victim = sorted(r.server.graph[liar])[0]
    delivery = r.outbox[liar]
    assert isinstance(delivery, SharesDelivery)
    forged = {**delivery.ciphertexts, victim: _flip(delivery.ciphertexts[victim])}
    r.outbox[liar] = SharesDelivery(delivery.round_id, forged)  # what the liar pretends
    r.phase()
    r.phase()
    result = r.server.result
    assert result is not None and result.dropped == (victim,)
    survivors = [p for p in range(8) if p != victim]
    assert np.array_equal(result.total, r.plain_sum(survivors))
    responses = [m for sent in r.sent.values() for m in sent if isinstance(m, UnmaskResponse)]
    assert responses and all(victim not in m.seed_shares for m in responses)


def test_an_accusation_of_a_stranger_or_a_repeat_is_refused_and_changes_nothing() -> None:
    r = Round(make_config(range(8), DIM))
    r.phase()
    r.phase()
    peer = 0
    reply = r.clients[peer].handle(r.outbox[peer])
    assert isinstance(reply, MaskedInput)
    stranger = min(set(range(8)) - r.server.graph[peer] - {peer})
    neighbour = min(r.server.graph[peer])
    for accused in ((stranger,), (neighbour, neighbour), (peer,)):
        with pytest.raises(UnknownParticipant):
            r.server.receive(msgspec.structs.replace(reply, accused=accused))
    assert r.server.implicated == {}
    r.server.receive(reply)  # the honest message is still taken


def test_peers_refuse_to_unmask_a_sum_below_the_floor() -> None:
    """A coordinator that asks for the unmask shares of a sum over too few survivors (here
    two: each could read the other's input from it) is refused by every peer."""
    r = Round(make_config(range(8), DIM))
    r.run()
    fresh = Round(make_config(range(8), DIM))
    fresh.phase()
    fresh.phase()
    fresh.phase()
    request = UnmaskRequest(fresh.config.round_id, survivors=(0, 1), dropped=())
    with pytest.raises(BelowSurvivorFloor):
        fresh.clients[0].handle(request)


def test_the_floor_is_checked_in_the_config() -> None:
    assert make_config(range(8), DIM).floor == 4  # the threshold (t = 4 for k = 6) is higher
    assert make_config(range(3), DIM).floor == 3
    assert make_config(range(8), DIM, min_survivors=6).floor == 6
    with pytest.raises(SecAggConfigError, match="min_survivors"):
        make_config(range(8), DIM, min_survivors=1)
    with pytest.raises(SecAggConfigError, match="exceeds the 2 peers"):
        make_config(range(2), DIM)  # the default floor of 3 could never be met
    assert make_config(range(2), DIM, min_survivors=2).floor == 2  # opted in
    assert issubclass(BelowSurvivorFloor, TooFewSurvivors)
