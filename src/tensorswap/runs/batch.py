"""Runs requests for many peers in one: register, task and contribute batches; grouped
registrations; per-peer proofs for contributions.

The requests of the ``"runs"`` app name one peer each. For a gateway or a simulation that
speaks for thousands over one connection (``runs.virtual.VirtualRuns``) this module adds a
second app, ``APP_BATCH`` (a coordinator that predates it answers "no handler", and the
connection goes on), with three ops of up to ``MAX_RUN_BATCH`` items, each answered item by
item in order (``RunBatchAnswer.results``: one item refused does not fail the others):

- ``register_batch``: ``[peer, facts]`` items, registered as ``register`` does;
- ``task_batch``: one run, many peers: each peer's task now (or None); with ``timeout``, a
  request that finds none waits (no thread) until one appears or the run finishes;
- ``contribute_batch``: one run, ``[peer, round, update, trained_on, clipped, proof]``
  items, each handled as a ``contribute`` (an asynchronous run's delta that finds no buffer
  open waits for the next, as there); the updates' blocks were pushed before.

Registrations that arrive together, from any connection and either op, are journaled in
one transaction (``RegisterIntake``; ``ClientRegistry.register_many``), and each answer
still comes after its registration is durable.

Per-peer keys. On a coordinator given per-peer keys (``serve --peer-keys``) a contribution
is accepted only with ``proof = rounds.protocol.batch.submit_proof(peer key, RoundId(round, run),
peer, update)``, the proof a rounds submit to that round carries: a gateway cannot
contribute for a peer without that peer's key (or a proof the peer made). The plain
``contribute`` op, which has no proof, is then refused (``PeerNotAuthorised``).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import msgspec

from tensorswap.cid import Cid
from tensorswap.errors import InvalidCid, TensorSwapError
from tensorswap.rounds.core import PeerNotAuthorised, RoundId, RoundStatus
from tensorswap.rounds.protocol import (
    MAX_NAME_BYTES,
    PROOF_BYTES,
    ErrorInfo,
    StatusWire,
    error_info,
    status_to_wire,
    utf8_len,
)
from tensorswap.runs.messages import ContributeRequest, TaskWire, task_wire
from tensorswap.runs.model import ClientInfo, Param
from tensorswap.runs.registry import ClientRegistry
from tensorswap.wire import AppRequest, ProtocolViolation

if TYPE_CHECKING:
    from tensorswap.rounds.server import RoundServer
    from tensorswap.runs.manager import RunManager

__all__ = [
    "APP_BATCH",
    "MAX_RUN_BATCH",
    "ContributeBatchRequest",
    "ContributeItem",
    "RegisterBatchRequest",
    "RegisterIntake",
    "RegisterItem",
    "RunBatchAnswer",
    "RunBatchRequest",
    "RunBatches",
    "RunItemResult",
    "TaskBatchRequest",
    "decode_batch",
]

APP_BATCH = "runs/batch"
"""The application the batched runs ops are addressed to."""

MAX_RUN_BATCH = 1024
"""The most items (peers) one batched runs request carries."""


def _name(what: str, value: str) -> None:
    size = utf8_len(value)
    if not 0 < size <= MAX_NAME_BYTES:
        raise ValueError(f"{what} is {size} bytes long; 1 to {MAX_NAME_BYTES} allowed")


def _count(what: str, n: int) -> None:
    if not 0 < n <= MAX_RUN_BATCH:
        raise ValueError(f"a {what} request holds {n} items; 1 to {MAX_RUN_BATCH} allowed")


class _BatchRequest(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False, tag_field="op"
):
    pass


class RegisterItem(msgspec.Struct, frozen=True, array_like=True):
    """``[peer, facts]``: register ``peer`` with ``facts`` (see ``check_facts``)."""

    peer: str
    facts: dict[str, Param] = {}


class RegisterBatchRequest(_BatchRequest, frozen=True, tag="register_batch"):
    items: list[RegisterItem]

    def __post_init__(self) -> None:
        _count("register_batch", len(self.items))
        for item in self.items:
            _name("a peer name", item.peer)


class TaskBatchRequest(_BatchRequest, frozen=True, tag="task_batch"):
    """Each of ``peers``' task in ``run`` now; with ``timeout``, wait (the server's
    ``max_wait`` at most) until one of them has one or the run finishes."""

    run: str
    peers: list[str]
    timeout: float | None = None

    def __post_init__(self) -> None:
        _name("a run name", self.run)
        _count("task_batch", len(self.peers))
        for peer in self.peers:
            _name("a peer name", peer)
        if self.timeout is not None and not (math.isfinite(self.timeout) and self.timeout >= 0):
            raise ValueError(f"a task timeout must be finite and >= 0, got {self.timeout!r}")


class ContributeItem(msgspec.Struct, frozen=True, array_like=True):
    """``[peer, round, update, trained_on, clipped, proof]``: as a ``contribute`` request,
    with the peer's proof (empty where the coordinator holds no per-peer keys)."""

    peer: str
    round: int
    update: bytes
    trained_on: int | None = None
    clipped: bool | None = None
    proof: bytes = b""


