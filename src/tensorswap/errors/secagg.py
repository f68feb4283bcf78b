"""The SecAgg+ error branch: every failure of the protocol library, typed and with its facts.

::

    PrivacyError                       (its DP leaves: tensorswap.errors.privacy)
    └── SecAggError                    (privacy.secagg)
        ├── SecAggConfigError          (also ValueError) parameters that cannot run safely
        ├── ShamirError                a share set that cannot be combined
        │   ├── MalformedShare         bytes that are no share of this scheme
        │   ├── DuplicateShareIndex    two shares at the same evaluation point
        │   └── NotEnoughShares        fewer shares than the threshold
        ├── QuantizationError          (also ValueError) an input the quantizer refuses
        ├── MalformedSecAggMessage     bytes that do not decode to a protocol message
        ├── ShareDecryptionFailed      an encrypted share failed its AEAD check (tampered)
        ├── ShareMisaddressed          a decrypted share names another source or destination
        ├── OutOfPhase                 a message the receiver's current phase does not take
        ├── ReplayedMessage            a second message for a slot already filled
        ├── ForeignRound               a message for another round
        ├── UnknownParticipant         a sender or subject that is not in the round
        ├── ConflictingUnmaskRequest   a server asking for both shares of one peer
        ├── KeyAdvertRejected          a key broadcast that misrepresents or repeats keys
        ├── TooFewSurvivors            fewer than t peers left: the round fails
        │   └── BelowSurvivorFloor     fewer survivors than the floor: their sum stays masked
        ├── TooFewShares               fewer than t shares of one peer's secret arrived
        ├── ReconstructionMismatch     a reconstructed secret fails its commitment
        ├── PeerDropped                a peer asks for a phase it was dropped from
        └── SecureRoundFailed          a run's secure round failed (its reason, typed)
"""

from __future__ import annotations

from collections.abc import Iterable

from tensorswap.errors import PrivacyError, register_remote


class SecAggError(PrivacyError):
    """Root of the secure-aggregation branch: the round's privacy protocol failed."""


class SecAggConfigError(SecAggError, ValueError):
    """SecAgg+ parameters that are inconsistent or would overflow or weaken the protocol."""

    def __init__(self, parameter: str, value: object, reason: str) -> None:
        self.parameter = parameter
        self.value = value
        self.reason = reason
        super().__init__(f"secagg parameter {parameter}={value!r}: {reason}")


class ShamirError(SecAggError):
    """A Shamir share set that cannot be combined into a secret."""


class MalformedShare(ShamirError):
    """Bytes that are not a share of this scheme (length, index or field element)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"malformed Shamir share: {reason}")


class DuplicateShareIndex(ShamirError):
    """Two shares evaluated at the same point: interpolation would divide by zero."""

    def __init__(self, index: int) -> None:
        self.index = index
        super().__init__(f"two Shamir shares at the same index {index}")


class NotEnoughShares(ShamirError):
    """Fewer shares than the threshold: the secret is information-theoretically hidden."""

    def __init__(self, have: int, need: int) -> None:
        self.have = have
        self.need = need
        super().__init__(f"{have} Shamir shares given, the threshold is {need}")


class QuantizationError(SecAggError, ValueError):
    """An input the quantizer refuses (wrong dtype or shape, non-finite, weight out of range)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"cannot quantize: {reason}")


class MalformedSecAggMessage(SecAggError):
    """Bytes that do not decode to a SecAgg+ message (translated from msgspec)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"malformed secagg message: {reason}")


class ShareDecryptionFailed(SecAggError):
    """An encrypted share failed authenticated decryption: tampered, or under another key."""

    def __init__(self, source: int, destination: int) -> None:
        self.source = source
        self.destination = destination
        super().__init__(
            f"encrypted shares from peer {source} to peer {destination} failed the AEAD "
            "check (tampered or misrouted); refusing them"
        )


class ShareMisaddressed(SecAggError):
    """A decrypted share names a source or destination other than the envelope's."""

    def __init__(self, claimed: tuple[int, int], envelope: tuple[int, int]) -> None:
        self.claimed = claimed
        self.envelope = envelope
        super().__init__(
            f"shares claim to go {claimed[0]}->{claimed[1]} but came as "
            f"{envelope[0]}->{envelope[1]}"
        )


class OutOfPhase(SecAggError):
    """A message the receiver's current phase does not accept."""

    def __init__(self, role: str, phase: str, message: str) -> None:
        self.role = role
        self.phase = phase
        self.message = message
        super().__init__(f"secagg {role} in phase {phase} refuses a {message} message")


class ReplayedMessage(SecAggError):
    """A second message for a slot already filled (same sender, same phase)."""

    def __init__(self, message: str, sender: str) -> None:
        self.message = message
        self.sender = sender
        super().__init__(f"a second {message} message from {sender}: refused as a replay")


