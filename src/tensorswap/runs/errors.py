"""The runs branch of the error tree, defined in ``tensorswap.errors.runs`` (so that
importing ``tensorswap.errors`` registers every remote refusal); re-exported here."""

from __future__ import annotations

from tensorswap.errors.runs import (
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

__all__ = [
    "BufferBusy",
    "FutureVersion",
    "InvalidRunSpec",
    "NonFiniteModel",
    "NonFiniteStep",
    "NotRegistered",
    "NotSelected",
    "RunExists",
    "RunNotFound",
    "RunsError",
    "StaleContribution",
]
