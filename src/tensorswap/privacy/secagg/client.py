"""The peer's side of SecAgg+ as a pure state machine: one ``handle`` per server message.

The client never touches the network: the caller hands it each server message and sends
what it returns. It refuses, with typed errors, any message its phase does not take
(``OutOfPhase``), a repeat of one it already handled (``ReplayedMessage``), another round's
message (``ForeignRound``) and an unmask request that asks for both shares of one peer
(``ConflictingUnmaskRequest``) or unmasks a sum of fewer peers than the config's floor
(``TooFewSurvivors``). A share ciphertext that fails (tampered, swapped, misaddressed) is
the sender's fault: the peer masks without that sender and accuses it in its masked input,
so one peer cannot make another abort. It answers at most one unmask request, so no
sequence of requests can extract both shares either.
"""

from __future__ import annotations

import enum
import hashlib
import os
import threading

import numpy as np

from tensorswap.privacy.secagg import crypto
from tensorswap.privacy.secagg.errors import (
    BelowSurvivorFloor,
    ConflictingUnmaskRequest,
    ForeignRound,
    KeyAdvertRejected,
    MalformedSecAggMessage,
    OutOfPhase,
    QuantizationError,
    ReplayedMessage,
    SecAggError,
    ShareDecryptionFailed,
    ShareMisaddressed,
    TooFewSurvivors,
    UnknownParticipant,
)
from tensorswap.privacy.secagg.protocol import (
    KeysAdvert,
    KeysBroadcast,
    MaskedInput,
    Message,
    PeerKeys,
    SecAggConfig,
    Setup,
    SharePlaintext,
    SharesDelivery,
    SharesUpload,
    UnmaskRequest,
    UnmaskResponse,
    decode_plaintext,
    encode,
)
from tensorswap.privacy.secagg.shamir import split_secret


def seed_commitment(round_id: bytes, peer: int, seed: bytes) -> bytes:
    """SHA-256 commitment to a 32-byte self-mask seed (hiding: the seed is uniform)."""
    return hashlib.sha256(
        b"tensorswap secagg+ seed" + round_id + peer.to_bytes(8, "big") + seed
    ).digest()


def self_mask_key(seed: bytes, round_id: bytes) -> bytes:
    """The PRG key of the self mask PRG(b) of the self-mask seed ``b``."""
    return crypto.derive(seed, round_id=round_id, info=crypto.INFO_SELF_MASK)


def self_mask(
    seed: bytes, round_id: bytes, length: int, prg: str = crypto.DEFAULT_PRG
) -> np.ndarray:
    """PRG(b): the self mask of ``length`` words from the self-mask seed."""
    return crypto.expand_mask(self_mask_key(seed, round_id), length, prg)


def pair_sign(owner: int, other: int) -> int:
    """+1 if ``owner`` adds the pairwise mask it shares with ``other``, -1 if it subtracts."""
    return 1 if owner < other else -1


class ClientPhase(enum.Enum):
    """Where a peer stands; each phase takes exactly one kind of server message."""

    SETUP = "setup"
    ADVERTISED = "advertised"
    SHARED = "shared"
    MASKED = "masked"
    DONE = "done"
    FAILED = "failed"


_EXPECTS: dict[ClientPhase, type] = {
    ClientPhase.SETUP: Setup,
    ClientPhase.ADVERTISED: KeysBroadcast,
    ClientPhase.SHARED: SharesDelivery,
    ClientPhase.MASKED: UnmaskRequest,
}


