"""Requests waiting on the event loop for news of a round (a ``wait``, a result stream)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from tensorswap.rounds.core.state import RoundId

__all__ = ["Waiters"]


class Waiters:
    """Per round, the events of the requests waiting for it (loop thread only)."""

    def __init__(self) -> None:
        self._by_round: dict[RoundId, set[asyncio.Event]] = {}

    def __contains__(self, round_id: object) -> bool:
        return round_id in self._by_round

    @contextlib.contextmanager
    def waiting(self, round_id: RoundId) -> Iterator[asyncio.Event]:
        """An event ``wake(round_id)`` sets while the block runs; forgotten after it."""
        event = asyncio.Event()
        self._by_round.setdefault(round_id, set()).add(event)
        try:
            yield event
        finally:
            waiting = self._by_round.get(round_id)
            if waiting is not None:
                waiting.discard(event)
                if not waiting:
                    del self._by_round[round_id]

    def wake(self, round_id: RoundId) -> None:
        for event in self._by_round.get(round_id, ()):
            event.set()
