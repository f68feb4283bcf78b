"""RunsProxy: a regional coordinator relays its peers' runs requests to the top coordinator,
where runs, sampling and the server optimizer live, and forwards each global model."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import msgspec

from tensorswap.cid import Cid
from tensorswap.errors import TensorSwapError
from tensorswap.region.batch_relay import BatchRelay
from tensorswap.region.errors import SecureRunThroughRegion
from tensorswap.region.journal import RegionJournal
from tensorswap.region.link import UpstreamLink
from tensorswap.region.runs_fold import RunFolds
from tensorswap.rounds.core import RoundId
from tensorswap.rounds.protocol import APP as ROUNDS_APP
from tensorswap.rounds.protocol import (
    APP_INLINE,
    RoundAnswer,
    StatusRequest,
    SubmitRequest,
    WaitRequest,
    decode_call,
    decode_inline,
    encode_answer,
    encode_call,
    error_info,
    inline_blocks,
    put_blocks,
    reserve_inline,
)
from tensorswap.rounds.server import RoundServer
from tensorswap.runs.messages import APP as RUNS_APP
from tensorswap.runs.messages import (
    ContributeRequest,
    CreateRunRequest,
    RegisterRequest,
    RunAnswer,
    RunsRequest,
    SecAggRequest,
    TaskRequest,
    TaskWire,
    decode_answer,
    decode_request,
    encode,
)
from tensorswap.runs.regional import REGION_FACT
from tensorswap.wire import AppRequest, ProtocolViolation

__all__ = ["RunsProxy"]

log = logging.getLogger(__name__)


class RunsProxy:
    """The ``"runs"`` app of a regional coordinator, relayed through ``link``.

    Guarantees:

    - Every runs request of a peer (register, heartbeat, create, runs, versions, task,
      contribute) is checked as the top would check it, then relayed to the top under the
      peer's own name, and the top's answer (or refusal) comes back unchanged: the top's
      registry, sampling, deadlines, DP and server optimizer decide everything.
    - Blocks a request names (a new run's initial model, a contributed update), which the
      peer pushed to the region, are pushed upstream first (only what the top lacks).
    - A task's global model, and the current one of a run asked for by name, is pulled into
      the region's store before the answer goes back, once per version per region: the
      region's peers fetch it from the region (``RunClient.fetch_model``).
    - With ``journal`` (the tier's), a registration is relayed with the fact ``region`` =
      the region's name upstream: the top then knows which of its sampled peers this
      region folds (``runs.regional``), and a sync FedAvg run's round is folded here
      (``RunFolds``): the covered peers submit to the region's own round, one fold goes
      up (``RegionalTier``), and a covered peer whose update is in is not handed the same
      round's task again. Without it, or for runs that do not fold (async, DP, robust
      strategies), a rounds request (submit, wait, status) naming a round the region does
      not hold, whose initiator is a run at the top, is relayed: each such contribution
      travels upstream on its own.
    - The batched ops of virtual peers (``runs/batch``) are relayed, or folded, the same
      way (``BatchRelay``).
    - A secure (SecAgg+) run is refused here (SecureRunThroughRegion): masks do not
      compose through a region that would have to unmask.
    """

    def __init__(
        self, link: UpstreamLink, server: RoundServer, journal: RegionJournal | None = None
    ) -> None:
        self.link = link
        self.server = server
        self.folds = None if journal is None else RunFolds(link, server.coordinator, journal)
        self.batch = BatchRelay(link, server, self.folds, self._read_timeout, self._pull)
        self._local_rounds = server.blocks.handlers[ROUNDS_APP]
        self._runs: set[str] = set()  # names the top answered for: their rounds are the top's
        server.blocks.handlers[RUNS_APP] = self._on_runs
        server.blocks.handlers[ROUNDS_APP] = self._on_rounds
        self._local_inline = server.blocks.handlers[APP_INLINE]
        server.blocks.handlers[APP_INLINE] = self._on_inline

    # ── the runs app ─────────────────────────────────────────────────────────
    async def _on_runs(self, request: AppRequest) -> bytes:
        try:
            call = decode_request(request.body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProtocolViolation(f"bad runs request: {exc}") from exc
        except RecursionError:
            raise ProtocolViolation("bad runs request: nested too deeply") from None
        push: Cid | None = None
        timeout: float | None = None
        match call:
            case SecAggRequest():
                return encode(RunAnswer(error=error_info(SecureRunThroughRegion(call.run))))
            case RegisterRequest() if self.folds is not None:  # the top: folded here
                facts = {**call.facts, REGION_FACT: self.link.region}
                call = RegisterRequest(peer=call.peer, facts=facts)
            case CreateRunRequest():
                push = Cid.parse(call.initial)
            case ContributeRequest():
                push = Cid.parse(call.update)
            case TaskRequest():
                return await self._task(call)
        try:
            reply = await self.link.relay(RUNS_APP, encode(call), push=push, timeout=timeout)
            answer = decode_answer(reply)
            await self._forward_models(call, answer)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return encode(RunAnswer(error=error_info(ProtocolViolation(f"upstream: {exc}"))))
        except TensorSwapError as exc:
            return encode(RunAnswer(error=error_info(exc)))
        return reply

    async def _task(self, call: TaskRequest) -> bytes:
        """A long poll relayed (the top's own max_wait ends it); a task of a round folded
        here is started here first, and held while the region has the peer's update."""
        loop = asyncio.get_running_loop()
        asked = self.server.max_wait if call.timeout is None else call.timeout
        until = loop.time() + min(asked, self.server.max_wait)
        try:
            while True:
                timeout = max(0.0, until - loop.time()) + self._read_timeout()
                reply = await self.link.relay(RUNS_APP, encode(call), timeout=timeout)
                answer = decode_answer(reply)
                await self._forward_models(call, answer)
                task = answer.task
                if task is None or answer.error is not None:
                    return reply
                if task.secagg:
                    refusal = SecureRunThroughRegion(task.run)
                    return encode(RunAnswer(error=error_info(refusal)))
                if self.folds is None:
                    return reply
                await self.folds.prepare(task)
                if not self.folds.held(call.peer, task):
                    return reply
                left = until - loop.time()
                if left <= 0:
                    return encode(RunAnswer())  # no task in time
                await self.folds.wait_change(task, left)
                left = max(0.0, until - loop.time())
                call = TaskRequest(peer=call.peer, run=call.run, timeout=left)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return encode(RunAnswer(error=error_info(ProtocolViolation(f"upstream: {exc}"))))
        except TensorSwapError as exc:
            return encode(RunAnswer(error=error_info(exc)))

    async def _forward_models(self, call: object, answer: RunAnswer) -> None:
        if answer.error is not None:
            return
        wanted: list[str] = []
        if answer.task is not None:
            self._runs.add(answer.task.run)
            wanted.append(answer.task.global_cid)
        if isinstance(call, RunsRequest) and call.run:
            for row in answer.runs or []:
                self._runs.add(row.name)
                wanted.append(row.global_cid)
        for cid in wanted:
            await self.link.fetch(Cid.parse(cid))  # only the blocks the region lacks

    async def _pull(self, tasks: Sequence[TaskWire]) -> None:
        """The global models of ``tasks`` (a batch's) into the region's store, each once."""
        for task in tasks:
            self._runs.add(task.run)
        for cid in dict.fromkeys(task.global_cid for task in tasks):
            await self.link.fetch(Cid.parse(cid))

    # ── the rounds app: a run's rounds are the top's ─────────────────────────
    async def _on_rounds(self, request: AppRequest) -> bytes:
        call = decode_call(request.body)
        match call:
            case SubmitRequest() | WaitRequest() | StatusRequest(all=False):
                rid = RoundId(call.round, call.initiator)
            case _:
                return await self._local_rounds(request)
        if self.server.coordinator.info(rid) is not None or not await self._is_run(rid):
            return await self._local_rounds(request)
        push = Cid.parse(call.update) if isinstance(call, SubmitRequest) else None
        timeout = None
        if isinstance(call, WaitRequest):
            asked = self.server.max_wait if call.timeout is None else call.timeout
            timeout = min(asked, self.server.max_wait) + self._read_timeout()
        try:
            return await self.link.relay(ROUNDS_APP, request.body, push=push, timeout=timeout)
        except TensorSwapError as exc:
            return encode_answer(RoundAnswer(error=error_info(exc)))

    async def _on_inline(self, request: AppRequest) -> bytes:
        """An inline submit to a run's round at the top: its blocks are checked and kept
        here, and the submit relayed as a plain one (the blocks pushed first)."""
        call = decode_inline(request.body)
        rid = call.round_id
        if self.server.coordinator.info(rid) is not None or not await self._is_run(rid):
            return await self._local_inline(request)
        submit = SubmitRequest(
            round=rid.round, initiator=rid.initiator, peer=call.peer, update=call.update
        )
        # the blocks' bytes count in the wire's in-flight budget, as for a local inline submit
        with await reserve_inline(self.server.blocks.budget, call):
            await asyncio.to_thread(put_blocks, self.server.store, inline_blocks(call))
            try:
                return await self.link.relay(ROUNDS_APP, encode_call(submit), push=call.cid)
            except TensorSwapError as exc:
                return encode_answer(RoundAnswer(error=error_info(exc)))

    async def _is_run(self, rid: RoundId) -> bool:
        """Whether the top holds a run named ``rid.initiator`` (remembered once seen)."""
        if rid.initiator in self._runs:
            return True
        body = encode(RunsRequest(peer=self.link.region, run=rid.initiator))
        try:
            # one attempt: a peer's submit to a round not started here must not wait out
            # the link's patience when the upstream is down
            answer = decode_answer(await self.link.relay(RUNS_APP, body, once=True))
        except (TensorSwapError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.debug("round %s: no run upstream (%s)", rid, exc)
            return False
        if answer.error is None and answer.runs:
            self._runs.add(rid.initiator)
            return True
        return False

    def _read_timeout(self) -> float:
        return self.server.timeouts.read or 60.0
