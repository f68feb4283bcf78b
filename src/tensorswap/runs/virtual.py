"""VirtualRuns: the runs requests of many virtual peers, batched over a VirtualClients' pool.

Each virtual peer stays a peer of its own for the coordinator's registry, sampling and
journal; what is shared is the connection and the request: a ``register_many`` of 10,000
peers is ten ``register_batch`` requests (journaled in as many transactions at most), a
round's tasks for every sampled peer one ``task_batch``, their contributions one push and
one ``contribute_batch`` (``runs.batch``). With per-peer keys in the pool
(``VirtualClients(keys=...)``) each contribution carries its peer's proof.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgspec

from tensorswap.cid import Cid
from tensorswap.rounds.client import PeerSubmit, RoundClient, Update, VirtualClients
from tensorswap.rounds.core import RoundId, RoundStatus
from tensorswap.rounds.protocol import raise_remote
from tensorswap.runs.batch import (
    APP_BATCH,
    MAX_RUN_BATCH,
    ContributeBatchRequest,
    ContributeItem,
    RegisterBatchRequest,
    RegisterItem,
    RunBatchAnswer,
    RunBatchRequest,
    RunItemResult,
    TaskBatchRequest,
    encode_batch,
)
from tensorswap.runs.manager import Task
from tensorswap.runs.model import Param, RunMode
from tensorswap.wire import ProtocolViolation, RemoteError

__all__ = ["RunContribution", "VirtualRuns"]

_answer_decoder = msgspec.msgpack.Decoder(RunBatchAnswer)


@dataclass(frozen=True, slots=True)
class RunContribution:
    """One virtual peer's contribution for its ``task``: the update as it is sent (for a DP
    run, the delta from the task's model; ``clipped``: the clip bit of client-side
    clipping), and its sample count."""

    peer: str
    task: Task
    update: Update
    num_samples: int = 0
    clipped: bool | None = None


class VirtualRuns:
    """Runs requests for the virtual peers of ``pool``, batched (see the module docstring).

    Results come per item, in order: a value, or the error that refused that item alone
    (``NotRegistered``, ``NotSelected``, ``PeerNotAuthorised``, ...). A request refused as a
    whole (an unknown run) raises. Batches use the pool's submit connections in turn; a
    ``tasks`` call that waits uses its reader connection.
    """

    def __init__(self, pool: VirtualClients, *, max_batch: int = MAX_RUN_BATCH) -> None:
        if not 0 < max_batch <= MAX_RUN_BATCH:
            raise ValueError(f"max_batch must be 1 to {MAX_RUN_BATCH}, got {max_batch}")
        self.pool = pool
        self.max_batch = max_batch

    async def register_many(
        self, peers: Sequence[str] | Mapping[str, Mapping[str, Param]]
    ) -> list[Exception | None]:
        """Register every peer (with its facts, given a mapping); per peer None once its
        registration is durable, or what refused it."""
        items = (
            [RegisterItem(p, dict(f)) for p, f in peers.items()]
            if isinstance(peers, Mapping)
            else [RegisterItem(p) for p in peers]
        )
        parts = [items[i : i + self.max_batch] for i in range(0, len(items), self.max_batch)]
        answers = await asyncio.gather(
            *(self._call(self._next(), RegisterBatchRequest(items=part)) for part in parts)
        )
        return [
            _error_of(result)
            for answer, part in zip(answers, parts, strict=True)
            for result in _results(answer, len(part))
        ]

    async def tasks(
        self, run: str, peers: Sequence[str], *, timeout: float | None = 0
    ) -> list[Task | Exception | None]:
        """Each peer's task in ``run`` now (None: none for it). With ``timeout`` > 0 (None:
        the coordinator's ``max_wait``), a batch that finds none waits until one of its
        peers has one or the run finishes, on the pool's reader connection."""
        parts = [list(peers[i : i + self.max_batch]) for i in range(0, len(peers), self.max_batch)]
        client = self.pool.reader if timeout != 0 else None
        answers = await asyncio.gather(
            *(
                self._call(
                    client or self._next(),
                    TaskBatchRequest(run=run, peers=part, timeout=timeout),
                    long=timeout != 0,
                )
                for part in parts
            )
        )
        out: list[Task | Exception | None] = []
        for answer, part in zip(answers, parts, strict=True):
            for result in _results(answer, len(part)):
                error = _error_of(result)
                if error is not None:
                    out.append(error)
                elif result.task is None:
                    out.append(None)
                else:
                    t = result.task
                    rid = RoundId(t.round, t.run)
                    out.append(
                        Task(
                            t.run,
                            rid,
                            t.version,
                            Cid.parse(t.global_cid),
                            RunMode(t.mode),
                            t.dp,
                            t.clip,
                        )
                    )
        return out

    async def contribute_many(
        self, items: Sequence[RunContribution]
    ) -> list[RoundStatus | Exception]:
        """Contribute every item (its update pushed first: only the blocks the coordinator
        lacks); per item the round's status once durable, or what refused it."""
        out: list[RoundStatus | Exception | None] = [None] * len(items)
        by_run: dict[str, list[int]] = {}
        for index, item in enumerate(items):
            by_run.setdefault(item.task.run, []).append(index)
        sends = []
        for run, indexes in by_run.items():
            for start in range(0, len(indexes), self.max_batch):
                part = indexes[start : start + self.max_batch]
                sends.append(self._contribute(run, [items[i] for i in part], part, out))
        await asyncio.gather(*sends)
        return [o if o is not None else ProtocolViolation("no result") for o in out]

    async def _contribute(
        self,
        run: str,
        items: list[RunContribution],
        indexes: list[int],
        out: list[RoundStatus | Exception | None],
    ) -> None:
        pool = self.pool
        submits = [PeerSubmit(i.peer, i.update, i.num_samples) for i in items]
        cids = await asyncio.to_thread(pool._put, submits)
        closure = await asyncio.to_thread(pool._closure, cids)
        wire = [
            ContributeItem(
                item.peer,
                item.task.round_id.round,
                cid.to_bytes(),
                item.task.version,
                item.clipped,
                pool._proof(RoundId(item.task.round_id.round, run), item.peer, cid),
            )
            for item, cid in zip(items, cids, strict=True)
        ]
        client = self._next()
        async with client._lock:
            lacking = await client.blocks.missing(closure)
            if lacking:
                await client.blocks.put_blocks(pool.store, lacking)
            answer = await self._request(
                client, ContributeBatchRequest(run=run, items=wire), long=True
            )
        for index, result in zip(indexes, _results(answer, len(items)), strict=True):
            error = _error_of(result)
            if error is not None:
                out[index] = error
            elif result.status is not None:
                out[index] = result.status.to_status()
            else:
                out[index] = ProtocolViolation("a contribution's result holds no status")

    # ── one request ──────────────────────────────────────────────────────────
    def _next(self) -> RoundClient:
        return next(self.pool._turn)

    async def _call(
        self, client: RoundClient, call: RunBatchRequest, *, long: bool = False
    ) -> RunBatchAnswer:
        async with client._lock:
            return await self._request(client, call, long=long)

    async def _request(
        self, client: RoundClient, call: RunBatchRequest, *, long: bool
    ) -> RunBatchAnswer:
        return await request_batch(client, call, long=long)


