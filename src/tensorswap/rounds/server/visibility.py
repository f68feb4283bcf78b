"""Which rounds' peer names a connection may see: a DP run's sample is secret from peers.

A service registers a test per kind of round it hides (the runs service: a DP run's
rounds); the round server then answers a peer's ``status`` and page requests with those
rounds' rows stripped of names (``RoundRow.hidden``; ``received`` still counts them) and
refuses their peers page (``SampleHidden``). A connection that proved the operator key
(``AppRequest.operator``) is shown everything.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from tensorswap.rounds.core.state import RoundId
from tensorswap.rounds.protocol.messages import RoundRow

__all__ = ["Visibility"]


class Visibility:
    """The tests, in the order added; a round is hidden when any of them says so."""

    def __init__(self) -> None:
        self._tests: list[Callable[[RoundId], bool]] = []

    def add(self, hides: Callable[[RoundId], bool]) -> None:
        """Hide the peer names of every round ``hides(round_id)`` is true for."""
        self._tests.append(hides)

    def hides(self, round_id: RoundId) -> bool:
        return any(test(round_id) for test in self._tests)

    def rows(self, rows: list[RoundRow]) -> list[RoundRow]:
        """``rows`` as a peer may see them: a hidden round's without its peer names."""
        if not self._tests:
            return rows
        return [
            msgspec.structs.replace(row, peers=[], dropped=[], hidden=True)
            if self.hides(RoundId(row.round, row.initiator))
            else row
            for row in rows
        ]
