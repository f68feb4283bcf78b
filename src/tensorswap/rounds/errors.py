"""The rounds branch of the error tree, defined in ``tensorswap.errors.rounds`` (so that
importing ``tensorswap.errors`` registers every remote refusal); re-exported here."""

from __future__ import annotations

from tensorswap.errors.rounds import (
    ContributionsLost,
    DataDirInUse,
    DuplicateContribution,
    InvalidRoundSpec,
    InvalidUpdate,
    JournalDamaged,
    JournalMissing,
    NonFiniteAggregate,
    PeerNotAuthorised,
    RoundAlreadyTerminal,
    RoundClosed,
    RoundFailed,
    RoundNotFound,
    RoundsError,
    RoundTimeout,
    SampleHidden,
    TooManySamples,
    UnknownUpdate,
    UpdateMismatch,
)

__all__ = [
    "ContributionsLost",
    "DataDirInUse",
    "DuplicateContribution",
    "InvalidRoundSpec",
    "InvalidUpdate",
    "JournalDamaged",
    "JournalMissing",
    "NonFiniteAggregate",
    "PeerNotAuthorised",
    "RoundAlreadyTerminal",
    "RoundClosed",
    "RoundFailed",
    "RoundNotFound",
    "RoundTimeout",
    "RoundsError",
    "SampleHidden",
    "TooManySamples",
    "UnknownUpdate",
    "UpdateMismatch",
]