async def request_batch(
    client: RoundClient, call: RunBatchRequest, *, long: bool
) -> RunBatchAnswer:
    """One batched runs request on ``client``'s connection (the caller holds its lock); the
    whole request's refusal raised, typed; ``long``: no read timeout (a waiting request)."""
    try:
        body = await client.blocks.request(
            APP_BATCH, encode_batch(call), timeout=None if long else "read"
        )
    except RemoteError as exc:
        if exc.code == "unsupported":
            peer = client.blocks.conn.peer
            raise ProtocolViolation(f"{peer} takes no batched runs requests") from exc
        raise
    try:
        answer = _answer_decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise ProtocolViolation(f"bad runs batch answer: {exc}") from exc
    if answer.error is not None:
        raise_remote(answer.error, client.blocks.conn.peer)
    return answer


def _results(answer: RunBatchAnswer, expected: int) -> list[RunItemResult]:
    if len(answer.results) != expected:
        raise ProtocolViolation(
            f"a runs batch answered {len(answer.results)} results for {expected} items"
        )
    return answer.results


def _error_of(result: RunItemResult) -> Exception | None:
    if result.error is None:
        return None
    try:
        raise_remote(result.error, "")
    except Exception as exc:
        return exc
    return None  # pragma: no cover - raise_remote always raises