class ContributeBatchRequest(_BatchRequest, frozen=True, tag="contribute_batch"):
    run: str
    items: list[ContributeItem]

    def __post_init__(self) -> None:
        _name("a run name", self.run)
        _count("contribute_batch", len(self.items))
        for item in self.items:
            _name("a peer name", item.peer)
            if item.round < 1 or (item.trained_on is not None and item.trained_on < 0):
                raise ValueError("round must be >= 1 and trained_on >= 0")
            if len(item.proof) not in (0, PROOF_BYTES):
                raise ValueError(f"a contribution's proof is {len(item.proof)} bytes long")
            try:
                Cid.parse(item.update)
            except InvalidCid as exc:
                raise ValueError(f"a contribution names an invalid CID: {exc.reason}") from None


RunBatchRequest = RegisterBatchRequest | TaskBatchRequest | ContributeBatchRequest


class RunItemResult(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=False):
    """One item's outcome: ``error`` when it alone was refused; else a task batch's ``task``
    (absent: none now), a contribution's round ``status``; a registration holds nothing."""

    error: ErrorInfo | None = None
    task: TaskWire | None = None
    status: StatusWire | None = None


class RunBatchAnswer(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=False):
    """The answer to a batched runs request: ``error`` when the whole request was refused,
    else one result per item in order; a register batch also counts the registry."""

    error: ErrorInfo | None = None
    results: list[RunItemResult] = []
    clients: int | None = None
    active: int | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(RunBatchRequest)


def encode_batch(message: RunBatchRequest | RunBatchAnswer) -> bytes:
    return _encoder.encode(message)


def decode_batch(body: bytes) -> RunBatchRequest:
    """A checked batched runs request; ProtocolViolation for anything else."""
    try:
        return _decoder.decode(body)
    except msgspec.DecodeError as exc:  # ValidationError included
        raise ProtocolViolation(f"bad runs batch request: {exc}") from exc
    except RecursionError:
        raise ProtocolViolation("bad runs batch request: nested too deeply") from None


def _refused(exc: TensorSwapError) -> RunItemResult:
    return RunItemResult(error=error_info(exc))


# ── the coordinator's side ───────────────────────────────────────────────────
_Registration = tuple[str, Mapping[str, object] | None, "asyncio.Future[ClientInfo | Exception]"]


class RegisterIntake:
    """Registrations on their way to ``registry``: those that arrive while one batch is
    journaled form the next (``register_many``, one transaction, one worker thread hop)."""

    def __init__(self, registry: ClientRegistry) -> None:
        self.registry = registry
        self._queue: list[_Registration] = []
        self._draining: asyncio.Task[None] | None = None

    async def register(self, peer: str, facts: Mapping[str, object] | None) -> ClientInfo:
        """Register ``peer``; returns once it is journaled (raises what refused it)."""
        (outcome,) = await self.register_many([(peer, facts)])
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    async def register_many(
        self, items: Sequence[tuple[str, Mapping[str, object] | None]]
    ) -> list[ClientInfo | Exception]:
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in items]
        self._queue.extend((p, f, fut) for (p, f), fut in zip(items, futures, strict=True))
        if self._draining is None:
            self._draining = asyncio.ensure_future(self._drain())
        return list(await asyncio.gather(*futures))

    async def _drain(self) -> None:
        try:
            while self._queue:
                batch, self._queue = self._queue, []
                pairs = [(peer, facts) for peer, facts, _ in batch]
                try:
                    outcomes = await asyncio.to_thread(self.registry.register_many, pairs)
                except Exception as exc:  # a bug: every waiter hears of it
                    outcomes = [exc] * len(batch)
                for (_, _, future), outcome in zip(batch, outcomes, strict=True):
                    if not future.done():
                        future.set_result(outcome)
        finally:
            self._draining = None


