"""A peer's side of a secure run's round: ``RunClient.submit`` runs the SecAgg+ phases here.

The peer's delta (its model minus the task's, clipped first in a client-clipping DP run) is
flattened in the global model's tensor order into one float32 vector, quantized and masked
by ``SecAggClient``; only the masked vector leaves the peer, as a raw block pushed to the
coordinator. The protocol's secrets live in this call's memory only: a peer that restarts
starts over with the next task, and never answers an unmask request for another survivor set.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from tensorswap.rounds.state import RoundStatus
from tensorswap.runs.messages import RunAnswer, SecAggRequest
from tensorswap.store import ModelUpdate
from tensorswap.wire import ProtocolViolation

if TYPE_CHECKING:
    from tensorswap.runs.client import RunClient
    from tensorswap.runs.manager import Task

__all__ = ["flatten_delta", "secure_submit"]


def flatten_delta(delta: Mapping[str, np.ndarray], order: Mapping[str, np.ndarray]) -> np.ndarray:
    """``delta``'s tensors as one float32 vector in ``order``'s tensor order (the global
    model's), each raveled; QuantizationError unless names and shapes match."""
    from tensorswap.privacy.secagg.errors import QuantizationError

    if set(delta) != set(order):
        diff = sorted(set(delta) ^ set(order))
        raise QuantizationError(f"the update's tensors differ from the task's model: {diff}")
    parts = []
    for name, like in order.items():
        part = np.asarray(delta[name])
        if part.shape != np.shape(like):
            raise QuantizationError(
                f"tensor {name!r} has shape {part.shape}, the task's model {np.shape(like)}"
            )
        parts.append(part.astype(np.float32, copy=False).ravel())
    return np.concatenate(parts) if parts else np.zeros(0, np.float32)


async def secure_submit(
    client: RunClient, task: Task, update: ModelUpdate | Mapping[str, Any], num_samples: int
) -> RoundStatus:
    """Run the round's SecAgg+ phases for ``update`` (the peer's new model) with weight
    ``num_samples`` (1 in a DP run or a ``mean`` run); the round's status after the last one.
    Refusals arrive typed (SecAggError leaves, NotSelected, SecureRoundFailed)."""
    from tensorswap.privacy.secagg.client import SecAggClient
    from tensorswap.privacy.secagg.protocol import (
        MaskedInput,
        Message,
        Setup,
        UnmaskResponse,
        decode,
        encode,
    )

    delta, _ = await client._dp_delta(task, update, num_samples)
    base = await client.fetch_model(task)
    vector = await asyncio.to_thread(flatten_delta, delta.tensors, base)

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
    samples = num_samples or delta.num_samples
    weight = 1 if setup.config.max_weight == 1 else max(1, samples)
    peer = SecAggClient(answer.secagg_peer, vector, weight)
    message: Message = setup
    after = 1
    store, masked_cid = client.rounds.store, None
    try:
        while True:
            reply = await asyncio.to_thread(peer.handle, message)
            block = None
            if isinstance(reply, MaskedInput):
                client.secagg_quantized = peer.quantized
                masked_cid = await asyncio.to_thread(store.put, reply.masked)
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
        if masked_cid is not None:
            store.delete(masked_cid)
