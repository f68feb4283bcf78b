"""Privacy as a pure library: differential privacy's mechanisms (DP-FedAvg's clipping and
Gaussian noise, fixed or adaptive clipping), the accountant (dp-accounting) and secure
aggregation (``privacy.secagg``). It imports no runs code: what makes a run private (its
ledger, its release, its parameters) lives in ``tensorswap.runs.dp``, ``runs.dp_ledger`` and
``runs.dp_params``."""

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

__all__ = [
    "AccountantUnavailable",
    "ClipBoundExceeded",
    "PrivacyBudgetExhausted",
    "PrivacyError",
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
