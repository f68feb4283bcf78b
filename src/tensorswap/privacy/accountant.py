"""Privacy accounting with Google's ``dp-accounting``: the Poisson-subsampled Gaussian
mechanism, composed over a run's rounds, with Rényi-DP (RDP) accounting."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

from tensorswap.privacy.errors import AccountantUnavailable

__all__ = ["RDP_ORDERS", "check_available", "epsilon", "round_epsilons"]

RDP_ORDERS: tuple[float, ...] = tuple(
    [1 + x / 10 for x in range(10, 100)] + list(range(11, 64)) + [128, 256, 512]
)
"""The Rényi orders searched: dp-accounting's defaults from 2 up. Orders in (1, 2) only
tighten ε where it is already far above any useful budget (ε > ~50), and dp-accounting's
series for them fails to converge for common settings (it logs a warning per order)."""


def _dp_accounting() -> Any:
    try:
        import dp_accounting
        from dp_accounting import rdp
    except ImportError as exc:
        raise AccountantUnavailable(str(exc)) from exc
    return dp_accounting, rdp


def check_available() -> None:
    """AccountantUnavailable unless dp-accounting imports (checked when a DP run is made)."""
    _dp_accounting()


def epsilon(noise_multiplier: float, rates: Sequence[float], delta: float) -> float:
    """ε at ``delta`` after one round per entry of ``rates``, each the Poisson-subsampled
    Gaussian mechanism with sampling rate ``q`` (sampled / population) and
    ``noise_multiplier``, composed with dp-accounting's RDP accountant. 0 for no rounds;
    ``inf`` without noise (``noise_multiplier == 0``)."""
    if not rates:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    dp_accounting, rdp = _dp_accounting()
    accountant = rdp.RdpAccountant(list(RDP_ORDERS))
    gaussian = dp_accounting.GaussianDpEvent(noise_multiplier)
    for q, count in sorted(Counter(_rate(q) for q in rates).items()):
        event = gaussian if q == 1.0 else dp_accounting.PoissonSampledDpEvent(q, gaussian)
        accountant.compose(event, count)
    return float(accountant.get_epsilon(delta))


def round_epsilons(noise_multiplier: float, rates: Sequence[float], delta: float) -> list[float]:
    """ε after each round (the running composition): ``epsilon(z, rates[:i + 1], delta)``."""
    return [epsilon(noise_multiplier, rates[: i + 1], delta) for i in range(len(rates))]


def _rate(q: float) -> float:
    if not (0 < q <= 1 and math.isfinite(q)):
        raise ValueError(f"a sampling rate is in (0, 1], got {q!r}")
    return float(q)
