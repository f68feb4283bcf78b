"""A peer's side of a secure run's round: ``RunClient.submit`` runs the SecAgg+ phases here.

The key phases (setup, keys, shares) need no input: a peer begins them when it takes its task
(``SecureTasks``, on a second connection so the model's fetch does not wait behind their long
polls) and builds its masks while it trains, as Flower's SecAgg+ workflow shares keys before
fit; ``SecureTasks.submit`` then only quantizes, adds and pushes. A ``RunClient`` holds one
``SecureTasks``, given its ``RoundClient`` and the way it sends runs requests.

The peer's delta (its model minus the task's, clipped first in a client-clipping DP run) is
flattened in the global model's tensor order into one float32 vector, quantized and masked
by ``SecAggClient``; only the masked vector leaves the peer, as a raw block pushed to the
coordinator. The protocol's secrets live in this call's memory only: a peer that restarts
starts over with the next task, and never answers an unmask request for another survivor set.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import threading
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import numpy as np

from tensorswap.cid import Multicodec
from tensorswap.rounds.core import RoundStatus
from tensorswap.runs.messages import RunAnswer, RunRequest, SecAggRequest
from tensorswap.store import ModelUpdate
from tensorswap.wire import ProtocolViolation

if TYPE_CHECKING:
    from tensorswap.privacy.secagg.client import SecAggClient
    from tensorswap.privacy.secagg.protocol import Message, Setup
    from tensorswap.rounds.client import RoundClient
    from tensorswap.runs.model import Task
    from tensorswap.wire import BlockClient

__all__ = ["RunsCall", "SecureTasks", "flatten_delta"]

Call = Callable[[SecAggRequest], Awaitable[RunAnswer]]
"""One long-polled secagg request and its answer (on some connection of the peer's)."""


class RunsCall(Protocol):
    """How a ``RunClient`` sends one runs request (on ``via``, or its own connection) and
    gets its answer, a remote refusal raised typed."""

    def __call__(
        self, request: RunRequest, /, *, long: bool = False, via: BlockClient | None = None
    ) -> Awaitable[RunAnswer]: ...


_PREP: ThreadPoolExecutor | None = None
_PREP_LOCK = threading.Lock()


def _prep_pool() -> ThreadPoolExecutor:
    """The threads that build masked vectors ahead (``SecAggClient.prepare``), one per CPU,
    apart from the event loop's default executor so that a round's small replies never
    queue behind them (several peers may share a process, as in tests and benchmarks)."""
    global _PREP
    with _PREP_LOCK:
        if _PREP is None:
            _PREP = ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="tensorswap-mask")
        return _PREP


def flatten_delta(
    model: Mapping[str, np.ndarray], base: Mapping[str, np.ndarray], clip: float | None = None
) -> np.ndarray:
    """``model - base`` as one float32 vector in ``base``'s tensor order (the global model's),
    each tensor raveled, scaled to L2 norm ``clip`` at most when one is given (client-side DP
    clipping); QuantizationError unless names and shapes match."""
    from tensorswap.privacy.secagg.errors import QuantizationError

    if set(model) != set(base):
        diff = sorted(set(model) ^ set(base))
        raise QuantizationError(f"the update's tensors differ from the task's model: {diff}")
    out = np.empty(sum(np.size(v) for v in base.values()), np.float32)
    at = 0
    for name, like in base.items():
        part = np.asarray(model[name])
        if part.shape != np.shape(like):
            raise QuantizationError(
                f"tensor {name!r} has shape {part.shape}, the task's model {np.shape(like)}"
            )
        view = out[at : at + part.size]
        view[:] = part.ravel()
        view -= np.asarray(like, np.float32).ravel()
        at += part.size
    return _clipped(out, clip)


def _clipped(vector: np.ndarray, clip: float | None) -> np.ndarray:
    """``vector`` scaled in place to L2 norm ``clip`` at most (None: as it is)."""
    from tensorswap.privacy.dp import clip_factor, update_norm

    if clip is not None:
        vector *= np.float32(clip_factor(update_norm({"delta": vector}), clip))
    return vector


def _delta_vector(
    rounds: RoundClient, task: Task, model: Mapping[str, np.ndarray], clip: float | None
) -> np.ndarray | None:
    """The flat delta read chunk by chunk from the task's model in the peer's own store
    (None if it is not there, or names or shapes differ: ``flatten_delta`` then)."""
    from tensorswap.privacy.delta import flat_delta_from_store

    vector = flat_delta_from_store(rounds.store, task.global_cid, model)
    return None if vector is None else _clipped(vector, clip)


@dataclass
class _Keyed:
    """What the key phases leave for the masked input: the peer's protocol state, its setup,
    the server message that asks for the masked input (the shares), its number."""

    peer: SecAggClient
    setup: Setup
    message: Message
    after: int
    prepared: list[asyncio.Future[None]] = field(default_factory=list)


