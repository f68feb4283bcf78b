"""What a run's next round is: the peers sampled for it (sync runs) and the ``RoundSpec``
the coordinator runs it under. The manager journals and starts it."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from tensorswap.rounds.core import Layout, RoundSpec
from tensorswap.runs.dp import RunPrivacy, is_private
from tensorswap.runs.model import RunInfo, RunMode
from tensorswap.runs.sampling import sample_peers
from tensorswap.runs.secure import is_secure

__all__ = ["round_spec", "sample_next"]

log = logging.getLogger(__name__)


def sample_next(
    info: RunInfo, active: Sequence[str], privacy: RunPrivacy
) -> tuple[str, ...] | None:
    """The peers sampled for round ``info.round + 1`` of a sync run, or None while fewer
    than ``min_clients`` peers are active (the round waits). A DP run's accountant is asked
    first: PrivacyBudgetExhausted when the budget cannot pay for the round."""
    spec, number = info.spec, info.round + 1
    if len(active) < spec.min_clients:
        log.info(
            "run %s: %d of %d peers active; round %d waits",
            info.name,
            len(active),
            spec.min_clients,
            number,
        )
        return None
    size, secret = spec.sample_size(len(active)), spec.dp_clip is not None
    selected = sample_peers(active, size, spec.seed, number, secret=secret)
    privacy.before_round(info, number, len(selected), len(active))
    return selected


def round_spec(
    info: RunInfo, expected: int, timeout_s: float | None, layout: Layout
) -> tuple[RoundSpec, bool]:
    """The coordinator's spec of round ``info.round`` (``expected`` contributions, the
    deadline ``timeout_s`` already chosen), and whether it is a secure round (then
    RunSecurity completes it and owns its deadlines: no coordinator deadline)."""
    spec = info.spec
    sync = spec.mode is RunMode.SYNC
    quorum = spec.quorum_of(expected) if sync else expected
    secure = is_secure(spec)
    built = RoundSpec(
        expected,
        quorum=quorum,
        timeout_s=None if secure or not sync else timeout_s,
        strategy="mean" if is_private(spec) or secure else spec.strategy,
        params=spec.params,
        layout=layout,
    )
    return built, secure
