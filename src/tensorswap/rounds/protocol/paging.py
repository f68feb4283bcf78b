"""Paged status requests: rounds a page at a time, and a round's peers a page at a time.

``status`` with ``all`` lists every round with every peer in one answer; with 10,000 peers
in a round that is a large message, cut down to fit the message limit. ``rounds_page``
lists at most ``limit`` rounds from ``start`` (in round order), each with at most ``peers``
peer names (``received`` counts them all); ``peers_page`` lists one round's peers from
``start`` in acceptance order. Both answer ``total`` and ``next`` (the ``start`` of the next
page, left out on the last one). New ops: old requests and answers keep their bytes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from tensorswap.rounds.core.model import RoundId
from tensorswap.rounds.protocol.codec import APP, raise_remote
from tensorswap.rounds.protocol.messages import ErrorInfo, Param, RoundRow, _Request
from tensorswap.wire.errors import ProtocolViolation

if TYPE_CHECKING:  # the client layer sits above this one
    from tensorswap.rounds.client.client import RoundClient

__all__ = [
    "MAX_PAGE",
    "MAX_PEERS_PAGE",
    "PageAnswer",
    "PeersPageRequest",
    "RoundsPageRequest",
    "page_peers",
    "page_rounds",
]

MAX_PAGE = 1000
"""The most rounds one ``rounds_page`` answer lists, and peers it lists per round."""

MAX_PEERS_PAGE = 10_000
"""The most peer names one ``peers_page`` answer lists."""


def _check_range(start: int, limit: int, most: int, what: str) -> None:
    if start < 0:
        raise ValueError(f"a {what} request's start must be >= 0, got {start}")
    if not 0 < limit <= most:
        raise ValueError(f"a {what} request's limit must be 1 to {most}, got {limit}")


class RoundsPageRequest(_Request, frozen=True, omit_defaults=True, tag="rounds_page"):
    """Rounds ``start`` .. ``start + limit`` in round order, each with at most ``peers``
    peer names, and (with ``stats``) the server's counters."""

    start: int = 0
    limit: int = 100
    peers: int = 0
    stats: bool = False

    def __post_init__(self) -> None:
        _check_range(self.start, self.limit, MAX_PAGE, "rounds_page")
        if not 0 <= self.peers <= MAX_PAGE:
            raise ValueError(f"a rounds_page request's peers must be 0 to {MAX_PAGE}")


class PeersPageRequest(_Request, frozen=True, omit_defaults=True, tag="peers_page"):
    """The round's peers ``start`` .. ``start + limit`` in acceptance order."""

    start: int = 0
    limit: int = 1000

    def __post_init__(self) -> None:
        self._check_round_id()
        _check_range(self.start, self.limit, MAX_PEERS_PAGE, "peers_page")


class PageAnswer(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=False):
    """The answer to a paged request: ``rounds`` (rounds_page) or ``peers`` (peers_page),
    ``total`` items there are, ``next`` start of the following page (None on the last)."""

    error: ErrorInfo | None = None
    rounds: list[RoundRow] = []
    peers: list[str] = []
    total: int = 0
    next: int | None = None
    stats: dict[str, Param] = {}


def next_start(start: int, shown: int, total: int) -> int | None:
    """Where the page after one of ``shown`` items from ``start`` begins; None past the end."""
    after = start + shown
    return after if after < total else None


_encoder = msgspec.msgpack.Encoder()
_page_decoder = msgspec.msgpack.Decoder(PageAnswer)


async def _page(client: RoundClient, request: RoundsPageRequest | PeersPageRequest) -> PageAnswer:
    async with client._lock:
        body = await client.blocks.request(APP, _encoder.encode(request), timeout="read")
    try:
        answer = _page_decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise ProtocolViolation(f"bad page answer: {exc}") from exc
    if answer.error is not None:
        raise_remote(answer.error, client.blocks.conn.peer)
    return answer


async def page_rounds(
    client: RoundClient, start: int = 0, limit: int = 100, *, peers: int = 0, stats: bool = False
) -> PageAnswer:
    """One page of the coordinator's rounds (``rounds_page``): ``limit`` rounds from
    ``start`` with at most ``peers`` peer names each; ``next`` is the next page's start."""
    request = RoundsPageRequest(start=start, limit=limit, peers=peers, stats=stats)
    return await _page(client, request)


async def page_peers(
    client: RoundClient, round_id: RoundId, start: int = 0, limit: int = 1000
) -> PageAnswer:
    """One page of the round's peers in acceptance order (``peers_page``)."""
    request = PeersPageRequest(
        round=round_id.round, initiator=round_id.initiator, start=start, limit=limit
    )
    return await _page(client, request)