class ForeignRound(SecAggError):
    """A message that belongs to another round."""

    def __init__(self, expected: bytes, found: bytes) -> None:
        self.expected = expected
        self.found = found
        super().__init__(f"message for round {found.hex()}, this is round {expected.hex()}")


class UnknownParticipant(SecAggError):
    """A sender or subject that is not a participant of this round (or not a neighbour)."""

    def __init__(self, peer: int, context: str) -> None:
        self.peer = peer
        self.context = context
        super().__init__(f"peer {peer} is not a participant here ({context})")


class ConflictingUnmaskRequest(SecAggError):
    """The server asked for the self-mask share and the mask-key share of the same peer.

    Answering both would let it remove every mask of that peer and read its input.
    """

    def __init__(self, peers: Iterable[int]) -> None:
        self.peers = tuple(sorted(peers))
        super().__init__(
            f"unmask request names peers {list(self.peers)} both as survivors and as dropped; "
            "revealing both shares would expose their inputs, so it is refused"
        )


class KeyAdvertRejected(SecAggError):
    """A key broadcast that misrepresents this peer's keys or repeats a key."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"key broadcast refused: {reason}")


class TooFewSurvivors(SecAggError):
    """Fewer than t peers remain at a phase: nothing can be unmasked, the round fails."""

    def __init__(self, phase: str, survivors: int, threshold: int) -> None:
        self.phase = phase
        self.survivors = survivors
        self.threshold = threshold
        super().__init__(
            f"secagg round failed in phase {phase}: {survivors} peers remain, the "
            f"threshold is {threshold}"
        )


class BelowSurvivorFloor(TooFewSurvivors):
    """Fewer survivors than the config's floor (``max(min_survivors, threshold)``): their sum
    is not unmasked, since with so few inputs in it a peer (or a few colluding) could read
    another's from it. ``implicated`` names peers dropped for bad shares, and who said so."""

    def __init__(
        self, survivors: int, floor: int, implicated: dict[int, tuple[int, ...]] | None = None
    ) -> None:
        self.implicated = dict(implicated or {})
        super().__init__("unmask", survivors, floor)
        blamed = "".join(
            f"; peer {bad} dropped: peers {list(by)} could not open its shares"
            for bad, by in sorted(self.implicated.items())
        )
        self.args = (
            f"secagg round failed: {survivors} survivors, fewer than the floor of {floor} "
            f"a sum is unmasked over (secagg_min_survivors){blamed}",
        )


class TooFewShares(SecAggError):
    """Fewer than t shares of one peer's secret arrived: its masks cannot be removed."""

    def __init__(self, owner: int, secret: str, have: int, need: int) -> None:
        self.owner = owner
        self.secret = secret
        self.have = have
        self.need = need
        super().__init__(
            f"secagg round failed: {have} shares of peer {owner}'s {secret} arrived, "
            f"{need} are needed to remove its masks"
        )


class ReconstructionMismatch(SecAggError):
    """A reconstructed secret does not match what its owner committed to (bad shares)."""

    def __init__(self, owner: int, secret: str) -> None:
        self.owner = owner
        self.secret = secret
        super().__init__(
            f"the reconstructed {secret} of peer {owner} does not match its commitment; "
            "a share was corrupted"
        )


class PeerDropped(SecAggError):
    """A peer asked for the next message of a phase it was dropped from (it did not answer
    the previous one before that phase closed)."""

    def __init__(self, peer: str, phase: str) -> None:
        self.peer = peer
        self.phase = phase
        super().__init__(
            f"peer {peer!r} was dropped from the secure round before phase {phase!r}: it did "
            f"not answer in time; wait for the next task"
        )


class SecureRoundFailed(SecAggError):
    """A run's secure round failed (too few survivors, a restart, a config the sample
    cannot run); ``reason`` says why. The run starts a new round with a new sample."""

    def __init__(self, key: str, reason: str) -> None:
        self.key = key
        self.reason = reason
        super().__init__(f"secure round {key} failed: {reason}")


__all__ = [
    "BelowSurvivorFloor",
    "ConflictingUnmaskRequest",
    "DuplicateShareIndex",
    "ForeignRound",
    "KeyAdvertRejected",
    "MalformedSecAggMessage",
    "MalformedShare",
    "NotEnoughShares",
    "OutOfPhase",
    "PeerDropped",
    "QuantizationError",
    "ReconstructionMismatch",
    "ReplayedMessage",
    "SecAggConfigError",
    "SecAggError",
    "SecureRoundFailed",
    "ShamirError",
    "ShareDecryptionFailed",
    "ShareMisaddressed",
    "TooFewShares",
    "TooFewSurvivors",
    "UnknownParticipant",
]

register_remote(
    *(c for c in list(globals().values()) if isinstance(c, type) and issubclass(c, SecAggError))
)
