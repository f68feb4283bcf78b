"""Rounds: the coordinator's state machine, deadlines and quorum, persisted in SQLite."""

from tensorswap.rounds.deadline import Clock, FakeClock, SystemClock, expiry_verdict
from tensorswap.rounds.errors import (
    DuplicateContribution,
    InvalidRoundSpec,
    RoundAlreadyTerminal,
    RoundClosed,
    RoundNotFound,
    RoundTimeout,
    UnknownUpdate,
    UpdateMismatch,
)
from tensorswap.rounds.persist import RoundDatabase
from tensorswap.rounds.state import (
    Aggregating,
    Collecting,
    Complete,
    Contribution,
    Failed,
    LayerSpec,
    Pending,
    RoundId,
    RoundInfo,
    RoundSpec,
    RoundStatus,
    RoundTracker,
)

__all__ = [
    "Aggregating",
    "Clock",
    "Collecting",
    "Complete",
    "Contribution",
    "DuplicateContribution",
    "Failed",
    "FakeClock",
    "InvalidRoundSpec",
    "LayerSpec",
    "Pending",
    "RoundAlreadyTerminal",
    "RoundClosed",
    "RoundDatabase",
    "RoundId",
    "RoundInfo",
    "RoundNotFound",
    "RoundSpec",
    "RoundStatus",
    "RoundTimeout",
    "RoundTracker",
    "SystemClock",
    "UnknownUpdate",
    "UpdateMismatch",
    "expiry_verdict",
]
