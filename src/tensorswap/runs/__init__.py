"""Runs: federations over the coordinator (a global model across rounds, client registry and
sampling, server optimizers, asynchronous buffered aggregation)."""

from tensorswap.runs.client import RunClient
from tensorswap.runs.dp import RunPrivacy
from tensorswap.runs.dp_ledger import PrivacyRound, PrivacyStep
from tensorswap.runs.errors import (
    BufferBusy,
    FutureVersion,
    InvalidRunSpec,
    NonFiniteModel,
    NonFiniteStep,
    NotRegistered,
    NotSelected,
    RunExists,
    RunNotFound,
    RunsError,
    StaleContribution,
)
from tensorswap.runs.journal import RunDatabase
from tensorswap.runs.manager import RunManager, Task
from tensorswap.runs.model import ClientInfo, RunInfo, RunMode, RunSpec, Staleness, VersionRecord
from tensorswap.runs.registry import ClientRegistry
from tensorswap.runs.sampling import sample_peers

__all__ = [
    "BufferBusy",
    "ClientInfo",
    "ClientRegistry",
    "FutureVersion",
    "InvalidRunSpec",
    "NonFiniteModel",
    "NonFiniteStep",
    "NotRegistered",
    "NotSelected",
    "PrivacyRound",
    "PrivacyStep",
    "RunClient",
    "RunDatabase",
    "RunExists",
    "RunInfo",
    "RunManager",
    "RunMode",
    "RunNotFound",
    "RunPrivacy",
    "RunSpec",
    "RunsError",
    "StaleContribution",
    "Staleness",
    "Task",
    "VersionRecord",
    "sample_peers",
]