def _request(peer: str, task: Task, after: int, message: bytes = b"",
             block: bytes | None = None) -> SecAggRequest:  # fmt: skip
    return SecAggRequest(
        peer=peer,
        run=task.run,
        round=task.round_id.round,
        after=after,
        message=message,
        block=block,
    )


async def _next_message(peer: str, task: Task, call: Call, answer: RunAnswer,
                        after: int) -> RunAnswer:  # fmt: skip
    while answer.secagg is None:  # the phase is still open: ask again
        answer = await call(_request(peer, task, after))
    return answer


async def _key_phases(peer: str, task: Task, call: Call) -> _Keyed:
    """Join the round's session and run setup, keys and shares over ``call``, the masks built
    on the masking threads meanwhile; returns once the shares arrive (typed refusals raise:
    NotSelected, SecureRoundFailed, SecAggError leaves)."""
    from tensorswap.privacy.secagg.client import SecAggClient
    from tensorswap.privacy.secagg.protocol import Setup as SetupMessage
    from tensorswap.privacy.secagg.protocol import SharesDelivery, decode, encode

    answer = await _next_message(peer, task, call, await call(_request(peer, task, 0)), 0)
    setup = decode(answer.secagg or b"")
    if not isinstance(setup, SetupMessage) or answer.secagg_peer is None:
        raise ProtocolViolation("the coordinator's secagg setup lacks its config or peer number")
    keyed = _Keyed(SecAggClient(answer.secagg_peer), setup, setup, 1)
    loop = asyncio.get_running_loop()
    try:
        while not isinstance(keyed.message, SharesDelivery):
            reply = await loop.run_in_executor(None, keyed.peer.handle, keyed.message)
            # masks while the phase's other peers answer: self mask now, pairwise after keys
            keyed.prepared.append(loop.run_in_executor(_prep_pool(), keyed.peer.prepare))
            answer = await call(_request(peer, task, keyed.after, encode(reply)))
            answer = await _next_message(peer, task, call, answer, keyed.after)
            keyed.message, keyed.after = decode(answer.secagg or b""), keyed.after + 1
    except BaseException:
        await _settle(keyed.prepared)
        raise
    return keyed


async def _settle(work: list[asyncio.Future[None]]) -> None:
    """Wait for the masking threads' work (prepare refuses nothing): no thread outlives a
    round's call."""
    for future in work:
        await asyncio.gather(future, return_exceptions=True)


