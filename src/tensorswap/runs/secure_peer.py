"""A peer's side of a secure run's round: ``RunClient.submit`` runs the SecAgg+ phases here.

The peer's delta (its model minus the task's, clipped first in a client-clipping DP run) is
flattened in the global model's tensor order into one float32 vector, quantized and masked
by ``SecAggClient``; only the masked vector leaves the peer, as a raw block pushed to the
coordinator. The protocol's secrets live in this call's memory only: a peer that restarts
starts over with the next task, and never answers an unmask request for another survivor set.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from tensorswap.cid import Cid
from tensorswap.rounds.state import RoundStatus
from tensorswap.runs.messages import RunAnswer, SecAggRequest
from tensorswap.store import ModelUpdate
from tensorswap.wire import ProtocolViolation

if TYPE_CHECKING:
    from tensorswap.runs.client import RunClient
    from tensorswap.runs.manager import Task

__all__ = ["flatten_delta", "secure_submit"]

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
    client: RunClient, task: Task, model: Mapping[str, np.ndarray], clip: float | None
) -> np.ndarray | None:
    """The flat delta read chunk by chunk from the task's model in the peer's own store
    (None if it is not there, or names or shapes differ: ``flatten_delta`` then)."""
    from tensorswap.privacy.delta import flat_delta_from_store

    vector = flat_delta_from_store(client.rounds.store, Cid.parse(task.global_cid), model)
    return None if vector is None else _clipped(vector, clip)


async def secure_submit(
    client: RunClient, task: Task, update: ModelUpdate | Mapping[str, Any], num_samples: int
) -> RoundStatus:
    """Run the round's SecAgg+ phases for ``update`` (the peer's new model) with weight
    ``num_samples`` (1 in a DP run or a ``mean`` run); the round's status after the last one.
    Refusals arrive typed (SecAggError leaves, NotSelected, SecureRoundFailed)."""
    from tensorswap.privacy.secagg.client import SecAggClient
    from tensorswap.privacy.secagg.protocol import (
        KeysBroadcast,
        MaskedInput,
        Message,
        Setup,
        SharesDelivery,
        UnmaskResponse,
        decode,
        encode,
    )

    model = update if isinstance(update, ModelUpdate) else ModelUpdate(dict(update))
    if task.dp == "client" and task.clip is None:
        raise ProtocolViolation("a client-side clipping task lacks its clipping norm")
    clip = task.clip if task.dp == "client" else None
    vector = await asyncio.to_thread(_delta_vector, client, task, model.tensors, clip)
    if vector is None:
        base = await client.task_model(task)
        vector = await asyncio.to_thread(flatten_delta, model.tensors, base, clip)

    def request(after: int, message: bytes = b"", block: bytes | None = None) -> SecAggRequest:
        return SecAggRequest(
            peer=client.peer,
            run=task.run,
            round=task.round_id.round,
            after=after,
            message=message,
            block=block,
        )

    async def next_message(answer: RunAnswer, after: int) -> RunAnswer:
        while answer.secagg is None:  # the phase is still open: ask again
            answer = await client._call(request(after), long=True)
        return answer

    answer = await next_message(await client._call(request(0), long=True), 0)
    setup = decode(answer.secagg or b"")
    if not isinstance(setup, Setup) or answer.secagg_peer is None:
        raise ProtocolViolation("the coordinator's secagg setup lacks its config or peer number")
    samples = num_samples or model.num_samples
    weight = 1 if setup.config.max_weight == 1 else max(1, samples)
    peer = SecAggClient(answer.secagg_peer, vector, weight)
    message: Message = setup
    after = 1
    store, masked_cid = client.rounds.store, None
    loop, ahead = asyncio.get_running_loop(), []
    try:
        while True:
            # the masked input (model-sized work) on the masking threads too: as many at once
            # as there are CPUs, so peers sharing a process finish, and push, one after another
            # rather than all late together
            heavy = _prep_pool() if isinstance(message, SharesDelivery) else None
            reply = await loop.run_in_executor(heavy, peer.handle, message)
            if isinstance(message, Setup | KeysBroadcast):
                # quantize and mask while the phase's other peers answer (the masked input
                # then only waits for the shares): self mask now, pairwise masks after keys
                ahead.append(loop.run_in_executor(_prep_pool(), peer.prepare))
            block = None
            if isinstance(reply, MaskedInput):
                client.secagg_quantized = peer.quantized
                masked_cid = await asyncio.to_thread(store.put, reply.masked, adopt=True)
                await client.rounds.blocks.push(store, masked_cid)
                reply, block = msgspec.structs.replace(reply, masked=b""), masked_cid.to_bytes()
            answer = await client._call(request(after, encode(reply), block), long=True)
            if isinstance(reply, UnmaskResponse):
                if answer.status is None:
                    raise ProtocolViolation("the coordinator's answer lacks the round's status")
                return answer.status.to_status()
            answer = await next_message(answer, after)
            message, after = decode(answer.secagg or b""), after + 1
    finally:
        for work in ahead:  # prepare refuses nothing; wait so no thread outlives the call
            await asyncio.gather(work, return_exceptions=True)
        if masked_cid is not None:
            store.delete(masked_cid)
