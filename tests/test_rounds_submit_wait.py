"""A submit with ``wait``: the submit and the wait for the round's end are one request."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from helpers.net import running
from tensorswap.cid import Cid
from tensorswap.rounds import Coordinator, RoundClient, RoundServer, RoundTimeout
from tensorswap.rounds.core import Collecting, Complete, RoundId, RoundSpec
from tensorswap.rounds.protocol import SubmitRequest, WaitRequest, decode_call, encode_call
from tensorswap.rounds.protocol.push import APP_FETCH
from tensorswap.store import manifest_closure
from tensorswap.wire.messages import Get, Request

RID = RoundId(1, "lead")


def requests_of(client: RoundClient) -> list[Any]:
    """The rounds requests ``client`` sends from now on, decoded (``(app, request)`` for
    the ``rounds/fetch`` app), and its Gets."""
    seen: list[Any] = []
    send = client.blocks.conn.send_message

    async def counting(message: Any, stream_id: int = 0) -> None:
        if isinstance(message, Request) and message.app == "rounds":
            seen.append(decode_call(message.body))
        elif isinstance(message, Request) and message.app == APP_FETCH:
            seen.append((APP_FETCH, decode_call(message.body)))
        elif isinstance(message, Get):
            seen.append(message)
        await send(message, stream_id)

    client.blocks.conn.send_message = counting  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("pushing", [True, False])
async def test_a_submit_with_wait_answers_once_the_round_is_complete(
    tmp_path: Path, pushing: bool
) -> None:
    coordinator = Coordinator.open(tmp_path / "c")
    frozen = np.random.default_rng(0).standard_normal(300_000, np.float32)
    a_values = np.random.default_rng(1).standard_normal(300_000, np.float32)
    b_values = np.random.default_rng(2).standard_normal(300_000, np.float32)
    try:
        server = RoundServer(coordinator)
        if not pushing:  # a coordinator from before rounds/fetch
            del server.blocks.handlers[APP_FETCH]
        async with running(server):
            a = await RoundClient.connect("127.0.0.1", server.port, peer="a")
            b = await RoundClient.connect("127.0.0.1", server.port, peer="b")
            async with a, b:
                a.cut.enabled = b.cut.enabled = False  # rounds/fetch here: no cut-through
                await a.start_round(RID, RoundSpec(2))
                sent = requests_of(a)
                first = asyncio.ensure_future(
                    a.submit(RID, {"frozen": frozen, "w": a_values}, 1, wait=60)
                )
                second = await b.submit(RID, {"frozen": frozen, "w": b_values}, 1, wait=60)
                mine = await first
                assert isinstance(mine.status, Complete)
                assert isinstance(second.status, Complete)
                assert mine.status.cid == second.status.cid
                served = server.blocks.stats.blocks_served
                result = await a.fetch_result(RID, timeout=30)  # no wait request: known
                np.testing.assert_allclose(result["w"], (a_values + b_values) / 2, rtol=1e-6)
                np.testing.assert_array_equal(result["frozen"], frozen)
                if pushing:  # the result came behind the submit's answer: nothing asked
                    assert [(app, type(r)) for app, r in sent] == [(APP_FETCH, SubmitRequest)]
                    assert sent[0][1].timeout == 60
                    assert server.blocks.stats.blocks_served == served
                    closure = manifest_closure(a.store, Cid.parse(mine.status.cid))
                    shared = set(closure) & set(manifest_closure(a.store, mine.cid))
                    assert shared  # the frozen chunk (and its manifest): never sent back
                    assert a.push_results
                else:  # plain submit, then one Get
                    # asked once (answered "unsupported"), then the plain app, then one Get
                    assert sent[0][0] == APP_FETCH
                    assert [type(r) for r in sent[1:]] == [SubmitRequest, Get]
                    assert sent[1].timeout == 60
                    assert not a.push_results
    finally:
        coordinator.close()


async def test_a_submit_wait_that_runs_out_answers_the_status_not_an_error(
    tmp_path: Path,
) -> None:
    coordinator = Coordinator.open(tmp_path / "c")
    try:
        async with running(RoundServer(coordinator)) as server:
            a = await RoundClient.connect("127.0.0.1", server.port, peer="a")
            async with a:
                await a.start_round(RID, RoundSpec(2))
                values = np.arange(100_000, dtype=np.float32)
                done = await a.submit(RID, {"w": values}, 1, wait=0.0)
                assert isinstance(done.status, Collecting)
                sent = requests_of(a)
                with pytest.raises(RoundTimeout):  # not terminal, so not remembered: asked
                    await a.wait(RID, timeout=0)
                assert [type(r) for r in sent] == [WaitRequest]
    finally:
        coordinator.close()


def test_a_plain_submit_keeps_its_bytes_and_a_bad_wait_is_refused() -> None:
    cid = Cid.of(b"x")
    plain = SubmitRequest.of(RID, "a", cid)
    assert plain.timeout is None
    assert decode_call(encode_call(plain)) == plain
    waiting = SubmitRequest.of(RID, "a", cid, 5.0)
    assert decode_call(encode_call(waiting)).timeout == 5.0  # rides the layout's timeout key
    assert len(encode_call(waiting)) == len(encode_call(plain)) + 8  # nil -> float64
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="timeout"):
            SubmitRequest.of(RID, "a", cid, bad)
