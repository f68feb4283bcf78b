"""The server's side of SecAgg+ as a pure state machine: it learns only the survivors' sum.

The caller feeds it every peer message (``receive``) and decides when a phase ends
(``close_phase``: all expected messages arrived, or the caller's deadline passed; time is
not the server's business). ``close_phase`` returns the messages to send for the next
phase, peer by peer. A round below the threshold fails with ``TooFewSurvivors`` (phase
``FAILED``); a peer whose secrets cannot be rebuilt fails it with ``TooFewShares``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tensorswap.privacy.secagg import crypto
from tensorswap.privacy.secagg.client import pair_sign, seed_commitment, self_mask_key
from tensorswap.privacy.secagg.errors import (
    BelowSurvivorFloor,
    ForeignRound,
    KeyAdvertRejected,
    MalformedSecAggMessage,
    OutOfPhase,
    ReconstructionMismatch,
    ReplayedMessage,
    SecAggError,
    TooFewShares,
    TooFewSurvivors,
    UnknownParticipant,
)
from tensorswap.privacy.secagg.protocol import (
    KEY_BYTES,
    KeysAdvert,
    KeysBroadcast,
    MaskedInput,
    Message,
    PeerKeys,
    SecAggConfig,
    Setup,
    SharesDelivery,
    SharesUpload,
    UnmaskRequest,
    UnmaskResponse,
)
from tensorswap.privacy.secagg.shamir import combine_shares


class ServerPhase(enum.Enum):
    """Which peer message the server collects now."""

    ADVERTISE = "advertise"
    SHARE = "share"
    MASK = "masked input"
    UNMASK = "unmask"
    DONE = "done"
    FAILED = "failed"


_COLLECTS: dict[ServerPhase, type] = {
    ServerPhase.ADVERTISE: KeysAdvert,
    ServerPhase.SHARE: SharesUpload,
    ServerPhase.MASK: MaskedInput,
    ServerPhase.UNMASK: UnmaskResponse,
}


@dataclass(frozen=True)
class SecAggResult:
    """The unmasked aggregate: ``total`` is the sum mod 2^32 of the survivors' quantized
    vectors (weights last); ``mean`` FedAvg's weighted mean; ``weight_sum`` sum(num_samples).
    """

    survivors: tuple[int, ...]
    dropped: tuple[int, ...]
    total: np.ndarray
    mean: np.ndarray
    weight_sum: int
    implicated: dict[int, tuple[int, ...]]
    """Peers dropped because a neighbour could not open their shares: peer -> accusers."""


def _prune(alive: set[int], graph: dict[int, frozenset[int]], threshold: int) -> set[int]:
    """Drop, until none is left, peers with fewer than t share holders (neighbours + self)
    among ``alive``: their secrets could never be rebuilt.
    """
    alive = set(alive)
    while True:
        weak = {p for p in alive if len(graph[p] & alive) + 1 < threshold}
        if not weak:
            return alive
        alive -= weak


class SecAggServer:
    """The coordinator's run of one secure aggregation with the given ``config``."""

    def __init__(self, config: SecAggConfig) -> None:
        config.validate()
        self.config = config
        self.graph = config.graph()
        self.phase = ServerPhase.ADVERTISE
        self.result: SecAggResult | None = None
        self._expected: set[int] = set(config.peers)
        self._keys: dict[int, PeerKeys] = {}
        self._uploads: dict[int, dict[int, bytes]] = {}
        self._masked: set[int] = set()  # who sent a masked vector
        self._pending: dict[int, np.ndarray] = {}  # vectors whose sender may yet be accused
        self._accused: dict[int, frozenset[int]] = {}  # peer -> whom it accused
        self._implicated: dict[int, set[int]] = {}  # peer -> who accused it
        self._total: np.ndarray | None = None  # the folded vectors' sum mod 2^32
        self._responses: dict[int, UnmaskResponse] = {}
        self._live: dict[int, frozenset[int]] = {}  # peer -> its neighbours that shared
        self._survivors: tuple[int, ...] = ()
        self._dropped: tuple[int, ...] = ()

    def setup_messages(self) -> dict[int, Message]:
        """Phase 0: the ``Setup`` message for every peer."""
        return {p: Setup(config=self.config) for p in self.config.peers}

    def receive(self, message: Message) -> None:
        """Take one peer message of the current phase; refuse anything else, typed."""
        kind = type(message)
        if _COLLECTS.get(self.phase) is not kind:
            raise OutOfPhase("server", self.phase.value, kind.__name__)
        assert isinstance(message, KeysAdvert | SharesUpload | MaskedInput | UnmaskResponse)
        if message.round_id != self.config.round_id:
            raise ForeignRound(self.config.round_id, message.round_id)
        sender = message.sender
        if sender not in self._expected:
            raise UnknownParticipant(sender, f"not expected in phase {self.phase.value}")
        if isinstance(message, KeysAdvert):
            self._take_keys(sender, message.keys)
        elif isinstance(message, SharesUpload):
            self._take_upload(sender, message.ciphertexts)
        elif isinstance(message, MaskedInput):
            self._take_masked(sender, message.masked, message.accused)
        else:
            self._take_response(sender, message)

    def _refuse_replay(self, slot: dict[int, object] | set[int], sender: int) -> None:
        if sender in slot:
            raise ReplayedMessage(_COLLECTS[self.phase].__name__, f"peer {sender}")

    def _take_keys(self, sender: int, keys: PeerKeys) -> None:
        self._refuse_replay(self._keys, sender)  # type: ignore[arg-type]
        if len(keys.encryption_key) != KEY_BYTES or len(keys.mask_key) != KEY_BYTES:
            raise MalformedSecAggMessage(f"peer {sender}'s public keys are not 32 bytes")
        seen = {k for pk in self._keys.values() for k in (pk.encryption_key, pk.mask_key)}
        if {keys.encryption_key, keys.mask_key} & seen or keys.encryption_key == keys.mask_key:
            raise KeyAdvertRejected(f"peer {sender} repeats a public key already advertised")
        self._keys[sender] = keys

    def _take_upload(self, sender: int, ciphertexts: dict[int, bytes]) -> None:
        self._refuse_replay(self._uploads, sender)  # type: ignore[arg-type]
        wanted = self._live[sender]
        if set(ciphertexts) != wanted:
            stray = set(ciphertexts) ^ wanted
            raise UnknownParticipant(
                min(stray), f"peer {sender}'s shares must go to exactly its live neighbours"
            )
        self._uploads[sender] = dict(ciphertexts)

    def _take_masked(self, sender: int, masked: bytes, accused: tuple[int, ...]) -> None:
        self._refuse_replay(self._masked, sender)
        if len(masked) != 4 * (self.config.dim + 1):
            raise MalformedSecAggMessage(
                f"peer {sender}'s masked vector has {len(masked)} bytes, "
                f"{4 * (self.config.dim + 1)} expected"
            )
        blamed = frozenset(accused)
        if len(blamed) != len(accused) or not blamed <= self._live[sender]:
            raise UnknownParticipant(
                min(blamed - self._live[sender], default=sender),
                f"peer {sender} may accuse only live neighbours that sent it shares, once each",
            )
        self._masked.add(sender)
        self._accused[sender] = blamed
        for peer in blamed:
            self._implicated.setdefault(peer, set()).add(sender)
            self._pending.pop(peer, None)  # never folded: its sender is dropped
        if sender not in self._implicated:
            # held until every peer that got its shares has reported (only those can accuse
            # it), then folded: so an accused peer's vector never enters the sum
            self._pending[sender] = np.frombuffer(masked, dtype="<u4")
        self._fold_settled(lambda peer: self._live[peer] <= self._masked)

    def _fold_settled(self, settled: Callable[[int], bool]) -> None:
        """Fold every held vector whose sender can no longer be accused (``settled``)."""
        for peer in sorted(p for p in self._pending if settled(p)):
            vector = self._pending.pop(peer)
            if self._total is None:  # the first: a copy (the message's buffer is not ours)
                self._total = vector.astype(np.uint32)
            else:  # mod 2^32
                np.add(self._total, vector, out=self._total)

    def _partners(self, peer: int) -> frozenset[int]:
        """Whom ``peer`` masked with: its live neighbours but those it accused."""
        return self._live[peer] - self._accused.get(peer, frozenset())

    def _take_response(self, sender: int, response: UnmaskResponse) -> None:
        self._refuse_replay(self._responses, sender)  # type: ignore[arg-type]
        partners = self._partners(sender)
        seeds_ok = set(response.seed_shares) <= set(self._survivors) & (partners | {sender})
        keys_ok = set(response.key_shares) <= set(self._dropped) & partners
        if not (seeds_ok and keys_ok):
            raise MalformedSecAggMessage(f"peer {sender} answered shares it was not asked for")
        self._responses[sender] = response

    def close_phase(self) -> dict[int, Message]:
        """End the current phase with whoever answered; the messages of the next phase.

        Raises ``TooFewSurvivors`` (and the round is ``FAILED``) when fewer than t remain,
        and after the unmask phase computes ``result`` and returns no messages.
        """
        if self.phase not in _COLLECTS:
            raise OutOfPhase("server", self.phase.value, "close_phase")
        try:
            if self.phase is ServerPhase.ADVERTISE:
                return self._close_advertise()
            if self.phase is ServerPhase.SHARE:
                return self._close_share()
            if self.phase is ServerPhase.MASK:
                return self._close_mask()
            self.result = self._reconstruct()
            self.phase = ServerPhase.DONE
            return {}
        except SecAggError:
            self.phase = ServerPhase.FAILED
            raise

    def _require(self, alive: set[int]) -> None:
        if len(alive) < self.config.threshold:
            raise TooFewSurvivors(self.phase.value, len(alive), self.config.threshold)

    def _close_advertise(self) -> dict[int, Message]:
        alive = _prune(set(self._keys), self.graph, self.config.threshold)
        self._require(alive)
        self._live = {p: self.graph[p] & alive for p in alive}
        self._expected = alive
        self.phase = ServerPhase.SHARE
        rid = self.config.round_id
        return {
            p: KeysBroadcast(round_id=rid, keys={q: self._keys[q] for q in self._live[p] | {p}})
            for p in sorted(alive)
        }

    def _close_share(self) -> dict[int, Message]:
        alive = _prune(set(self._uploads), self.graph, self.config.threshold)
        self._require(alive)
        self._live = {p: self.graph[p] & alive for p in alive}
        self._expected = alive
        self.phase = ServerPhase.MASK
        rid = self.config.round_id
        return {
            p: SharesDelivery(
                round_id=rid, ciphertexts={q: self._uploads[q][p] for q in sorted(self._live[p])}
            )
            for p in sorted(alive)
        }

    def _close_mask(self) -> dict[int, Message]:
        alive = self._masked - set(self._implicated)
        self._fold_settled(lambda peer: peer in alive)  # who did not report cannot accuse
        self._require(alive)
        implicated = self.implicated
        if len(alive) < self.config.floor:
            raise BelowSurvivorFloor(len(alive), self.config.floor, implicated)
        self._survivors = tuple(sorted(alive))
        self._dropped = tuple(sorted(self._expected - alive))
        self._expected = alive
        self.phase = ServerPhase.UNMASK
        request = UnmaskRequest(
            round_id=self.config.round_id, survivors=self._survivors, dropped=self._dropped
        )
        return {p: request for p in self._survivors}

    @property
    def implicated(self) -> dict[int, tuple[int, ...]]:
        """Peers accused of shares that would not open, with their accusers (sorted)."""
        return {p: tuple(sorted(by)) for p, by in sorted(self._implicated.items())}

    def usable_inputs(self) -> int:
        """How many masked inputs would enter the sum if the phase closed now."""
        return len(self._masked - set(self._implicated))

    def _shares_of(self, owner: int, field: str) -> list[bytes]:
        return [
            getattr(r, field)[owner]
            for _, r in sorted(self._responses.items())
            if owner in getattr(r, field)
        ]

    def _rebuild(self, owner: int, field: str, secret: str) -> bytes:
        shares = self._shares_of(owner, field)
        if len(shares) < self.config.threshold:
            raise TooFewShares(owner, secret, len(shares), self.config.threshold)
        try:
            return combine_shares(shares, self.config.threshold)
        except SecAggError as exc:
            raise ReconstructionMismatch(owner, secret) from exc

    def _reconstruct(self) -> SecAggResult:
        self._require(set(self._responses))
        config = self.config
        rid, length = config.round_id, config.dim + 1
        total = self._total  # the survivors' masked vectors, summed as they arrived
        assert total is not None and total.size == length  # _close_mask required survivors
        masks: list[tuple[bytes, int]] = []  # what to take back out, then one pass over total
        for peer in self._survivors:
            seed = self._rebuild(peer, "seed_shares", "self-mask seed")
            if seed_commitment(rid, peer, seed) != self._keys[peer].seed_commitment:
                raise ReconstructionMismatch(peer, "self-mask seed")
            masks.append((self_mask_key(seed, rid), -1))
        for gone in self._dropped:
            masked_with = sorted(p for p in self._survivors if gone in self._partners(p))
            if not masked_with:  # no survivor added a mask with it: nothing to remove
                continue
            secret_key = self._rebuild(gone, "key_shares", "mask key")
            if crypto.public_key_of(secret_key) != self._keys[gone].mask_key:
                raise ReconstructionMismatch(gone, "mask key")
            for peer in masked_with:
                seed = crypto.agree(
                    secret_key, self._keys[peer].mask_key, round_id=rid, info=crypto.INFO_PAIR_MASK
                )
                # The survivor added (or subtracted) this mask; take it back out.
                masks.append((seed, -pair_sign(peer, gone)))
        crypto.apply_masks(total, masks, config.prg)
        mean = config.quantizer().weighted_mean(total, len(self._survivors))
        return SecAggResult(
            survivors=self._survivors,
            dropped=self._dropped,
            total=total,
            mean=mean,
            weight_sum=int(total[-1]),
            implicated=self.implicated,
        )
