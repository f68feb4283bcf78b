"""The secagg branch of the error tree, defined in ``tensorswap.errors.secagg`` (so that
importing ``tensorswap.errors`` registers every remote refusal); re-exported here."""

from __future__ import annotations

from tensorswap.errors.secagg import (
    BelowSurvivorFloor,
    ConflictingUnmaskRequest,
    DuplicateShareIndex,
    ForeignRound,
    KeyAdvertRejected,
    MalformedSecAggMessage,
    MalformedShare,
    NotEnoughShares,
    OutOfPhase,
    PeerDropped,
    QuantizationError,
    ReconstructionMismatch,
    ReplayedMessage,
    SecAggConfigError,
    SecAggError,
    SecureRoundFailed,
    ShamirError,
    ShareDecryptionFailed,
    ShareMisaddressed,
    TooFewShares,
    TooFewSurvivors,
    UnknownParticipant,
)

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