_T = TypeVar("_T")


class RunsApp(Protocol):
    """What the batched ops use of the runs app (``RunService``)."""

    @property
    def manager(self) -> RunManager: ...

    @property
    def server(self) -> RoundServer: ...

    async def wait(
        self, run: str, timeout: float | None, probe: Callable[[], tuple[bool, _T]]
    ) -> _T | None: ...

    async def contribute(self, call: ContributeRequest) -> RoundStatus: ...


class RunBatches:
    """The batched runs ops on ``service``'s port (app ``APP_BATCH``), and its grouped
    registrations (``intake``, used by the plain ``register`` op too)."""

    def __init__(self, service: RunsApp) -> None:
        self.service = service
        self.intake = RegisterIntake(service.manager.registry)
        service.server.blocks.handlers[APP_BATCH] = self._on_request

    async def _on_request(self, request: AppRequest) -> bytes:
        call = decode_batch(request.body)
        try:
            match call:
                case RegisterBatchRequest():
                    answer = await self._register(call)
                case TaskBatchRequest():
                    answer = await self._tasks(call)
                case ContributeBatchRequest():
                    answer = await self._contribute(call)
        except ProtocolViolation:
            raise
        except TensorSwapError as exc:
            answer = RunBatchAnswer(error=error_info(exc))
        return encode_batch(answer)

    async def _register(self, call: RegisterBatchRequest) -> RunBatchAnswer:
        outcomes = await self.intake.register_many([(i.peer, i.facts) for i in call.items])
        registry = self.service.manager.registry
        return RunBatchAnswer(
            results=[_outcome(o) for o in outcomes],
            clients=len(registry),
            active=len(registry.active()),
        )

    async def _tasks(self, call: TaskBatchRequest) -> RunBatchAnswer:
        manager = self.service.manager

        def probe() -> tuple[bool, list[RunItemResult]]:
            results, ready = [], False
            for peer in call.peers:
                try:
                    task = manager.task(call.run, peer)
                except TensorSwapError as exc:
                    results.append(_refused(exc))
                    continue
                ready = ready or task is not None
                results.append(RunItemResult(task=None if task is None else task_wire(task)))
            return ready or manager.run(call.run).finished, results

        done, results = probe()  # RunNotFound refuses the whole request
        if not done and call.timeout != 0:
            waited = await self.service.wait(call.run, call.timeout, probe)
            results = waited if waited is not None else probe()[1]
        return RunBatchAnswer(results=results)

    async def _contribute(self, call: ContributeBatchRequest) -> RunBatchAnswer:
        keys = self.service.server.peer_keys

        async def one(item: ContributeItem) -> RunItemResult:
            try:
                if keys is not None:
                    rid = RoundId(item.round, call.run)
                    keys.check(rid, item.peer, Cid.parse(item.update), item.proof)
                status = await self.service.contribute(
                    ContributeRequest(
                        peer=item.peer,
                        run=call.run,
                        round=item.round,
                        update=item.update,
                        trained_on=item.trained_on,
                        clipped=item.clipped,
                    )
                )
            except ProtocolViolation:
                raise
            except TensorSwapError as exc:
                return _refused(exc)
            return RunItemResult(status=status_to_wire(status))

        # concurrently, so that the coordinator's group commit journals them together
        return RunBatchAnswer(results=list(await asyncio.gather(*map(one, call.items))))


def refuse_unproven(service: RunsApp, call: ContributeRequest) -> None:
    """PeerNotAuthorised for a plain ``contribute`` on a coordinator with per-peer keys."""
    if service.server.peer_keys is not None:
        rid = RoundId(call.round, call.run)
        raise PeerNotAuthorised(
            rid.as_key(), call.peer, "this coordinator takes only proven contributions"
        )


def _outcome(outcome: Any) -> RunItemResult:
    if isinstance(outcome, TensorSwapError):
        return _refused(outcome)
    if isinstance(outcome, Exception):
        raise outcome
    return RunItemResult()
