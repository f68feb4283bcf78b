"""What a RoundClient's calls answer: a submit's result and the coordinator's status."""

from __future__ import annotations

from dataclasses import dataclass

from tensorswap.cid import Cid
from tensorswap.rounds.core.state import RoundStatus
from tensorswap.rounds.protocol import RoundRow
from tensorswap.wire import PushResult

__all__ = ["ServerStatus", "SubmitResult"]


@dataclass(frozen=True, slots=True)
class SubmitResult:
    """What a submit did: the update's CID, the round's status after it, the transfer."""

    cid: Cid
    status: RoundStatus
    push: PushResult


@dataclass(frozen=True, slots=True)
class ServerStatus:
    """Every round the coordinator holds, and its counters.

    Each row's ``status`` is a typed wire status (``row.status.to_status()`` is the
    RoundStatus; ``row.status["status"]`` its name, as when it was a dict). ``omitted``
    counts the rounds the coordinator left out to keep its answer within its message limit
    (live rounds and the newest are listed first).
    """

    rounds: list[RoundRow]
    stats: dict[str, float | int | str]
    omitted: int = 0
