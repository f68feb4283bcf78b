"""SecAgg+ as a library: Shamir, quantization, the neighbour graph, and the protocol's
client and server state machines run in-process (dropouts, tampering, replays, a
malicious server, and per-peer work growing with k rather than n).
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("cryptography")

from helpers.secagg import DIM, Round
from tensorswap.errors import TensorSwapError
from tensorswap.privacy.secagg import (
    ConflictingUnmaskRequest,
    DuplicateShareIndex,
    ForeignRound,
    MalformedSecAggMessage,
    MalformedShare,
    NotEnoughShares,
    OutOfPhase,
    QuantizationError,
    Quantizer,
    ReconstructionMismatch,
    ReplayedMessage,
    SecAggConfigError,
    SecAggError,
    SecAggServer,
    ServerPhase,
    ShareDecryptionFailed,
    TooFewShares,
    TooFewSurvivors,
    UnknownParticipant,
    crypto,
    decode,
    encode,
    make_config,
)
from tensorswap.privacy.secagg.graph import default_degree, neighbour_graph
from tensorswap.privacy.secagg.protocol import (
    KeysAdvert,
    MaskedInput,
    PeerKeys,
    SharesDelivery,
    SharesUpload,
    UnmaskRequest,
    UnmaskResponse,
)
from tensorswap.privacy.secagg.quantize import MODULUS, max_bits
from tensorswap.privacy.secagg.shamir import (
    PRIME,
    combine_shares,
    interpolate_at_zero,
    split_secret,
)

# ── Shamir ───────────────────────────────────────────────────────────────────


def _fixed(*coefficients: int) -> Callable[[int], int]:
    it = iter(coefficients)
    return lambda bound: next(it)


def _share(index: int, length: int, *elements: int) -> bytes:
    return struct.pack(">HB", index, length) + b"".join(e.to_bytes(16, "big") for e in elements)


def test_shamir_matches_a_hand_computed_polynomial() -> None:
    # secret 0x0102 = 258, f(x) = 258 + 5x + 7x^2: f(1)=270, f(2)=296, f(3)=336, f(4)=390.
    shares = split_secret(b"\x01\x02", 3, [1, 2, 3, 4], randbelow=_fixed(5, 7))
    assert shares == {
        1: _share(1, 2, 270),
        2: _share(2, 2, 296),
        3: _share(3, 2, 336),
        4: _share(4, 2, 390),
    }
    for subset in itertools.combinations(shares.values(), 3):
        assert combine_shares(subset, 3) == b"\x01\x02"


def test_shamir_vector_that_wraps_the_prime() -> None:
    # secret 0, f(x) = 0 + (p - 1) x = -x mod p: f(1) = p - 1, f(2) = p - 2.
    shares = split_secret(b"\x00", 2, [1, 2], randbelow=_fixed(PRIME - 1))
    assert shares == {1: _share(1, 1, PRIME - 1), 2: _share(2, 1, PRIME - 2)}
    assert combine_shares(shares.values(), 2) == b"\x00"


def test_shamir_any_t_of_n_recover_a_32_byte_secret_and_t_minus_1_do_not() -> None:
    secret = bytes(range(7, 39))
    shares = split_secret(secret, 4, range(1, 8))
    for subset in itertools.combinations(shares.values(), 4):
        assert combine_shares(subset, 4) == secret
    few = list(shares.values())[:3]
    with pytest.raises(NotEnoughShares) as info:
        combine_shares(few, 4)
    assert (info.value.have, info.value.need) == (3, 4)
    # Interpolating t - 1 points (no threshold check) gives a value unrelated to the secret.
    first_chunk = int.from_bytes(secret[:15], "big")
    points = [(i, int.from_bytes(s[3:19], "big")) for i, s in list(shares.items())[:3]]
    assert interpolate_at_zero(points) != first_chunk


def test_shamir_t_minus_1_shares_fit_every_secret() -> None:
    # Perfect secrecy, constructively: for two shares of a 3-of-n sharing, every candidate
    # secret s' has coefficients that produce exactly these two shares.
    shares = split_secret(b"\x2a", 3, [1, 2, 3])
    y1, y2 = (int.from_bytes(shares[x][3:], "big") for x in (1, 2))
    half = pow(2, -1, PRIME)
    for candidate in (0, 1, 42, 255):
        a2 = (y2 - 2 * y1 + candidate) * half % PRIME
        a1 = (y1 - candidate - a2) % PRIME
        forged = split_secret(bytes([candidate]), 3, [1, 2, 3], randbelow=_fixed(a1, a2))
        assert (forged[1], forged[2]) == (shares[1], shares[2])
        assert combine_shares(forged.values(), 3) == bytes([candidate])


@settings(max_examples=40, deadline=None)
@given(
    secret=st.binary(min_size=1, max_size=64),
    n=st.integers(2, 9),
    data=st.data(),
)
def test_shamir_round_trips_any_secret_from_any_t_shares(
    secret: bytes, n: int, data: st.DataObject
) -> None:
    t = data.draw(st.integers(1, n))
    indices = data.draw(st.lists(st.integers(1, 0xFFFF), min_size=n, max_size=n, unique=True))
    shares = split_secret(secret, t, indices)
    chosen = data.draw(st.permutations(list(shares.values())))[:t]
    assert combine_shares(chosen, t) == secret


def test_shamir_refuses_duplicated_indices_and_malformed_shares() -> None:
    shares = split_secret(b"secret", 2, [1, 2, 3])
    with pytest.raises(DuplicateShareIndex):
        combine_shares([shares[1], shares[1]], 2)
    with pytest.raises(DuplicateShareIndex):
        split_secret(b"secret", 2, [1, 2, 2])
    with pytest.raises(MalformedShare):
        combine_shares([shares[1][:-1], shares[2]], 2)
    with pytest.raises(MalformedShare):
        combine_shares([_share(1, 1, PRIME), shares[2]], 2)
    with pytest.raises(SecAggConfigError):
        split_secret(b"secret", 4, [1, 2, 3])


# ── quantization ─────────────────────────────────────────────────────────────


def test_quantize_error_is_below_one_step_and_the_weight_rides_last() -> None:
    q = Quantizer(clip=1.0, bits=12, max_weight=100)
    x = np.linspace(-1.5, 1.5, 1001, dtype=np.float32)
    words = q.quantize(x, 40, np.random.default_rng(1))
    assert words.dtype == np.uint32 and words.size == x.size + 1
    assert words[-1] == 40 and int(words[:-1].max()) <= q.levels
    values, weight = q.dequantize_sum(words, 1)
    expected = np.clip(x.astype(np.float64), -1, 1) * 0.4
    assert weight == 40
    assert np.all(np.abs(values - expected) < q.step)


def test_quantize_is_unbiased() -> None:
    q = Quantizer(clip=1.0, bits=3, max_weight=1)
    x = np.full(40_000, 0.3, dtype=np.float32)  # between two levels of a coarse grid
    values, _ = q.dequantize_sum(q.quantize(x, 1, np.random.default_rng(7)), 1)
    assert len(set(np.round(values, 9))) == 2  # rounded down or up, never elsewhere
    # The mean of 40k draws is within 5 standard errors (step/2 / 200) of the value.
    assert abs(values.mean() - 0.3) < 5 * (q.step / 2) / 200


def test_quantizer_refuses_inputs_and_capacities_that_would_wrap() -> None:
    q = Quantizer(clip=1.0, bits=29, max_weight=10)
    q.check_capacity(8)
    with pytest.raises(SecAggConfigError, match="wrap"):
        q.check_capacity(9)
    with pytest.raises(SecAggConfigError, match="max_weight"):
        Quantizer(clip=1.0, bits=8, max_weight=1 << 31).check_capacity(2)
    assert max_bits(8) == 29 and max_bits(9) == 28 and MODULUS > 9 * (2**28 - 1)
    rng = np.random.default_rng(0)
    with pytest.raises(QuantizationError):
        q.quantize(np.zeros(3, dtype=np.float64), 1, rng)
    with pytest.raises(QuantizationError):
        q.quantize(np.array([np.nan], dtype=np.float32), 1, rng)
    with pytest.raises(QuantizationError):
        q.quantize(np.zeros(3, dtype=np.float32), 11, rng)
    with pytest.raises(SecAggConfigError):
        Quantizer(clip=0.0, bits=8, max_weight=1)


# ── the neighbour graph ──────────────────────────────────────────────────────


@pytest.mark.parametrize(("n", "k"), [(8, 6), (16, 8), (32, 10), (9, 8), (10, 3), (5, 4)])
def test_graph_is_k_regular_symmetric_and_seeded(n: int, k: int) -> None:
    graph = neighbour_graph(range(n), k, b"seed" * 4)
    assert all(len(v) == k and p not in v for p, v in graph.items())
    assert all(p in graph[q] for p, v in graph.items() for q in v)
    assert graph == neighbour_graph(list(reversed(range(n))), k, b"seed" * 4)


def test_graph_depends_on_the_seed_and_degree_grows_with_log_n() -> None:
    assert neighbour_graph(range(32), 4, b"a" * 16) != neighbour_graph(range(32), 4, b"b" * 16)
    assert [default_degree(n) for n in (2, 4, 8, 16, 32, 1024)] == [1, 3, 6, 8, 10, 20]
    with pytest.raises(SecAggConfigError):
        neighbour_graph(range(9), 3, b"a" * 16)  # no 3-regular graph on 9 vertices


# ── the protocol ─────────────────────────────────────────────────────────────


def test_unmasked_sum_equals_the_plain_sum_of_the_quantized_inputs() -> None:
    r = Round(make_config(range(8), DIM))
    r.run()
    result = r.server.result
    assert result is not None and r.server.phase is ServerPhase.DONE
    assert result.survivors == tuple(range(8)) and result.dropped == ()
    assert np.array_equal(result.total, r.plain_sum(range(8)))
    assert result.weight_sum == sum(w for _, w in r.updates.values())
    q = r.config.quantizer()
    bound = 8 * q.step * q.max_weight / result.weight_sum
    assert np.max(np.abs(result.mean - r.fedavg(range(8)))) < bound + 1e-6  # float32 output


def test_two_of_eight_dropping_before_their_masked_input_leaves_the_six_survivors_sum() -> None:
    r = Round(make_config(range(8), DIM))
    r.run(drop_masked={2, 5})
    result = r.server.result
    assert result is not None
    survivors = [0, 1, 3, 4, 6, 7]
    assert result.survivors == tuple(survivors) and result.dropped == (2, 5)
    assert np.array_equal(result.total, r.plain_sum(survivors))
    assert np.allclose(result.mean, r.fedavg(survivors), atol=1e-4)


def test_peers_vanishing_after_their_masked_input_are_recovered_from_the_shares() -> None:
    r = Round(make_config(range(8), DIM))
    r.run(drop_unmask={2, 5})
    result = r.server.result
    assert result is not None and result.survivors == tuple(range(8))
    assert np.array_equal(result.total, r.plain_sum(range(8)))


def test_no_masked_vector_equals_or_decodes_to_its_peers_input() -> None:
    r = Round(make_config(range(8), DIM))
    r.run()
    q = r.config.quantizer()
    for peer, sent in r.sent.items():
        masked = next(m for m in sent if isinstance(m, MaskedInput))
        words = np.frombuffer(masked.masked, dtype="<u4")
        quantized = r.clients[peer].quantized
        assert quantized is not None
        assert np.count_nonzero(words == quantized) <= 1
        # Read as a quantized vector, the masked words are uniform noise, not the update.
        values, weight = q.dequantize_sum(words.astype(np.uint32), 1)
        assert weight != r.updates[peer][1]
        assert np.mean(np.abs(values * q.max_weight / r.updates[peer][1])) > 1.0


def test_below_threshold_the_round_fails_with_a_clear_reason() -> None:
    r = Round(make_config(range(8), DIM))  # t = 4
    r.phase()
    r.phase()
    with pytest.raises(TooFewSurvivors) as info:
        r.phase(skip={0, 1, 2, 3, 4})
    assert (info.value.survivors, info.value.threshold) == (3, 4)
    assert "threshold is 4" in str(info.value)
    assert r.server.phase is ServerPhase.FAILED and r.server.result is None


def test_a_peer_whose_share_holders_vanished_fails_the_round_by_name() -> None:
    r = Round(make_config(range(16), DIM, neighbours=4))  # 5 holders each, t = 3
    victim = 0
    a, b, *_ = sorted(r.server.graph[victim])
    r.phase()
    r.phase()
    r.phase()
    with pytest.raises(TooFewShares) as info:
        r.phase(skip={victim, a, b})
    assert (info.value.owner, info.value.have, info.value.need) == (victim, 2, 3)


def test_a_tampered_or_swapped_share_is_reported_not_fatal() -> None:
    """A ciphertext that does not open (flipped bit, or another route's ciphertext: the route
    is bound as associated data) is the sender's fault: the recipient masks without it and
    accuses it in its masked input, instead of aborting (see test_privacy_secagg_malicious)."""
    r = Round(make_config(range(8), DIM))
    r.phase()
    r.phase()
    target = 3
    delivery = r.outbox[target]
    assert isinstance(delivery, SharesDelivery)
    source, blob = next(iter(delivery.ciphertexts.items()))
    flipped = blob[:-1] + bytes([blob[-1] ^ 1])
    tampered = SharesDelivery(
        round_id=delivery.round_id, ciphertexts={**delivery.ciphertexts, source: flipped}
    )
    reply = r.clients[target].handle(tampered)
    assert isinstance(reply, MaskedInput) and reply.accused == (source,)
    failure = r.clients[target].accusations[source]
    assert isinstance(failure, ShareDecryptionFailed)
    assert (failure.source, failure.destination) == (source, target)
    assert source not in r.clients[target].mask_partners
    other = r.outbox[target + 1]
    assert isinstance(other, SharesDelivery)
    s1, s2 = list(other.ciphertexts)[:2]
    swapped = {**other.ciphertexts, s1: other.ciphertexts[s2], s2: other.ciphertexts[s1]}
    reply = r.clients[target + 1].handle(
        SharesDelivery(round_id=other.round_id, ciphertexts=swapped)
    )
    assert isinstance(reply, MaskedInput) and reply.accused == tuple(sorted((s1, s2)))


def test_corrupted_unmask_shares_are_caught_by_the_commitments() -> None:
    r = Round(make_config(range(8), DIM))
    r.phase()
    r.phase()
    r.phase()
    for peer, message in sorted(r.outbox.items()):
        reply = r.clients[peer].handle(message)
        assert isinstance(reply, UnmaskResponse)
        if peer == 0:
            owner, share = next(iter(reply.seed_shares.items()))
            bad = share[:-1] + bytes([share[-1] ^ 1])
            reply = UnmaskResponse(
                round_id=reply.round_id,
                sender=0,
                seed_shares={**reply.seed_shares, owner: bad},
                key_shares=reply.key_shares,
            )
        r.server.receive(reply)
    with pytest.raises(ReconstructionMismatch):
        r.server.close_phase()


def test_replayed_and_out_of_phase_messages_are_refused() -> None:
    r = Round(make_config(range(8), DIM))
    advert = r.clients[0].handle(r.outbox[0])
    r.server.receive(advert)
    with pytest.raises(ReplayedMessage):
        r.server.receive(advert)
    with pytest.raises(OutOfPhase):
        r.server.receive(MaskedInput(round_id=r.config.round_id, sender=1, masked=b""))
    with pytest.raises(ReplayedMessage):
        r.clients[0].handle(r.outbox[0])
    with pytest.raises(OutOfPhase):
        r.clients[1].handle(UnmaskRequest(round_id=r.config.round_id, survivors=(), dropped=()))
    other = make_config(range(8), DIM)
    foreign = r.clients[2].handle(SecAggServer(other).setup_messages()[2])
    assert isinstance(foreign, KeysAdvert)
    with pytest.raises(ForeignRound):
        r.server.receive(foreign)
    with pytest.raises(MalformedSecAggMessage):
        decode(b"\x93not a message")


def test_a_server_asking_for_both_shares_of_one_peer_is_refused() -> None:
    r = Round(make_config(range(8), DIM))
    r.phase()
    r.phase()
    r.phase()
    rid = r.config.round_id
    greedy = UnmaskRequest(round_id=rid, survivors=tuple(range(8)), dropped=(3,))
    with pytest.raises(ConflictingUnmaskRequest) as info:
        r.clients[0].handle(greedy)
    assert info.value.peers == (3,)
    # Asking in two requests does not work either: a peer answers one unmask request only.
    honest = r.outbox[1]
    r.clients[1].handle(honest)
    second = UnmaskRequest(
        round_id=rid, survivors=tuple(p for p in range(8) if p != 3), dropped=(3,)
    )
    with pytest.raises(ReplayedMessage):
        r.clients[1].handle(second)


def test_the_server_refuses_malformed_peer_messages() -> None:
    r = Round(make_config(range(8), DIM))
    rid = r.config.round_id
    bad_keys = PeerKeys(encryption_key=b"short", mask_key=bytes(32), seed_commitment=bytes(32))
    with pytest.raises(MalformedSecAggMessage):
        r.server.receive(KeysAdvert(round_id=rid, sender=0, keys=bad_keys))
    with pytest.raises(UnknownParticipant):
        r.server.receive(KeysAdvert(round_id=rid, sender=99, keys=bad_keys))
    r.phase()
    peer = 0
    upload = r.clients[peer].handle(r.outbox[peer])
    assert isinstance(upload, SharesUpload)
    partial = dict(list(upload.ciphertexts.items())[1:])  # one live neighbour left out
    with pytest.raises(UnknownParticipant):
        r.server.receive(SharesUpload(round_id=rid, sender=peer, ciphertexts=partial))


@settings(max_examples=30, deadline=None)
@given(
    sender=st.integers(0, 2**32),
    shares=st.dictionaries(st.integers(0, 64), st.binary(max_size=40), max_size=5),
)
def test_messages_round_trip_through_msgpack(sender: int, shares: dict[int, bytes]) -> None:
    rid = bytes(range(16))
    for message in (
        UnmaskResponse(round_id=rid, sender=sender, seed_shares=shares, key_shares={}),
        SharesDelivery(round_id=rid, ciphertexts=shares),
        UnmaskRequest(round_id=rid, survivors=tuple(shares), dropped=()),
    ):
        assert decode(encode(message)) == message


def test_unsafe_thresholds_are_refused() -> None:
    with pytest.raises(SecAggConfigError, match="threshold"):
        make_config(range(8), DIM, threshold=3)  # k = 6: 7 holders, t must exceed 3.5
    with pytest.raises(SecAggConfigError, match="threshold"):
        make_config(range(8), DIM, threshold=8)


@pytest.mark.parametrize("neighbours", [None, 4])
def test_per_peer_work_grows_with_k_not_n(neighbours: int | None) -> None:
    per_n: dict[int, tuple[int, int, int, int]] = {}
    for n in (8, 16, 32):
        r = Round(make_config(range(n), 16, neighbours=neighbours))
        r.run()
        k = r.config.neighbours
        for peer, sent in r.sent.items():
            upload, unmask = sent[1], sent[3]
            assert len(upload.ciphertexts) == k  # type: ignore[union-attr]
            assert len(r.clients[peer].mask_partners) == k
            assert len(unmask.seed_shares) == k + 1  # type: ignore[union-attr]
        peer0 = r.sent[0]
        per_n[n] = (k, len(peer0), len(encode(peer0[1])), len(r.clients[0].mask_partners))
    ks = [per_n[n][0] for n in (8, 16, 32)]
    if neighbours is None:
        assert ks == [6, 8, 10]  # 2 ceil(log2 n): +2 per doubling of n
    else:
        # Fixed k: a peer's messages, shares, masks and upload bytes do not change with n.
        assert len(set(per_n.values())) == 1, per_n


def test_every_secagg_error_is_a_tensorswap_error() -> None:
    assert issubclass(SecAggError, TensorSwapError)
    for cls in (TooFewSurvivors, ConflictingUnmaskRequest, ShareDecryptionFailed, NotEnoughShares):
        assert issubclass(cls, SecAggError)


@pytest.mark.parametrize("length", [1, 7, crypto.MASK_CHUNK, 2 * crypto.MASK_CHUNK + 3])
def test_apply_masks_streams_the_same_words_as_expand_mask(length: int) -> None:
    rng = np.random.default_rng(length)
    base = rng.integers(0, 1 << 32, length, dtype=np.uint64).astype(np.uint32)
    seeds = [(bytes([i]) * 32, 1 if i % 2 else -1) for i in range(4)]
    want = base.copy()
    for seed, sign in seeds:
        if sign > 0:
            want += crypto.expand_mask(seed, length)
        else:
            want -= crypto.expand_mask(seed, length)
    got = base.copy()
    crypto.apply_masks(got, seeds)
    np.testing.assert_array_equal(got, want)
    fill, words = crypto.mask_stream(seeds[0][0]), np.empty(length, np.uint32)
    fill(words[: length // 2])
    fill(words[length // 2 :])
    np.testing.assert_array_equal(words, crypto.expand_mask(seeds[0][0], length))