class SecAggClient:
    """One peer's run of one secure aggregation of ``update`` (float32, 1-D) with ``weight``.

    The input may come later (``update`` None, then ``provide`` before the shares arrive): a
    peer then runs the key phases, and builds its masks, while it trains."""

    def __init__(
        self,
        peer_id: int,
        update: np.ndarray | None = None,
        weight: int = 1,
        *,
        rng: np.random.Generator | None = None,
    ) -> None:
        self.peer_id = peer_id
        self.phase = ClientPhase.SETUP
        self._update = update
        self._weight = weight
        self._rng = (
            rng if rng is not None else np.random.default_rng(int.from_bytes(os.urandom(16)))
        )
        self._handled: set[type] = set()
        self._config: SecAggConfig | None = None
        self._enc_sk, self._enc_pk = crypto.generate_keypair()
        self._mask_sk, self._mask_pk = crypto.generate_keypair()
        self._seed = os.urandom(32)
        self._keys: dict[int, PeerKeys] = {}
        self._seed_shares: dict[int, bytes] = {}
        self._key_shares: dict[int, bytes] = {}
        self.mask_partners: frozenset[int] = frozenset()
        """The neighbours this peer masked with (known after the masked-input phase)."""
        self.accusations: dict[int, SecAggError] = {}
        """The neighbours whose share ciphertext failed here, with the failure: reported in
        the masked input, left out of the masks (known after the masked-input phase)."""
        self.quantized: np.ndarray | None = None
        """This peer's quantized input, before masking (kept for tests and audits)."""
        self._prep_lock = threading.Lock()  # guards the masked vector being built
        self._masked: np.ndarray | None = None  # (q +) PRG(b) + the pairwise masks so far
        self._with_input = False  # whether q is in it yet
        self._masked_with: frozenset[int] = frozenset()  # whose pairwise masks are in it
        self._sealed = False  # the masked input is made: nothing more to prepare

    @property
    def config(self) -> SecAggConfig:
        if self._config is None:
            raise OutOfPhase("client", self.phase.value, "config access")
        return self._config

    def provide(self, update: np.ndarray, weight: int) -> None:
        """Give the input of a client made without one: before the shares are handled (then
        OutOfPhase), once (a second input is refused the same way). It is checked, and a
        refusal raised, where it is quantized: ``prepare`` or the masked-input phase."""
        with self._prep_lock:
            if self._sealed or self._update is not None:
                raise OutOfPhase("client", self.phase.value, "an input (it has one)")
            self._update, self._weight = update, weight

    def prepare(self) -> None:
        """Build ahead what the masked input needs, so it is ready when the shares arrive: the
        self mask once the setup is handled, the pairwise mask of every advertised neighbour
        once the keys are, the quantized input once there is one. Optional (the masked-input
        phase does whatever is left, and takes back the mask of a neighbour whose shares never
        came) and thread-safe: a caller runs it in a thread while it waits for the server's
        next message. It sends nothing, changes no phase, and leaves a refusal (an update
        that cannot be quantized) to that phase."""
        phase, keys = self.phase, self._keys
        if phase not in (ClientPhase.ADVERTISED, ClientPhase.SHARED):
            return
        with self._prep_lock:
            if not self._sealed:
                try:
                    self._build_masked(frozenset(keys) - {self.peer_id})
                except QuantizationError:
                    return

    def _build_masked(self, partners: frozenset[int]) -> np.ndarray:
        """``q + PRG(b) + sum_{v in partners} +-PRG(s_uv)`` mod 2^32, from what was built
        before: only the missing masks are added, and those of peers no longer among
        ``partners`` taken back out (the caller holds ``_prep_lock``)."""
        config = self.config
        masks = []
        if self._masked is None:
            self._masked = np.zeros(config.dim + 1, np.uint32)
            masks.append((self_mask_key(self._seed, config.round_id), 1))
        for other in sorted(partners - self._masked_with):
            masks.append((self._pair_key(other), pair_sign(self.peer_id, other)))
        for other in sorted(self._masked_with - partners):
            masks.append((self._pair_key(other), -pair_sign(self.peer_id, other)))
        if masks:  # one pass over the vector for all of them
            crypto.apply_masks(self._masked, masks, config.prg)
        self._masked_with = partners
        if not self._with_input and self._update is not None:  # last: a refusal keeps masks
            quantized = config.quantizer().quantize(self._update, self._weight, self._rng)
            self.quantized = quantized
            np.add(self._masked, quantized, out=self._masked)  # mod 2^32
            self._with_input = True
        return self._masked

    def _pair_key(self, other: int) -> bytes:
        return crypto.agree(
            self._mask_sk,
            self._keys[other].mask_key,
            round_id=self.config.round_id,
            info=crypto.INFO_PAIR_MASK,
        )

    def handle(self, message: Message) -> Message:
        """Advance by one server message and return the reply to send to the server."""
        kind = type(message)
        if kind in self._handled:
            raise ReplayedMessage(kind.__name__, "the server")
        if _EXPECTS.get(self.phase) is not kind:
            raise OutOfPhase("client", self.phase.value, kind.__name__)
        if not isinstance(message, Setup) and message.round_id != self.config.round_id:
            raise ForeignRound(self.config.round_id, message.round_id)
        try:
            if isinstance(message, Setup):
                reply: Message = self._on_setup(message)
            elif isinstance(message, KeysBroadcast):
                reply = self._on_keys(message)
            elif isinstance(message, SharesDelivery):
                reply = self._on_shares(message)
            else:
                assert isinstance(message, UnmaskRequest)  # _EXPECTS admits nothing else
                reply = self._on_unmask(message)
        except BaseException:
            # A refused message ends this peer's part in the round: no later phase may run
            # on half-updated state.
            self.phase = ClientPhase.FAILED
            raise
        self._handled.add(kind)
        return reply

    def _on_setup(self, message: Setup) -> KeysAdvert:
        config = message.config
        config.validate()
        if self.peer_id not in config.peers:
            raise UnknownParticipant(self.peer_id, "this peer is not in the setup's peers")
        self._config = config
        self._neighbours = config.graph()[self.peer_id]
        self.phase = ClientPhase.ADVERTISED
        keys = PeerKeys(
            encryption_key=self._enc_pk,
            mask_key=self._mask_pk,
            seed_commitment=seed_commitment(config.round_id, self.peer_id, self._seed),
        )
        return KeysAdvert(round_id=config.round_id, sender=self.peer_id, keys=keys)

    def _on_keys(self, message: KeysBroadcast) -> SharesUpload:
        config = self.config
        mine = message.keys.get(self.peer_id)
        if mine is None or mine.encryption_key != self._enc_pk or mine.mask_key != self._mask_pk:
            raise KeyAdvertRejected("this peer's own keys are missing or altered")
        others = set(message.keys) - {self.peer_id}
        if not others <= self._neighbours:
            raise UnknownParticipant(min(others - self._neighbours), "keys of a non-neighbour")
        if len(others) + 1 < config.threshold:
            raise TooFewSurvivors("advertise", len(others) + 1, config.threshold)
        every_key = [k for pk in message.keys.values() for k in (pk.encryption_key, pk.mask_key)]
        if len(set(every_key)) != len(every_key):
            raise KeyAdvertRejected("two advertised public keys are identical")
        self._keys = dict(message.keys)
        holders = sorted(message.keys)
        indices = {config.share_index(h): h for h in holders}
        seed_shares = split_secret(self._seed, config.threshold, indices)
        key_shares = split_secret(self._mask_sk, config.threshold, indices)
        ciphertexts: dict[int, bytes] = {}
        for index, holder in indices.items():
            if holder == self.peer_id:
                self._seed_shares[holder] = seed_shares[index]
                self._key_shares[holder] = key_shares[index]
                continue
            key = crypto.agree(
                self._enc_sk,
                self._keys[holder].encryption_key,
                round_id=config.round_id,
                info=crypto.INFO_SHARE_KEY,
            )
            plain = SharePlaintext(
                round_id=config.round_id,
                source=self.peer_id,
                destination=holder,
                seed_share=seed_shares[index],
                key_share=key_shares[index],
            )
            ciphertexts[holder] = crypto.encrypt(
                key,
                encode(plain),
                round_id=config.round_id,
                source=self.peer_id,
                destination=holder,
            )
        self.phase = ClientPhase.SHARED
        return SharesUpload(round_id=config.round_id, sender=self.peer_id, ciphertexts=ciphertexts)

    def _on_shares(self, message: SharesDelivery) -> MaskedInput:
        config = self.config
        sources = set(message.ciphertexts)
        if self.peer_id in sources or not sources <= set(self._keys):
            stray = min(sources - (set(self._keys) - {self.peer_id}))
            raise UnknownParticipant(stray, "shares from a peer that is no live neighbour")
        accused: dict[int, SecAggError] = {}
        for source, blob in sorted(message.ciphertexts.items()):
            try:
                plain = self._open_share(source, blob)
            except (ShareDecryptionFailed, ShareMisaddressed, MalformedSecAggMessage) as exc:
                # The sender's fault, not ours: it is reported, we mask without it, and the
                # server drops it. Aborting here would let one peer exclude another.
                accused[source] = exc
                continue
            self._seed_shares[source] = plain.seed_share
            self._key_shares[source] = plain.key_share
        partners = frozenset(sources - set(accused))
        if len(partners) + 1 < config.threshold:
            raise TooFewSurvivors("masked input", len(partners) + 1, config.threshold)
        with self._prep_lock:  # y = q + PRG(b) + sum_v +-PRG(s_uv) over the share senders
            if self._update is None:
                raise QuantizationError("no input to mask: provide() it before the shares")
            self._sealed = True
            masked = self._build_masked(partners)
            self._masked = None
        self.mask_partners = partners
        self.accusations = accused
        self.phase = ClientPhase.MASKED
        # the words as a buffer, not a fresh bytes copy (encoders and stores take buffers)
        words = masked.astype("<u4", copy=False).view(np.uint8).data
        return MaskedInput(
            round_id=config.round_id,
            sender=self.peer_id,
            masked=words,  # type: ignore[arg-type]
            accused=tuple(sorted(accused)),
        )

    def _open_share(self, source: int, blob: bytes) -> SharePlaintext:
        """The share pair ``source`` sent this peer: ShareDecryptionFailed (tampered, swapped,
        not for us), MalformedSecAggMessage (no plaintext), ShareMisaddressed (another route
        or round inside)."""
        config = self.config
        key = crypto.agree(
            self._enc_sk,
            self._keys[source].encryption_key,
            round_id=config.round_id,
            info=crypto.INFO_SHARE_KEY,
        )
        plain = decode_plaintext(
            crypto.decrypt(
                key, blob, round_id=config.round_id, source=source, destination=self.peer_id
            )
        )
        route = (plain.source, plain.destination)
        if route != (source, self.peer_id) or plain.round_id != config.round_id:
            raise ShareMisaddressed(route, (source, self.peer_id))
        return plain

    def _on_unmask(self, message: UnmaskRequest) -> UnmaskResponse:
        config = self.config
        survivors = set(message.survivors)
        dropped = set(message.dropped)
        both = (survivors & dropped) | ({self.peer_id} & dropped)
        if both:
            raise ConflictingUnmaskRequest(both)
        if len(survivors) < config.floor:  # a sum of too few would reveal an input
            raise BelowSurvivorFloor(len(survivors), config.floor)
        holders = self.mask_partners | {self.peer_id}
        seed_shares = {p: self._seed_shares[p] for p in sorted(survivors & holders)}
        key_shares = {p: self._key_shares[p] for p in sorted(dropped & self.mask_partners)}
        self.phase = ClientPhase.DONE
        # Nothing more is ever answered: forget the shares.
        self._seed_shares.clear()
        self._key_shares.clear()
        return UnmaskResponse(
            round_id=config.round_id,
            sender=self.peer_id,
            seed_shares=seed_shares,
            key_shares=key_shares,
        )