class SecureTasks:
    """A RunClient's secure tasks whose key phases began as it took them: one per run, each
    run's on a connection of its own to the coordinator (dialled as the first was, kept for
    the run's next rounds). A task is held until ``submit`` takes it, or a newer round's
    replaces it. ``rounds`` is the client's connection and store, ``call`` how it sends
    runs requests, ``task_model(task)`` the model a task trains from (``RunClient``'s)."""

    def __init__(
        self,
        rounds: RoundClient,
        call: RunsCall,
        task_model: Callable[[Task], Awaitable[dict[str, np.ndarray]]],
    ) -> None:
        self.rounds, self._runs_call, self._task_model = rounds, call, task_model
        self.quantized: np.ndarray | None = None
        """This peer's last quantized input to a secure round, before masking."""
        self._held: dict[str, tuple[Task, asyncio.Task[_Keyed]]] = {}
        self._sides: dict[str, BlockClient] = {}

    def begin(self, task: Task) -> None:
        """Run ``task``'s key phases in the background (again for the same task: nothing)."""
        held = self._held.get(task.run)
        if held is not None and held[0].round_id == task.round_id:
            return
        self.drop(task.run)

        async def call(request: SecAggRequest) -> RunAnswer:
            return await self._call(task.run, request)

        work = asyncio.get_running_loop().create_task(
            _key_phases(self.rounds.peer, task, call), name=f"secagg keys {task.run}"
        )
        work.add_done_callback(_quiet)
        self._held[task.run] = (task, work)

    def held(self, run: str) -> Task | None:
        """The task of ``run`` whose key phases began and that no submit took yet (None when
        there is none, or its phases failed: the coordinator is asked anew)."""
        held = self._held.get(run)
        if held is None:
            return None
        work = held[1]
        if work.done() and (work.cancelled() or work.exception() is not None):
            del self._held[run]
            return None
        return held[0]

    def take(self, task: Task) -> asyncio.Task[_Keyed] | None:
        held = self._held.get(task.run)
        if held is None or held[0].round_id != task.round_id:
            return None
        del self._held[task.run]
        return held[1]

    def drop(self, run: str) -> None:
        held = self._held.pop(run, None)
        if held is not None:
            held[1].cancel()

    async def _call(self, run: str, request: SecAggRequest) -> RunAnswer:
        """One request on ``run``'s connection (one at a time: the run's key phases ask in
        turn). A request that does not come back whole (cancelled with its task, a broken
        connection, a refusal) closes the connection: what it had in flight would answer the
        next one; the next request dials again."""
        side = self._sides.get(run)
        if side is None:
            dial = self.rounds.dial
            assert dial is not None  # RunClient begins tasks only where it can dial
            side = self._sides[run] = await dial()
        try:
            return await self._runs_call(request, long=True, via=side)
        except BaseException:
            if self._sides.get(run) is side:
                del self._sides[run]
            with contextlib.suppress(Exception):
                await asyncio.shield(side.aclose())
            raise

    async def aclose(self) -> None:
        works = [work for _, work in self._held.values()]
        self._held.clear()
        for work in works:
            work.cancel()
        await asyncio.gather(*works, return_exceptions=True)
        for work in works:  # the masking threads of a cancelled one
            if not work.cancelled() and work.exception() is None:
                await _settle(work.result().prepared)
        sides, self._sides = list(self._sides.values()), {}
        for side in sides:
            await side.aclose()

    def work(self, run: str) -> asyncio.Task[_Keyed] | None:
        """The background key phases of ``run``'s held task (as begun: done, failed or
        cancelled ones too), None when none is held; for tools and tests."""
        held = self._held.get(run)
        return None if held is None else held[1]

    def connected(self) -> list[str]:
        """The runs whose key phases hold a connection of their own now."""
        return list(self._sides)

    async def submit(
        self, task: Task, update: ModelUpdate | Mapping[str, Any], num_samples: int
    ) -> RoundStatus:
        """Run the round's SecAgg+ phases for ``update`` (the peer's new model) with weight
        ``num_samples`` (1 in a DP run or a ``mean`` run), from where the key phases begun
        with the task stand (all of them when none began); the round's status after the
        last one. Refusals arrive typed (SecAggError leaves, NotSelected, SecureRoundFailed)."""
        from tensorswap.privacy.secagg.protocol import MaskedInput, UnmaskResponse, decode, encode

        model = update if isinstance(update, ModelUpdate) else ModelUpdate(dict(update))
        if task.dp == "client" and task.clip is None:
            raise ProtocolViolation("a client-side clipping task lacks its clipping norm")

        async def call(request: SecAggRequest) -> RunAnswer:
            return await self._runs_call(request, long=True)

        begun, rounds, peer = self.take(task), self.rounds, self.rounds.peer
        try:
            clip = task.clip if task.dp == "client" else None
            vector = await asyncio.to_thread(_delta_vector, rounds, task, model.tensors, clip)
            if vector is None:
                base = await self._task_model(task)
                vector = await asyncio.to_thread(flatten_delta, model.tensors, base, clip)
        except BaseException:
            if begun is not None:
                begun.cancel()
                await asyncio.gather(begun, return_exceptions=True)
            raise
        keyed = await (begun if begun is not None else _key_phases(peer, task, call))
        samples = num_samples or model.num_samples
        keyed.peer.provide(vector, 1 if keyed.setup.config.max_weight == 1 else max(1, samples))
        store, masked_cid, loop = rounds.store, None, asyncio.get_running_loop()
        message, after = keyed.message, keyed.after
        try:
            while True:
                # the masked input (model-sized work) on the masking threads: as many at once
                # as there are CPUs, so peers sharing a process finish, and push, one after
                # another rather than all late together
                reply = await loop.run_in_executor(_prep_pool(), keyed.peer.handle, message)
                block = None
                if isinstance(reply, MaskedInput):
                    self.quantized = keyed.peer.quantized
                    # its own codec: the coordinator holds it in memory only (storage._volatile)
                    codec = Multicodec.TENSORSWAP_MASKED
                    put = functools.partial(store.put, adopt=True, codec=codec)
                    masked_cid = await asyncio.to_thread(put, reply.masked)
                    await rounds.blocks.push(store, masked_cid)
                    reply, block = msgspec.structs.replace(reply, masked=b""), masked_cid.to_bytes()
                answer = await call(_request(peer, task, after, encode(reply), block))
                if isinstance(reply, UnmaskResponse):
                    if answer.status is None:
                        raise ProtocolViolation("the coordinator's answer lacks the round's status")
                    return answer.status.to_status()
                answer = await _next_message(peer, task, call, answer, after)
                message, after = decode(answer.secagg or b""), after + 1
        finally:
            await _settle(keyed.prepared)
            if masked_cid is not None:
                store.delete(masked_cid)


def _quiet(work: asyncio.Task[_Keyed]) -> None:
    """Retrieve a background task's failure (its submit raises it, or the peer never asks)."""
    if not work.cancelled():
        work.exception()
