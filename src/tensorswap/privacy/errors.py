"""The privacy branch of the error tree, defined in ``tensorswap.errors.privacy`` (so that
importing ``tensorswap.errors`` registers every remote refusal); re-exported here."""

from __future__ import annotations

from tensorswap.errors.privacy import (
    AccountantUnavailable,
    ClipBoundExceeded,
    PrivacyBudgetExhausted,
    PrivacyError,
)

__all__ = [
    "AccountantUnavailable",
    "ClipBoundExceeded",
    "PrivacyBudgetExhausted",
    "PrivacyError",
]
