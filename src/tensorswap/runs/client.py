"""RunClient: a peer's side of a run (register, wait for a task, fetch the model, submit)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal, Self

import numpy as np

from tensorswap.cid import Cid
from tensorswap.errors import BlockNotFound
from tensorswap.privacy.delta import delta_from_store
from tensorswap.privacy.dp import clip_update, model_delta
from tensorswap.rounds.client import RoundClient, SubmitResult
from tensorswap.rounds.core import RoundId, RoundStatus
from tensorswap.rounds.protocol import raise_remote, submit_proof
from tensorswap.runs.batch import ContributeBatchRequest, ContributeItem
from tensorswap.runs.manager import Task
from tensorswap.runs.messages import (
    APP,
    MAX_VERSIONS,
    ContributeRequest,
    CreateRunRequest,
    HeartbeatRequest,
    RegisterRequest,
    RunAnswer,
    RunRequest,
    RunRow,
    RunsRequest,
    TaskRequest,
    VersionRow,
    VersionsRequest,
    decode_answer,
    encode,
)
from tensorswap.runs.model import RunMode, RunSpec
from tensorswap.runs.secure_peer import SecureTasks
from tensorswap.store import ModelUpdate, get_update, put_update
from tensorswap.wire import BlockClient, ProtocolViolation, RemoteError

if TYPE_CHECKING:
    from tensorswap.runs.secure_peer import SecureTasks

__all__ = ["RunClient"]


class RunClient:
    """A peer in runs on the coordinator ``rounds`` is connected to (a RoundClient: same
    connection, same store). Every call is one request the peer makes: peers only dial out.

    Any call may be cancelled at any await point (a timeout around ``next_task``, say): the
    next call gets its own answer, as for RoundClient (what a cancel leaves behind is said
    there). A task handed out to a cancelled ``next_task`` is handed out again while its
    round is current and it is not submitted; a cancelled ``submit`` may have been accepted.

    A peer's loop::

        async with await RunClient.connect(host, port, peer="site-3", key=key) as client:
            await client.register({"num_samples": 1200})
            while (task := await client.next_task("mnist")) is not None:
                model = await client.fetch_model(task)
                await client.submit(task, train(model), num_samples=1200)
    """

    def __init__(self, rounds: RoundClient) -> None:
        self.rounds = rounds
        rounds.cut.enabled = False  # a run's rounds never stream (RunManager.may_stream)
        self.secure_ahead = True
        """Whether a secure task's key phases begin as ``next_task`` hands it out (on a
        second connection; where ``rounds`` cannot dial one, ``submit`` runs them all), so
        they and the masks are done while the peer trains."""
        self._secure = SecureTasks(rounds, self._call, self.task_model)  # runs.secure_peer

    @classmethod
    async def connect(cls, host: str, port: int, **kwargs: Any) -> Self:
        """Connect as ``RoundClient.connect`` does (``peer=`` is required)."""
        return cls(await RoundClient.connect(host, port, **kwargs))

    @property
    def peer(self) -> str:
        return self.rounds.peer

    @property
    def secagg_quantized(self) -> np.ndarray | None:
        """This peer's last quantized input to a secure round, before masking (its own
        data, kept for audits and tests; it never leaves the peer)."""
        return self._secure.quantized

    async def aclose(self) -> None:
        try:
            await self._secure.aclose()
        finally:
            await self.rounds.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # ── registry ─────────────────────────────────────────────────────────────
    async def register(self, facts: Mapping[str, int | float | str] | None = None) -> int:
        """Register this peer (again: its facts are replaced); how many peers are active."""
        answer = await self._call(RegisterRequest(peer=self.peer, facts=dict(facts or {})))
        return answer.active or 0

    async def heartbeat(self) -> None:
        await self._call(HeartbeatRequest(peer=self.peer))

    # ── runs ─────────────────────────────────────────────────────────────────
    async def create_run(
        self, name: str, spec: RunSpec, initial: ModelUpdate | Mapping[str, Any] | Cid
    ) -> RunRow:
        """Push the initial global model and create run ``name`` (idempotent)."""
        cid = await self._push(initial)
        call = CreateRunRequest(
            peer=self.peer, run=name, spec=spec.to_json(), initial=cid.to_bytes()
        )
        answer = await self._call(call)
        return _one(answer)

    async def runs(self) -> list[RunRow]:
        return list((await self._call(RunsRequest(peer=self.peer))).runs or [])

    async def run(self, name: str) -> RunRow:
        return _one(await self._call(RunsRequest(peer=self.peer, run=name)))

    async def versions(
        self, run: str, since: int = 0, *, wait: float | None = None
    ) -> list[VersionRow]:
        """Every version of ``run`` from ``since`` on (participants, staleness, CIDs, time);
        long histories come in several requests. With ``wait``, when there is none yet,
        wait up to ``wait`` seconds for version ``since`` (a driver following a run): an
        empty list then means none came in time, or the run finished."""
        out: list[VersionRow] = []
        while True:
            call = VersionsRequest(peer=self.peer, run=run, since=since, wait=wait)
            answer = await self._call(call, long=wait is not None)
            got = answer.versions or []
            out.extend(got)
            if len(got) < MAX_VERSIONS:
                return out
            since, wait = got[-1].version + 1, None

    async def next_task(self, run: str, timeout: float | None = None) -> Task | None:
        """Wait for this peer's next task in ``run``: None when the run is finished or
        ``timeout`` seconds pass (None: wait as long as it takes, asking again each time the
        coordinator's own wait limit ends a request).

        A secure task's key phases begin now (``secure_ahead``); until it is submitted, the
        same task is handed out again while its round is the run's current one."""
        held = self._secure.held(run)
        if held is not None:
            if (await self.run(run)).round == held.round_id.round:
                return held
            self._secure.drop(run)
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        while True:
            left = (
                None if deadline is None else max(0.0, deadline - asyncio.get_running_loop().time())
            )
            answer = await self._call(TaskRequest(peer=self.peer, run=run, timeout=left), long=True)
            if answer.task is not None:
                t = answer.task
                rid = RoundId(t.round, t.run)
                mode = RunMode(t.mode)
                task = Task(
                    t.run, rid, t.version, Cid.parse(t.global_cid), mode, t.dp, t.clip, t.secagg
                )
                if task.secagg and self.secure_ahead and self.rounds.dial is not None:
                    self._secure.begin(task)
                return task
            if left is not None and left <= 0:
                return None
            if (await self.run(run)).finished:
                return None

    async def fetch_model(self, task: Task) -> dict[str, np.ndarray]:
        """The global model the task trains from (only blocks this peer lacks are pulled).

        In the client's own store it counts as the task's round's (``RoundClient.retention``:
        the latest two rounds' blocks are kept, older ones deleted)."""
        retention = self.rounds.retention
        if retention is not None:
            retention.begin()
        update = await self.rounds.fetch(task.global_cid)
        if retention is not None:
            retention.hold_root(task.round_id, task.global_cid)
        return dict(update.tensors)

    async def task_model(self, task: Task) -> dict[str, np.ndarray]:
        """The task's global model from this peer's own store when it is there already (it
        was verified when it was pulled), else fetched: the base a delta is taken from."""
        cid = task.global_cid
        try:
            return dict((await asyncio.to_thread(get_update, self.rounds.store, cid)).tensors)
        except BlockNotFound:
            return await self.fetch_model(task)

    async def submit(
        self, task: Task, update: ModelUpdate | Mapping[str, Any], num_samples: int = 0
    ) -> RoundStatus:
        """Submit this peer's result for ``task``: its new model (sync runs), or its delta
        from the task's model (async runs, tagged with the task's version).

        In a differentially private run ``update`` is the new model too: the delta from the
        task's model is computed here (and clipped to the task's norm with client-side
        clipping) and contributed with the clip bit.

        In a secure run (``task.secagg``) this runs SecAgg+ with the coordinator: the delta is
        quantized and masked here, and only the masked vector leaves the peer (see
        ``runs.secure_peer``); the coordinator learns the sum of the round's deltas only."""
        if task.secagg:
            return await self._secure.submit(task, update, num_samples)
        clipped: bool | None = None
        if task.dp:
            update, clipped = await self._dp_delta(task, update, num_samples)
        elif task.mode is RunMode.SYNC:
            result: SubmitResult = await self.rounds.submit(task.round_id, update, num_samples)
            return result.status
        cid = await self._push(update, num_samples, task.round_id)
        if self.rounds.peer_key is not None:
            return await self._contribute_proven(task, cid, clipped)
        call = ContributeRequest(
            peer=self.peer,
            run=task.run,
            round=task.round_id.round,
            update=cid.to_bytes(),
            trained_on=task.version,
            clipped=clipped,
        )
        answer = await self._call(call)
        if answer.status is None:
            raise ProtocolViolation("the coordinator's answer lacks a status")
        return answer.status.to_status()

    # ── internals ────────────────────────────────────────────────────────────
    async def _contribute_proven(self, task: Task, cid: Cid, clipped: bool | None) -> RoundStatus:
        """Contribute ``cid`` with this peer's proof, for a coordinator with per-peer keys: a
        one-item ``contribute_batch`` (the plain ``contribute`` op carries no proof)."""
        from tensorswap.runs.virtual import _error_of, _results, request_batch

        rc = self.rounds
        assert rc.peer_key is not None
        round_id = RoundId(task.round_id.round, task.run)
        item = ContributeItem(
            self.peer,
            round_id.round,
            cid.to_bytes(),
            task.version,
            clipped,
            submit_proof(rc.peer_key, round_id, self.peer, cid),
        )
        async with rc._lock:
            answer = await request_batch(
                rc, ContributeBatchRequest(run=task.run, items=[item]), long=True
            )
        (result,) = _results(answer, 1)
        error = _error_of(result)
        if error is not None:
            raise error
        if result.status is None:
            raise ProtocolViolation("the coordinator's answer lacks a status")
        return result.status.to_status()

    async def _dp_delta(
        self, task: Task, update: ModelUpdate | Mapping[str, Any], num_samples: int
    ) -> tuple[ModelUpdate, bool | None]:
        model = update if isinstance(update, ModelUpdate) else ModelUpdate(dict(update))
        # model-sized work off the event loop, where other peers' transfers run: the delta
        # from the task's model read chunk by chunk in the peer's store, else fetched whole
        store, cid = self.rounds.store, task.global_cid
        delta = await asyncio.to_thread(delta_from_store, store, cid, model.tensors)
        if delta is None:
            base = await self.task_model(task)
            delta = await asyncio.to_thread(model_delta, model.tensors, base)
        if task.dp != "client":
            return ModelUpdate(delta, num_samples or model.num_samples), None
        if task.clip is None:
            raise ProtocolViolation("a client-side clipping task lacks its clipping norm")
        clipped_delta, bit = await asyncio.to_thread(clip_update, delta, task.clip)
        return ModelUpdate(clipped_delta, num_samples or model.num_samples), bit

    async def _push(
        self,
        update: ModelUpdate | Mapping[str, Any] | Cid,
        samples: int = 0,
        round_id: RoundId | None = None,
    ) -> Cid:
        """Store ``update`` (an async delta, a DP one, an initial model) and push it; in the
        client's own store it counts as ``round_id``'s, as a round's submit does
        (``RoundClient.retention``; without one, as the caller's: kept)."""
        rc = self.rounds
        retention = rc.retention if round_id is not None else None
        if retention is not None:
            retention.begin()
        if isinstance(update, Cid):
            cid = update
        else:
            if not isinstance(update, ModelUpdate):
                update = ModelUpdate(dict(update), samples)
            cid = await asyncio.to_thread(put_update, rc.store, update)
        await rc.blocks.push(rc.store, cid)
        if retention is not None and round_id is not None:
            retention.hold_root(round_id, cid)
        return cid

    async def _call(
        self, call: RunRequest, *, long: bool = False, via: BlockClient | None = None
    ) -> RunAnswer:
        """One request on this client's connection, or on ``via`` (whose caller serialises
        its requests)."""
        rc = self.rounds
        blocks = rc.blocks if via is None else via
        timeout: Literal["read"] | None = None if long else "read"
        try:
            if via is None:
                async with rc._lock:
                    body = await blocks.request(APP, encode(call), timeout=timeout)
            else:
                body = await blocks.request(APP, encode(call), timeout=timeout)
        except RemoteError as exc:
            if exc.code == "unsupported":
                raise ProtocolViolation(f"{blocks.conn.peer} runs no federations") from exc
            raise
        answer = decode_answer(body)
        if answer.error is not None:
            raise_remote(answer.error, blocks.conn.peer)
        return answer

    async def call(self, request: RunRequest, *, long: bool = False) -> RunAnswer:
        """Send one request of the runs protocol and return its answer, a remote error
        raised typed; ``long``: no read timeout (a request that waits on the coordinator).
        For tools and tests that speak the protocol by hand (e.g. a SecAgg+ phase)."""
        return await self._call(request, long=long)

    @property
    def secure_tasks(self) -> SecureTasks:
        """This client's secure tasks whose key phases began as it took them (read-only)."""
        return self._secure


def _one(answer: RunAnswer) -> RunRow:
    if not answer.runs:
        raise ProtocolViolation("the coordinator's answer lacks the run")
    return answer.runs[0]
