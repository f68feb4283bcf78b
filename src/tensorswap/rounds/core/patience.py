"""How long pacing waits for progress before it gives up: the rule both cut-through pacers
share (the coordinator's, ``rounds.engine._cut_pace``, and each peer's upload gate,
``rounds.client._cut_gate``)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PATIENCE_FACTOR", "Patience"]

PATIENCE_FACTOR = 4.0
"""Patience is this many times the longest gap between two signs of progress seen so far."""


@dataclass(slots=True)
class Patience:
    """When progress last came and the longest gap between two signs of it: a wait gives up
    once none has come for ``max(min_patience, PATIENCE_FACTOR x longest)`` seconds."""

    last: float | None = None
    """When progress last came (or, before any, when the first wait began)."""
    longest: float = 0.0

    def progressed(self, now: float) -> None:
        """Progress came at ``now``."""
        if self.last is not None:
            self.longest = max(self.longest, now - self.last)
        self.last = now

    def left(self, now: float, min_patience: float) -> tuple[float, float]:
        """``(seconds left before a wait gives up, the patience)`` at ``now``; the first
        call starts the count if no progress came yet."""
        if self.last is None:
            self.last = now
        patience = max(min_patience, PATIENCE_FACTOR * self.longest)
        return self.last + patience - now, patience
