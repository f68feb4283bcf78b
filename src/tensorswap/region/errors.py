"""The region branch of the error tree, defined in ``tensorswap.errors.region`` (so that
importing ``tensorswap.errors`` registers every remote refusal); re-exported here."""

from __future__ import annotations

from tensorswap.errors.region import (
    ForeignContribution,
    RegionError,
    RegionLoop,
    RegionNameTaken,
    SecureRunThroughRegion,
    UpstreamIncompatible,
    UpstreamUnavailable,
)

__all__ = [
    "ForeignContribution",
    "RegionError",
    "RegionLoop",
    "RegionNameTaken",
    "SecureRunThroughRegion",
    "UpstreamIncompatible",
    "UpstreamUnavailable",
]
