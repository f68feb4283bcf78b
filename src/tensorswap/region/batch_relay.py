"""BatchRelay: a regional coordinator's ``runs/batch`` app (register, task and contribute
batches of virtual peers): relayed to the top, or folded here for a round the region folds."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

import msgspec

from tensorswap.cid import Cid
from tensorswap.errors import TensorSwapError
from tensorswap.region.errors import SecureRunThroughRegion
from tensorswap.region.link import UpstreamLink
from tensorswap.region.runs_fold import RunFolds
from tensorswap.rounds.core import RoundId, RoundStatus
from tensorswap.rounds.protocol import error_info, status_to_wire
from tensorswap.rounds.server import RoundServer
from tensorswap.runs.batch import (
    APP_BATCH,
    ContributeBatchRequest,
    ContributeItem,
    RegisterBatchRequest,
    RegisterItem,
    RunBatchAnswer,
    RunBatchRequest,
    RunItemResult,
    TaskBatchRequest,
    decode_batch,
    encode_batch,
)
from tensorswap.runs.messages import TaskWire
from tensorswap.runs.regional import REGION_FACT
from tensorswap.wire import AppRequest, ProtocolViolation

__all__ = ["BatchRelay"]

log = logging.getLogger(__name__)

_answer_decoder = msgspec.msgpack.Decoder(RunBatchAnswer)


class BatchRelay:
    """The ``runs/batch`` app of a regional coordinator, as ``RunsProxy`` is its ``runs``.

    Guarantees:

    - ``register_batch`` goes up as one request (each peer tagged with the region's name
      when the region folds, as a single ``register`` is).
    - ``task_batch`` goes up as one request; every task's global model is pulled into the
      region's store first (once per version); a task of a round folded here starts that
      round here, and is answered as none for a peer whose update the region holds (the
      batch then waits for the round to move on, within its timeout, when no peer of it
      has a task); a secure run's task is refused per item (SecureRunThroughRegion).
    - ``contribute_batch``: the items for a round folded here are submitted to the
      region's coordinator (one transaction per round, journaled before the answer); the
      others go up as one batch after their updates' blocks (only what the top lacks).
      Results come per item, in the request's order.
    """

    def __init__(
        self,
        link: UpstreamLink,
        server: RoundServer,
        folds: RunFolds | None,
        read_timeout: Callable[[], float],
        pull: Callable[[Sequence[TaskWire]], Awaitable[None]],
    ) -> None:
        self.link, self.server, self.folds = link, server, folds
        self._read_timeout, self._pull = read_timeout, pull
        server.blocks.handlers[APP_BATCH] = self._on_request

    async def _on_request(self, request: AppRequest) -> bytes:
        call = decode_batch(request.body)  # ProtocolViolation: the connection fails
        try:
            match call:
                case RegisterBatchRequest():
                    answer = await self._relay(self._tagged(call))
                case TaskBatchRequest():
                    answer = await self._tasks(call)
                case ContributeBatchRequest():
                    answer = await self._contribute(call)
        except ProtocolViolation as exc:  # from the upstream's answer: this peer did no wrong
            answer = RunBatchAnswer(error=error_info(ProtocolViolation(f"upstream: {exc}")))
        except TensorSwapError as exc:
            answer = RunBatchAnswer(error=error_info(exc))
        return encode_batch(answer)

    def _tagged(self, call: RegisterBatchRequest) -> RegisterBatchRequest:
        if self.folds is None:
            return call
        region = self.link.region
        items = [RegisterItem(i.peer, {**i.facts, REGION_FACT: region}) for i in call.items]
        return RegisterBatchRequest(items=items)

    async def _relay(
        self, call: RunBatchRequest, *, push: Sequence[Cid] = (), wait: float = 0.0
    ) -> RunBatchAnswer:
        timeout = wait + self._read_timeout()
        body = await self.link.relay(APP_BATCH, encode_batch(call), push=push, timeout=timeout)
        try:
            answer = _answer_decoder.decode(body)
        except msgspec.DecodeError as exc:  # ValidationError included
            raise ProtocolViolation(f"bad runs batch answer: {exc}") from exc
        expected = _items(call)
        if answer.error is None and len(answer.results) != expected:
            raise ProtocolViolation(f"{len(answer.results)} results for {expected} items")
        return answer

    # ── tasks ────────────────────────────────────────────────────────────────
    async def _tasks(self, call: TaskBatchRequest) -> RunBatchAnswer:
        loop = asyncio.get_running_loop()
        max_wait = self.server.max_wait
        wait = max_wait if call.timeout is None else min(call.timeout, max_wait)
        until = loop.time() + wait
        while True:
            left = max(0.0, until - loop.time())
            asked = TaskBatchRequest(run=call.run, peers=call.peers, timeout=left)
            answer = await self._relay(asked, wait=left)
            if answer.error is not None:
                return answer
            await self._pull([r.task for r in answer.results if r.task is not None])
            results, held = await self._screen(call.peers, answer.results)
            if held is None or any(r.task is not None for r in results):
                return RunBatchAnswer(results=results)
            left = until - loop.time()
            if left <= 0:
                return RunBatchAnswer(results=results)
            assert self.folds is not None  # something was held
            await self.folds.wait_change(held, left)

    async def _screen(
        self, peers: Sequence[str], results: Sequence[RunItemResult]
    ) -> tuple[list[RunItemResult], TaskWire | None]:
        """Each result as the peer gets it, and a task that was held back (if any)."""
        out: list[RunItemResult] = []
        held: TaskWire | None = None
        for peer, result in zip(peers, results, strict=True):
            task = result.task
            if task is not None and task.secagg:
                out.append(RunItemResult(error=error_info(SecureRunThroughRegion(task.run))))
                continue
            if task is not None and self.folds is not None:
                await self.folds.prepare(task)
                if self.folds.held(peer, task):
                    out.append(RunItemResult())
                    held = task
                    continue
            out.append(result)
        return out, held

    # ── contributions ────────────────────────────────────────────────────────
    async def _contribute(self, call: ContributeBatchRequest) -> RunBatchAnswer:
        results: list[RunItemResult | None] = [None] * len(call.items)
        here: dict[RoundId, list[int]] = {}
        up: list[int] = []
        coordinator = self.server.coordinator
        for index, item in enumerate(call.items):
            rid = RoundId(item.round, call.run)
            folded = self.folds is not None and self.folds.covers(rid) is not None
            if folded and coordinator.info(rid) is not None:
                here.setdefault(rid, []).append(index)
            else:
                up.append(index)
        jobs = [self._submit_here(rid, call.items, idx, results) for rid, idx in here.items()]
        if up:
            jobs.append(self._submit_up(call, up, results))
        await asyncio.gather(*jobs)
        return RunBatchAnswer(results=[r or _no_result() for r in results])

    async def _submit_here(
        self,
        rid: RoundId,
        items: Sequence[ContributeItem],
        indexes: list[int],
        results: list[RunItemResult | None],
    ) -> None:
        keys = self.server.peer_keys
        pairs: list[tuple[str, Cid]] = []
        todo: list[int] = []
        for index in indexes:
            item = items[index]
            try:
                cid = Cid.parse(item.update)
                if keys is not None:
                    keys.check(rid, item.peer, cid, item.proof)
            except TensorSwapError as exc:
                results[index] = RunItemResult(error=error_info(exc))
                continue
            pairs.append((item.peer, cid))
            todo.append(index)
        if not pairs:
            return
        submit_many = self.server.coordinator.submit_many
        outcomes = await asyncio.to_thread(submit_many, rid, pairs)
        for index, outcome in zip(todo, outcomes, strict=True):
            results[index] = _result(outcome)

    async def _submit_up(
        self, call: ContributeBatchRequest, indexes: list[int], results: list[RunItemResult | None]
    ) -> None:
        items = [call.items[i] for i in indexes]
        pushes = list(dict.fromkeys(Cid.parse(i.update) for i in items))
        try:
            answer = await self._relay(
                ContributeBatchRequest(run=call.run, items=items),
                push=pushes,
                wait=self.server.max_wait,
            )
        except TensorSwapError as exc:
            answer = RunBatchAnswer(error=error_info(exc))
        if answer.error is not None:  # refused as a whole: each item hears why
            for index in indexes:
                results[index] = RunItemResult(error=answer.error)
            return
        for index, got in zip(indexes, answer.results, strict=True):
            results[index] = got


def _items(call: RunBatchRequest) -> int:
    if isinstance(call, TaskBatchRequest):
        return len(call.peers)
    return len(call.items)


def _result(outcome: RoundStatus | Exception) -> RunItemResult:
    if isinstance(outcome, TensorSwapError):
        return RunItemResult(error=error_info(outcome))
    if isinstance(outcome, Exception):
        raise outcome
    return RunItemResult(status=status_to_wire(outcome))


def _no_result() -> RunItemResult:
    return RunItemResult(error=error_info(ProtocolViolation("no result for this item")))
