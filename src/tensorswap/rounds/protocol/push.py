"""Rounds requests answered with the round's result behind them (the ``"rounds/fetch"`` app).

A request to ``"rounds/fetch"`` is any rounds request (the body of the ``"rounds"`` app,
checked and answered the same way); when its answer says the round is Complete, the
coordinator follows the REPLY with the aggregate's blocks, as the answer to a Get with
``closure`` (``wire.BlocksReply``), less the blocks of the update this peer submitted in the
request (an aggregate shares only a chunk every contribution had, such as a frozen layer's).
So a submit that waits for the round's end (``SubmitRequest.timeout``) brings the result in
the same round trip: ``RoundClient.submit(..., wait=)`` uses it, and falls back to the plain
app (then a Get) on a coordinator that predates it (``unsupported``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from tensorswap.cid import Cid
from tensorswap.errors import StoreError
from tensorswap.rounds.protocol.codec import (
    CompleteWire,
    SubmitRequest,
    decode_answer,
    decode_call,
)
from tensorswap.store import BlockStore, manifest_closure
from tensorswap.wire import AppRequest, BlocksReply, ProtocolViolation, RequestHandler

__all__ = ["APP_FETCH", "result_push", "result_roots"]

APP_FETCH = "rounds/fetch"


def result_push(
    answer: Callable[[AppRequest], Awaitable[bytes]], store: BlockStore
) -> RequestHandler:
    """The ``"rounds/fetch"`` handler: ``answer(request)`` (the ``"rounds"`` app's), then
    the result's blocks from ``store`` when that answer is a Complete status."""

    async def handle(request: AppRequest) -> bytes:
        body = await answer(request)
        roots, have = await asyncio.to_thread(_to_send, store, request.body, body)
        return BlocksReply(body, roots, have)

    return handle


def result_roots(answer_body: bytes) -> list[Cid]:
    """The aggregate a rounds answer names as Complete (none otherwise)."""
    status = decode_answer(answer_body).status
    return [Cid.parse(status.cid)] if isinstance(status, CompleteWire) else []


def _to_send(
    store: BlockStore, request_body: bytes, answer_body: bytes
) -> tuple[list[Cid], list[Cid]]:
    roots = result_roots(answer_body)
    if not roots:
        return [], []
    try:  # a batch or page op is answered, but never complete: it did not get here
        call = decode_call(request_body)
    except ProtocolViolation:
        return roots, []
    if not isinstance(call, SubmitRequest):
        return roots, []
    try:
        return roots, manifest_closure(store, call.cid)
    except StoreError:  # the contribution is unreadable now: send everything
        return roots, []
