"""A peer fetches a round's aggregate in one Get after submitting to it, and a chunk every
contribution shared (a frozen layer) is not sent back to it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from helpers.net import running
from tensorswap.rounds import Coordinator, RoundClient, RoundServer
from tensorswap.rounds.core import RoundId, RoundSpec
from tensorswap.store import manifest_closure
from tensorswap.wire.messages import Get

RID = RoundId(1, "lead")


def gets_of(client: RoundClient) -> list[Get]:
    """The Gets ``client`` sends from now on."""
    seen: list[Get] = []
    send = client.blocks.conn.send_message

    async def counting(message: Any, stream_id: int = 0) -> None:
        if isinstance(message, Get):
            seen.append(message)
        await send(message, stream_id)

    client.blocks.conn.send_message = counting  # type: ignore[method-assign]
    return seen


async def test_after_a_submit_the_aggregate_comes_in_one_get_without_the_frozen_layer(
    tmp_path: Path,
) -> None:
    coordinator = Coordinator.open(tmp_path / "c")
    frozen = np.random.default_rng(0).standard_normal(5000, np.float32)
    try:
        async with running(RoundServer(coordinator)) as server:
            a = await RoundClient.connect("127.0.0.1", server.port, peer="a")
            b = await RoundClient.connect("127.0.0.1", server.port, peer="b")
            async with a, b:
                await a.start_round(RID, RoundSpec(2))
                mine = await a.submit(RID, {"frozen": frozen, "w": np.ones(100, np.float32)}, 1)
                await b.submit(RID, {"frozen": frozen, "w": np.full(100, 3, np.float32)}, 1)
                gets = gets_of(a)
                served = server.stats.blocks_served
                result = await a.fetch_result(RID, timeout=30)
                np.testing.assert_allclose(result["w"], 2.0)
                np.testing.assert_array_equal(result["frozen"], frozen)
                (get,) = gets
                assert get.closure
                cid = await a.result(RID)
                closure = manifest_closure(coordinator.store, cid)
                shared = set(closure) & set(manifest_closure(a.store, mine.cid))
                assert shared  # the frozen chunk (and its tensor manifest)
                # every block of the aggregate but those a already holds
                assert server.stats.blocks_served - served == len(closure) - len(shared)
                # a peer that submitted nothing pulls level by level (nothing to skip)
                gets = gets_of(b)
                await b.fetch(cid)
                assert gets == [] or not gets[0].closure
    finally:
        coordinator.close()
