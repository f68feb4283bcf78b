"""Privacy for runs: differential privacy (DP-FedAvg's clipping and Gaussian noise, fixed or
adaptive clipping, accounted with dp-accounting) and secure aggregation (``privacy.secagg``)."""

# The runs package first: its manager imports privacy modules, which import runs.errors.
import tensorswap.runs  # noqa: F401  isort: skip

from tensorswap.privacy.accountant import epsilon, round_epsilons
from tensorswap.privacy.dp import (
    adaptive_noise,
    clip_factor,
    clip_update,
    next_clip,
    noise_std,
    secure_generator,
    update_norm,
)
from tensorswap.privacy.errors import (
    AccountantUnavailable,
    ClipBoundExceeded,
    PrivacyBudgetExhausted,
    PrivacyError,
)
from tensorswap.privacy.ledger import PrivacyRound, PrivacyStep
from tensorswap.privacy.run import RunPrivacy

__all__ = [
    "AccountantUnavailable",
    "ClipBoundExceeded",
    "PrivacyBudgetExhausted",
    "PrivacyError",
    "PrivacyRound",
    "PrivacyStep",
    "RunPrivacy",
    "adaptive_noise",
    "clip_factor",
    "clip_update",
    "epsilon",
    "next_clip",
    "noise_std",
    "round_epsilons",
    "secure_generator",
    "update_norm",
]
