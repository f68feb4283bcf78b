"""SecAgg+'s faster paths give the same results: masks built ahead of the shares
(``SecAggClient.prepare``, with a neighbour dropping in between), either mask PRG named by
the config, masked vectors folded on arrival, the weighted mean in pieces, and the Lagrange
weights shared by a secret's chunks."""

from __future__ import annotations

import threading
from collections.abc import Collection

import numpy as np
import pytest

pytest.importorskip("cryptography")

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from tensorswap.privacy.secagg import (
    MalformedSecAggMessage,
    SecAggClient,
    SecAggConfigError,
    SecAggServer,
    crypto,
    decode,
    encode,
    make_config,
)
from tensorswap.privacy.secagg.crypto import PRGS
from tensorswap.privacy.secagg.protocol import Message, SecAggConfig, Setup
from tensorswap.privacy.secagg.quantize import MODULUS, Quantizer
from tensorswap.privacy.secagg.shamir import (
    PRIME,
    combine_shares,
    interpolate_at_zero,
    lagrange_at_zero,
    split_secret,
)

DIM = 3000


def _wire(message: Message) -> Message:
    return decode(encode(message))


class Round:
    """An in-process round whose peers may build their masked vectors ahead."""

    def __init__(self, config: SecAggConfig, *, ahead: bool) -> None:
        rng = np.random.default_rng(7)
        self.config, self.ahead = config, ahead
        self.clients = {
            p: SecAggClient(
                p, rng.normal(0, 0.3, DIM).astype(np.float32), 5 + p, rng=np.random.default_rng(p)
            )
            for p in config.peers
        }
        self.server = SecAggServer(config)
        self.outbox: dict[int, Message] = self.server.setup_messages()

    def phase(self, skip: Collection[int] = ()) -> None:
        for peer, message in sorted(self.outbox.items()):
            if peer in skip:
                continue
            client = self.clients[peer]
            reply = client.handle(_wire(message))
            if self.ahead:
                client.prepare()
            self.server.receive(_wire(reply))
        self.outbox = self.server.close_phase()

    def plain_sum(self, peers: Collection[int]) -> np.ndarray:
        total = np.zeros(DIM + 1, dtype=np.uint64)
        for p in peers:
            quantized = self.clients[p].quantized
            assert quantized is not None
            total += quantized
        return (total % MODULUS).astype(np.uint32)


@pytest.mark.parametrize("prg", PRGS)
@pytest.mark.parametrize("ahead", [False, True])
def test_masks_built_ahead_or_not_unmask_to_the_exact_sum(prg: str, ahead: bool) -> None:
    r = Round(make_config(range(8), DIM, prg=prg), ahead=ahead)
    for _ in range(4):
        r.phase()
    result = r.server.result
    assert result is not None and result.survivors == tuple(range(8))
    assert np.array_equal(result.total, r.plain_sum(range(8)))


def test_a_neighbour_dropping_after_the_keys_has_its_prepared_mask_taken_back_out() -> None:
    r = Round(make_config(range(8), DIM), ahead=True)
    r.phase()  # keys advertised
    r.phase(skip={3})  # the others prepared the pairwise masks of every advertised neighbour,
    # peer 3 among them, but it never uploads its shares: nobody may keep its mask
    r.phase()
    r.phase()
    result = r.server.result
    assert result is not None and 3 not in result.survivors and result.dropped == ()
    assert np.array_equal(result.total, r.plain_sum(result.survivors))
    for peer in result.survivors:
        assert 3 not in r.clients[peer].mask_partners


def test_prepare_in_a_thread_while_the_client_moves_on_changes_nothing() -> None:
    config = make_config(range(8), DIM)
    plain, ahead = Round(config, ahead=False), Round(config, ahead=False)
    for _ in range(4):
        for peer, message in sorted(ahead.outbox.items()):
            client = ahead.clients[peer]
            reply = client.handle(_wire(message))
            worker = threading.Thread(target=client.prepare)
            worker.start()  # races the next handle: the lock keeps one quantization
            ahead.server.receive(_wire(reply))
            worker.join()
        ahead.outbox = ahead.server.close_phase()
        plain.phase()
    assert ahead.server.result is not None and plain.server.result is not None
    # the same rounding draws (one quantization per peer), the same sum
    assert np.array_equal(ahead.server.result.total, plain.server.result.total)


