"""SecAgg+'s parameters and its messages: msgspec Structs, one per phase and direction.

The phases (Bell et al. 2020, after Bonawitz et al. 2017), server ``S``, peer ``u``::

    0 setup         S -> u  Setup(config)                  parameters, peers, graph seed
    1 advertise     u -> S  KeysAdvert                     two X25519 public keys + commitment
                    S -> u  KeysBroadcast                  the keys of u's live neighbours
    2 share         u -> S  SharesUpload                   per neighbour: AEAD(b share, sk share)
                    S -> u  SharesDelivery                 the ciphertexts addressed to u
    3 masked input  u -> S  MaskedInput                    y_u = q(x_u) + PRG(b_u) ± PRG(s_uv)
                    S -> u  UnmaskRequest                  survivors and dropped peers
    4 unmask        u -> S  UnmaskResponse                 b shares of survivors, sk of dropped

Every message names its round; peer messages name their sender. Encoded with msgpack
(``encode``/``decode``), never pickle.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import msgspec

from tensorswap.privacy.secagg.crypto import DEFAULT_PRG, PRGS
from tensorswap.privacy.secagg.errors import MalformedSecAggMessage, SecAggConfigError
from tensorswap.privacy.secagg.graph import check_degree, default_degree, neighbour_graph
from tensorswap.privacy.secagg.quantize import Quantizer, max_bits

ROUND_ID_BYTES = 16
KEY_BYTES = 32
DEFAULT_MIN_SURVIVORS = 3
"""The default floor: with 3 survivors and one malicious peer among them, the sum it sees
still mixes two honest inputs. 2 is allowed (each survivor then learns the other's input)."""


class SecAggConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Every parameter of one secure aggregation; the server announces it in ``Setup``.

    ``peers``: the sampled peer ids (sorted, distinct, >= 0); ``threshold`` t: shares
    needed to reconstruct a secret, with ``(neighbours + 1) / 2 < t <= neighbours + 1``;
    ``neighbours`` k: degree of the masking graph; ``bits``/``clip``/``max_weight``: the
    quantizer; ``dim``: the update's length in float32 values; ``graph_seed``: public seed
    of the neighbour graph; ``round_id``: 16 bytes naming the round (the HKDF salt);
    ``prg``: the stream cipher that expands mask seeds (one of ``PRGS``; no default, so a
    peer never guesses it: a config without it is refused as malformed);
    ``min_survivors``: the fewest peers whose sum may be unmasked (the floor, never below
    ``threshold``: ``floor``), so that a sum never reveals one peer's input to the others.
    """

    round_id: bytes
    peers: tuple[int, ...]
    threshold: int
    neighbours: int
    bits: int
    clip: float
    max_weight: int
    dim: int
    graph_seed: bytes
    prg: str
    min_survivors: int = DEFAULT_MIN_SURVIVORS

    @property
    def floor(self) -> int:
        """The fewest survivors a sum is unmasked over: ``max(min_survivors, threshold)``."""
        return max(self.min_survivors, self.threshold)

    def validate(self) -> None:
        """Refuse parameters that cannot run or would be unsafe (``SecAggConfigError``)."""
        n = len(self.peers)
        if len(self.round_id) != ROUND_ID_BYTES:
            raise SecAggConfigError("round_id", self.round_id.hex(), "must be 16 bytes")
        if list(self.peers) != sorted(set(self.peers)) or any(p < 0 for p in self.peers):
            raise SecAggConfigError("peers", self.peers, "must be sorted, distinct, >= 0")
        if n < 2:
            raise SecAggConfigError("peers", self.peers, "needs at least 2 peers")
        check_degree(n, self.neighbours)
        holders = self.neighbours + 1
        if not holders / 2 < self.threshold <= holders:
            raise SecAggConfigError(
                "threshold",
                self.threshold,
                f"must be in ({holders}/2, {holders}]: above half of each peer's "
                f"{holders} share holders, so no two disjoint sets can both reconstruct",
            )
        if self.dim < 1:
            raise SecAggConfigError("dim", self.dim, "must be >= 1")
        if self.prg not in PRGS:
            raise SecAggConfigError("prg", self.prg, f"must be one of {', '.join(PRGS)}")
        if len(self.graph_seed) < 16:
            raise SecAggConfigError("graph_seed", self.graph_seed.hex(), "needs >= 16 bytes")
        if isinstance(self.min_survivors, bool) or not self.min_survivors >= 2:
            raise SecAggConfigError(
                "min_survivors", self.min_survivors, "must be >= 2 (a sum of one is one input)"
            )
        if self.floor > n:
            raise SecAggConfigError(
                "min_survivors",
                self.min_survivors,
                f"the floor max(min_survivors, threshold) = {self.floor} exceeds the {n} peers: "
                f"no sum could ever be unmasked",
            )
        self.quantizer().check_capacity(n)

    def quantizer(self) -> Quantizer:
        """The quantizer these parameters name."""
        return Quantizer(clip=self.clip, bits=self.bits, max_weight=self.max_weight)

    def graph(self) -> dict[int, frozenset[int]]:
        """The neighbour graph every party derives from ``graph_seed``."""
        return neighbour_graph(self.peers, self.neighbours, self.graph_seed)

    def share_index(self, holder: int) -> int:
        """The Shamir evaluation point of ``holder``'s shares: its position + 1."""
        return self.peers.index(holder) + 1


def make_config(
    peers: Iterable[int],
    dim: int,
    *,
    threshold: int | None = None,
    neighbours: int | None = None,
    bits: int | None = None,
    clip: float = 1.0,
    max_weight: int = 1 << 16,
    round_id: bytes | None = None,
    graph_seed: bytes | None = None,
    prg: str = DEFAULT_PRG,
    min_survivors: int = DEFAULT_MIN_SURVIVORS,
) -> SecAggConfig:
    """A validated config; defaults: k = 2 ceil(log2 n), t = (k + 1) // 2 + 1, the most bits
    n peers allow (``max_bits``: 29 for 8 peers), clip 1.0, max_weight 65536, and a random
    round id and graph seed (``os.urandom``), the ``aes256-ctr`` mask PRG, a floor of 3
    survivors.
    """
    ordered = tuple(sorted(peers))
    k = default_degree(len(ordered)) if neighbours is None else neighbours
    config = SecAggConfig(
        round_id=os.urandom(ROUND_ID_BYTES) if round_id is None else round_id,
        peers=ordered,
        threshold=(k + 1) // 2 + 1 if threshold is None else threshold,
        neighbours=k,
        bits=max_bits(len(ordered)) if bits is None else bits,
        clip=float(clip),
        max_weight=max_weight,
        dim=dim,
        graph_seed=os.urandom(32) if graph_seed is None else graph_seed,
        prg=prg,
        min_survivors=min_survivors,
    )
    config.validate()
    return config


class PeerKeys(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One peer's advertised keys: encryption and masking X25519 keys, seed commitment."""

    encryption_key: bytes
    mask_key: bytes
    seed_commitment: bytes


class Setup(msgspec.Struct, frozen=True, tag=True, forbid_unknown_fields=True):
    """Phase 0, server to peer: the round's parameters."""

    config: SecAggConfig


class KeysAdvert(msgspec.Struct, frozen=True, tag=True, forbid_unknown_fields=True):
    """Phase 1, peer to server: the peer's public keys for this round."""

    round_id: bytes
    sender: int
    keys: PeerKeys


class KeysBroadcast(msgspec.Struct, frozen=True, tag=True, forbid_unknown_fields=True):
    """Phase 1, server to peer: the keys of the recipient and of its live neighbours."""

    round_id: bytes
    keys: dict[int, PeerKeys]


class SharesUpload(msgspec.Struct, frozen=True, tag=True, forbid_unknown_fields=True):
    """Phase 2, peer to server: per destination neighbour, its encrypted pair of shares."""

    round_id: bytes
    sender: int
    ciphertexts: dict[int, bytes]


class SharesDelivery(msgspec.Struct, frozen=True, tag=True, forbid_unknown_fields=True):
    """Phase 2, server to peer: the ciphertexts addressed to it, keyed by source."""

    round_id: bytes
    ciphertexts: dict[int, bytes]


class MaskedInput(msgspec.Struct, frozen=True, tag=True, forbid_unknown_fields=True):
    """Phase 3, peer to server: the masked vector, ``dim + 1`` little-endian uint32, and the
    neighbours whose share ciphertext failed for this peer (``accused``, sorted): it masked
    without them, and the server drops them."""

    round_id: bytes
    sender: int
    masked: bytes
    accused: tuple[int, ...] = ()


class UnmaskRequest(msgspec.Struct, frozen=True, tag=True, forbid_unknown_fields=True):
    """Phase 3, server to peer: who sent a masked input (survivors) and who did not."""

    round_id: bytes
    survivors: tuple[int, ...]
    dropped: tuple[int, ...]


class UnmaskResponse(msgspec.Struct, frozen=True, tag=True, forbid_unknown_fields=True):
    """Phase 4, peer to server: self-mask seed shares of survivors, mask-key shares of the
    dropped; never both for one peer.
    """

    round_id: bytes
    sender: int
    seed_shares: dict[int, bytes]
    key_shares: dict[int, bytes]


class SharePlaintext(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What one encrypted share carries (inside the AEAD)."""

    round_id: bytes
    source: int
    destination: int
    seed_share: bytes
    key_share: bytes


Message = (
    Setup
    | KeysAdvert
    | KeysBroadcast
    | SharesUpload
    | SharesDelivery
    | MaskedInput
    | UnmaskRequest
    | UnmaskResponse
)

_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[Message] = msgspec.msgpack.Decoder(Message)
_plain_decoder = msgspec.msgpack.Decoder(SharePlaintext)


def encode(message: Message | SharePlaintext) -> bytes:
    """The msgpack bytes of one message."""
    return _encoder.encode(message)


def decode(data: bytes) -> Message:
    """The message ``data`` encodes; anything else is ``MalformedSecAggMessage``."""
    try:
        return _decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise MalformedSecAggMessage(str(exc)) from exc


def decode_plaintext(data: bytes) -> SharePlaintext:
    """The share plaintext of a decrypted ciphertext."""
    try:
        return _plain_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise MalformedSecAggMessage(f"share plaintext: {exc}") from exc
