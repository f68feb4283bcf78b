"""The differential-privacy errors, under ``PrivacyError`` (a branch of the root, which
SecAgg+'s ``SecAggError`` shares: ``tensorswap.errors.secagg``).

::

    TensorSwapError
    └── PrivacyError              a private run could not do what was asked
        ├── PrivacyBudgetExhausted  the next round would spend more than ``dp_max_epsilon``
        ├── ClipBoundExceeded       a client-clipped update above the round's clipping norm
        ├── AccountantUnavailable   ``dp-accounting`` is not installed (the ``privacy`` extra)
        └── SecAggError             SecAgg+ failures (``tensorswap.errors.secagg``)
"""

from __future__ import annotations

from tensorswap.errors import PrivacyError, register_remote

__all__ = ["AccountantUnavailable", "ClipBoundExceeded", "PrivacyBudgetExhausted", "PrivacyError"]


class PrivacyBudgetExhausted(PrivacyError):
    """Starting the next round would take the run's ε past its ``dp_max_epsilon``: the run
    stops (finished) instead, with this as its reason."""

    def __init__(self, run: str, round: int, spent: float, next_epsilon: float, limit: float):
        self.run = run
        self.round = round
        self.spent = spent
        self.next_epsilon = next_epsilon
        self.limit = limit
        super().__init__(
            f"run {run!r}: privacy budget exhausted: spent epsilon {spent:.4g}, round {round} "
            f"would reach {next_epsilon:.4g}, above the limit dp_max_epsilon={limit:.4g}"
        )


class ClipBoundExceeded(PrivacyError):
    """A peer of a client-side clipping run submitted an update whose L2 norm is above the
    round's clipping norm: refused (clip the update to the task's ``clip`` first)."""

    def __init__(self, run: str, round: int, peer: str, norm: float, clip: float) -> None:
        self.run = run
        self.round = round
        self.peer = peer
        self.norm = norm
        self.clip = clip
        super().__init__(
            f"run {run!r} round {round}: the update of peer {peer!r} has L2 norm {norm:.6g}, "
            f"above the clipping norm {clip:.6g}; clip it to the task's norm and submit again"
        )


class AccountantUnavailable(PrivacyError):
    """Accounting needs Google's ``dp-accounting`` (``pip install tensorswap[privacy]``)."""

    def __init__(self, detail: str) -> None:
        self.detail = detail
        super().__init__(
            f"privacy accounting needs the dp-accounting package "
            f"(pip install 'tensorswap[privacy]'): {detail}"
        )


register_remote(
    *(c for n in __all__ if isinstance(c := globals()[n], type) and issubclass(c, PrivacyError))
)