def test_prepare_before_setup_or_after_the_masked_input_does_nothing() -> None:
    config = make_config(range(4), 16)
    client = SecAggClient(0, np.zeros(16, np.float32), 1)
    client.prepare()
    assert client.quantized is None
    client.handle(Setup(config=config))
    client.prepare()
    assert client.quantized is not None  # quantized and self-masked ahead


def test_an_unprepared_update_that_cannot_be_quantized_fails_in_the_masked_phase() -> None:
    config = make_config(range(4), 4)
    bad = np.array([0.0, np.nan, 0.0, 0.0], np.float32)
    client = SecAggClient(0, bad, 1)
    client.handle(Setup(config=config))
    client.prepare()  # leaves the refusal to the masked-input phase, where it always was
    assert client.quantized is None


def test_the_mask_prg_is_named_by_the_config_and_checked() -> None:
    with pytest.raises(SecAggConfigError):
        make_config(range(4), 8, prg="rc4")
    config = make_config(range(4), 8)
    assert config.prg == "aes256-ctr"
    raw = encode(Setup(config=config)).replace(b"\xa3prg\xaaaes256-ctr", b"")
    assert raw != encode(Setup(config=config))
    with pytest.raises(MalformedSecAggMessage):  # a config without its PRG is never guessed
        decode(raw)


def test_aes256_ctr_masks_are_the_aes_keystream_little_endian() -> None:
    seed = bytes(range(32))
    stream = Cipher(algorithms.AES256(seed), modes.CTR(bytes(16))).encryptor()
    want = np.frombuffer(stream.update(bytes(4 * 100)), dtype="<u4")
    np.testing.assert_array_equal(crypto.expand_mask(seed, 100, "aes256-ctr"), want)
    np.testing.assert_array_equal(crypto.expand_mask(seed, 100), want)
    assert not np.array_equal(crypto.expand_mask(seed, 100, "chacha20"), want)
    with pytest.raises(ValueError):
        crypto.keystream(seed, "rc4")


def test_the_weighted_mean_in_pieces_is_the_whole_array_arithmetic() -> None:
    q = Quantizer(0.5, 28, 1000)
    total = np.random.default_rng(0).integers(0, 1 << 32, 2 * 65536 + 5, dtype=np.uint64)
    total = total.astype(np.uint32)
    total[-1] = 800
    values, weight = q.dequantize_sum(total, 8)
    want = (values * (q.max_weight / weight)).astype(np.float32)
    np.testing.assert_array_equal(q.weighted_mean(total, 8), want)


def test_shared_lagrange_weights_interpolate_like_the_textbook_formula() -> None:
    points = [(1, 5), (3, 11), (4, 99)]
    total = 0
    for i, (xi, yi) in enumerate(points):
        num = den = 1
        for j, (xj, _) in enumerate(points):
            if j != i:
                num, den = num * -xj % PRIME, den * (xi - xj) % PRIME
        total = (total + yi * num * pow(den, PRIME - 2, PRIME)) % PRIME
    assert interpolate_at_zero(points) == total
    assert len(lagrange_at_zero([1, 3, 4])) == 3
    secret = bytes(range(40))  # three chunks: one set of weights serves them all
    shares = split_secret(secret, 3, [2, 5, 9, 11])
    assert combine_shares([shares[2], shares[9], shares[11]], 3) == secret


def test_a_secure_peers_flat_delta_read_from_its_store_is_flatten_delta() -> None:
    from tensorswap.privacy.delta import flat_delta_from_store
    from tensorswap.runs.secure_peer import flatten_delta
    from tensorswap.store import MemoryStore, ModelUpdate, put_update

    store = MemoryStore()
    rng = np.random.default_rng(4)
    base = {"w": rng.standard_normal((600, 1000), dtype=np.float32), "b": np.ones(5, np.float32)}
    cid = put_update(store, ModelUpdate(base), chunk_bytes=1 << 20)  # several chunks
    model = {"b": base["b"] * 2, "w": base["w"] - np.float32(0.5)}
    got = flat_delta_from_store(store, cid, model)
    assert got is not None and got.dtype == np.float32
    np.testing.assert_array_equal(got, flatten_delta(model, base))  # the base's order
    assert flat_delta_from_store(store, cid, {"w": model["w"]}) is None  # names differ
    assert flat_delta_from_store(store, cid, {**model, "b": np.ones(6, np.float32)}) is None
