"""The block service's coordinator aggregating replies it already holds: a round started for
them, their updates submitted (in batches by the strategy, or one by one by each node's mod as
it replies; no block moves), the aggregate's CID awaited."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from tensorswap.cid import Cid
from tensorswap.errors import RoundsError
from tensorswap.errors.flower import AggregateUnavailable
from tensorswap.rounds.client import RoundClient, request_submit_batch
from tensorswap.rounds.core import (
    Complete,
    DuplicateContribution,
    RoundAlreadyTerminal,
    RoundClosed,
    RoundId,
    RoundSpec,
)
from tensorswap.rounds.protocol import MAX_BATCH, BatchItem, BatchSubmitRequest
from tensorswap.wire import BlockClient, ProtocolViolation

__all__ = ["STRATEGY_PEER", "aggregate_held", "await_round", "open_round", "submit_held"]

STRATEGY_PEER = "flower-strategy"
"""The name the strategy's connection has as a rounds client (it submits for named peers)."""


async def aggregate_held(
    client: BlockClient,
    round_id: RoundId,
    entries: Sequence[tuple[str, Cid]],
    *,
    timeout: float,
    address: str,
) -> Cid:
    """The CID of the FedAvg aggregate of ``entries`` (peer name, root of an update the
    service holds, its weight the update's ``num_samples``), computed by the service's
    coordinator in round ``round_id``: every peer expected, folded in peer-name order
    (deterministic: its bits depend on the updates only), failed by its deadline
    ``timeout`` if it cannot complete. Called again after a broken connection it joins the
    same round, and a contribution it made before counts as made (the round refuses it as
    a duplicate of the same update). AggregateUnavailable when the service has no
    coordinator, refuses a contribution (a layout that differs, a value not finite, a
    block it lost) or the round fails or times out; wire failures are raised as they are."""
    await open_round(client, round_id, len(entries), timeout=timeout, address=address)
    rounds = RoundClient(client, peer=STRATEGY_PEER)
    with _unavailable(round_id, address):
        for at in range(0, len(entries), MAX_BATCH):
            await _submit(rounds, round_id, entries[at : at + MAX_BATCH], address)
    return await await_round(client, round_id, timeout=timeout, address=address)


async def open_round(
    client: BlockClient, round_id: RoundId, expected: int, *, timeout: float, address: str
) -> None:
    """Start round ``round_id`` on the service's coordinator for ``expected`` peers (a
    deterministic FedAvg: folded in peer-name order when the last arrives; failed at its
    deadline, ``timeout`` s from now, with fewer), or join it if it exists.
    AggregateUnavailable when the service has no coordinator or refuses the round."""
    spec = RoundSpec(expected_peers=expected, timeout_s=timeout, deterministic=True)
    with _unavailable(round_id, address):
        await RoundClient(client, peer=STRATEGY_PEER).start_round(round_id, spec)


async def submit_held(
    client: BlockClient, round_id: RoundId, peer: str, cid: Cid, *, address: str
) -> str | None:
    """Submit the update ``cid`` the service holds to round ``round_id`` as ``peer``'s
    contribution; None once the round holds exactly that (accepted now, or on an earlier
    attempt), else why not (a refusal: another update under that name, the round closed,
    terminal or unknown). AggregateUnavailable when there is no coordinator."""
    rounds = RoundClient(client, peer=STRATEGY_PEER)
    request = BatchSubmitRequest(
        round=round_id.round,
        initiator=round_id.initiator,
        items=[BatchItem(peer, cid.to_bytes())],
    )
    with _unavailable(round_id, address):
        (result,) = await request_submit_batch(rounds, request)
    if not isinstance(result, Exception):
        return None
    if isinstance(result, DuplicateContribution) and getattr(result, "cid", None) == str(cid):
        return None
    return f"{type(result).__name__}: {result}"


async def await_round(
    client: BlockClient, round_id: RoundId, *, timeout: float, address: str
) -> Cid:
    """The CID of round ``round_id``'s aggregate once it is Complete (``timeout`` s at most).
    AggregateUnavailable when it failed, timed out or the service has no coordinator."""
    with _unavailable(round_id, address):
        status = await RoundClient(client, peer=STRATEGY_PEER).wait(round_id, timeout)
    if not isinstance(status, Complete):
        reason = getattr(status, "reason", None) or status.name
        raise AggregateUnavailable(
            round_id.as_key(), address, f"the round ended {status.name}: {reason}"
        )
    return Cid.parse(status.cid)


@contextlib.contextmanager
def _unavailable(round_id: RoundId, address: str) -> Iterator[None]:
    """The coordinator's refusals (and a plain block service's) as AggregateUnavailable."""
    key = round_id.as_key()
    try:
        yield
    except ProtocolViolation as exc:  # a plain block service: no coordinator
        raise AggregateUnavailable(key, address, str(exc)) from exc
    except RoundsError as exc:
        raise AggregateUnavailable(key, address, f"{type(exc).__name__}: {exc}") from exc


async def _submit(
    rounds: RoundClient, round_id: RoundId, entries: Sequence[tuple[str, Cid]], address: str
) -> None:
    request = BatchSubmitRequest(
        round=round_id.round,
        initiator=round_id.initiator,
        items=[BatchItem(peer, cid.to_bytes()) for peer, cid in entries],
    )
    results = await request_submit_batch(rounds, request)
    for (peer, cid), result in zip(entries, results, strict=True):
        if isinstance(result, Exception) and not _made_before(result, cid):
            raise AggregateUnavailable(
                round_id.as_key(), address, f"peer {peer!r}: {type(result).__name__}: {result}"
            )


def _made_before(refusal: Exception, cid: Cid) -> bool:
    """Whether a refused contribution was this very one made on an earlier attempt (the round
    holds it, or has stopped collecting because every contribution arrived)."""
    if isinstance(refusal, DuplicateContribution):
        return getattr(refusal, "cid", None) == str(cid)
    return isinstance(refusal, RoundClosed | RoundAlreadyTerminal)
