"""RoundViews: what a coordinator tells about its rounds (status, info, results, listeners),
read from its tracker; the half of ``Coordinator`` that changes nothing."""

from __future__ import annotations

from collections.abc import Callable

from tensorswap.cid import Cid
from tensorswap.rounds.core.errors import RoundFailed
from tensorswap.rounds.core.state import (
    Complete,
    Contribution,
    RoundId,
    RoundInfo,
    RoundStatus,
    RoundTracker,
)

__all__ = ["RoundViews"]


class RoundViews:
    """Reads of a ``tracker``'s rounds; a ``Coordinator`` is one (thread-safe, as the
    tracker is)."""

    tracker: RoundTracker

    def wait(self, round_id: RoundId, timeout: float | None = None) -> RoundStatus:
        """Block until the round is Complete or Failed (RoundTimeout, RoundNotFound)."""
        return self.tracker.wait(round_id, timeout)

    def result(self, round_id: RoundId, timeout: float | None = None) -> Cid:
        """Wait for the round and return its aggregate's CID; RoundFailed if it failed."""
        status = self.wait(round_id, timeout)
        if isinstance(status, Complete):
            return Cid.parse(status.cid)
        raise RoundFailed(round_id.as_key(), getattr(status, "reason", status.name))

    def status(self, round_id: RoundId) -> RoundStatus | None:
        return self.tracker.status(round_id)

    def info(self, round_id: RoundId) -> RoundInfo | None:
        return self.tracker.info(round_id)

    def rounds(self) -> list[RoundInfo]:
        return self.tracker.rounds()

    def contributions(self, round_id: RoundId) -> list[Contribution]:
        return self.tracker.contributions(round_id)

    def gc_before_round(self, round: int) -> int:
        """Forget terminal rounds numbered below ``round`` (their blocks stay in the store)."""
        return self.tracker.gc_before_round(round)

    def subscribe(self, listener: Callable[[RoundId, RoundStatus], None]) -> None:
        """Call ``listener(round_id, status)`` on every status change (from any thread)."""
        self.tracker.subscribe(listener)
