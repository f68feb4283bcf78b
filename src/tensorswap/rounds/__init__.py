"""Rounds: the coordinator's state machine, deadlines and quorum, persisted in SQLite."""

from tensorswap.rounds.batch import PeerKeys, submit_proof
from tensorswap.rounds.blocking import BlockingRoundClient
from tensorswap.rounds.client import RoundClient, ServerStatus, SubmitResult
from tensorswap.rounds.coordinator import Coordinator, CoordinatorStats
from tensorswap.rounds.deadline import Clock, FakeClock, SystemClock, expiry_verdict
from tensorswap.rounds.errors import (
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
    RoundTimeout,
    TooManySamples,
    UnknownUpdate,
    UpdateMismatch,
)
from tensorswap.rounds.hooks import Admission, CoordinatorHooks, HookList
from tensorswap.rounds.paging import page_peers, page_rounds
from tensorswap.rounds.persist import RoundDatabase
from tensorswap.rounds.reconnect import Backoff, retrying
from tensorswap.rounds.server import RoundServer, TrafficStats
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
from tensorswap.rounds.virtual import PeerSubmit, VirtualClients, VirtualPeer

__all__ = [
    "Admission",
    "Aggregating",
    "Backoff",
    "BlockingRoundClient",
    "Clock",
    "Collecting",
    "Complete",
    "Contribution",
    "ContributionsLost",
    "Coordinator",
    "CoordinatorHooks",
    "CoordinatorStats",
    "DataDirInUse",
    "DuplicateContribution",
    "Failed",
    "FakeClock",
    "HookList",
    "InvalidRoundSpec",
    "InvalidUpdate",
    "JournalDamaged",
    "JournalMissing",
    "LayerSpec",
    "NonFiniteAggregate",
    "PeerKeys",
    "PeerNotAuthorised",
    "PeerSubmit",
    "Pending",
    "RoundAlreadyTerminal",
    "RoundClient",
    "RoundClosed",
    "RoundDatabase",
    "RoundFailed",
    "RoundId",
    "RoundInfo",
    "RoundNotFound",
    "RoundServer",
    "RoundSpec",
    "RoundStatus",
    "RoundTimeout",
    "RoundTracker",
    "ServerStatus",
    "SubmitResult",
    "SystemClock",
    "TooManySamples",
    "TrafficStats",
    "UnknownUpdate",
    "UpdateMismatch",
    "VirtualClients",
    "VirtualPeer",
    "expiry_verdict",
    "page_peers",
    "page_rounds",
    "retrying",
    "submit_proof",
]
