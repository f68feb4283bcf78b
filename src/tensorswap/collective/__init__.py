"""Peers average among themselves: a verified, fault-tolerant all-reduce (and DiLoCo on it)."""

from tensorswap.collective.blocking import BlockingCollective
from tensorswap.collective.diloco import DiLoCo
from tensorswap.collective.errors import (
    BadCollectiveMessage,
    CollectiveError,
    CommitmentMismatch,
    GroupMismatch,
    JoinTimedOut,
    PeerExcluded,
    ResultMismatch,
    TooFewPeers,
)
from tensorswap.collective.peer import CallStats, Collective
from tensorswap.collective.rendezvous import Rendezvous

__all__ = [
    "BadCollectiveMessage",
    "BlockingCollective",
    "CallStats",
    "Collective",
    "CollectiveError",
    "CommitmentMismatch",
    "DiLoCo",
    "GroupMismatch",
    "JoinTimedOut",
    "PeerExcluded",
    "Rendezvous",
    "ResultMismatch",
    "TooFewPeers",
]
