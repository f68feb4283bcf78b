"""The collective all-reduce: peers join through a rendezvous and average among themselves."""

from __future__ import annotations

import asyncio

import numpy as np

from tensorswap.collective import Collective, Rendezvous
from tensorswap.store import MemoryStore
from tensorswap.wire import BlockServer

KEY = b"collective-test-key"


async def _rendezvous() -> tuple[BlockServer, Rendezvous]:
    server = BlockServer(MemoryStore(), key=KEY)
    rendezvous = Rendezvous().attach(server)
    await server.start("127.0.0.1", 0)
    return server, rendezvous


def test_two_peers_average_a_dict() -> None:
    async def main() -> list[dict[str, np.ndarray]]:
        server, rendezvous = await _rendezvous()
        address = f"127.0.0.1:{server.port}"
        inputs = [{"w": np.full(10, float(i + 1), np.float32)} for i in range(2)]

        async def peer(i: int) -> dict[str, np.ndarray]:
            g = await Collective.join(address, group="g", peer=f"p{i}", size=2, key=KEY)
            async with g:
                return await g.all_reduce(inputs[i], weight=float(i + 1))

        try:
            return list(await asyncio.gather(peer(0), peer(1)))
        finally:
            await rendezvous.aclose()
            await server.aclose()

    results = asyncio.run(main())
    expected = np.full(10, (1 * 1 + 2 * 2) / 3, np.float32)
    for result in results:
        np.testing.assert_array_equal(result["w"], expected)
