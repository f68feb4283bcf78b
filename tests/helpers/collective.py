"""A rendezvous on port 0 and a group of in-process collective peers joined through it."""

from __future__ import annotations

import asyncio

from tensorswap.collective import Collective, Rendezvous
from tensorswap.collective._compress import Compression
from tensorswap.store import MemoryStore
from tensorswap.wire import BlockServer

KEY = b"collective-test-key"


async def rendezvous() -> tuple[BlockServer, Rendezvous]:
    """A started BlockServer on 127.0.0.1 port 0 answering the rendezvous app."""
    server = BlockServer(MemoryStore(), key=KEY)
    made = Rendezvous().attach(server)
    await server.start("127.0.0.1", 0)
    return server, made


async def group(
    n: int, *, compression: Compression = "none"
) -> tuple[list[Collective], BlockServer, Rendezvous]:
    """``n`` peers p0..p(n-1) of group "g", joined (the group formed)."""
    server, made = await rendezvous()
    address = f"127.0.0.1:{server.port}"
    peers = await asyncio.gather(
        *(
            Collective.join(
                address, group="g", peer=f"p{i}", size=n, key=KEY, compression=compression
            )
            for i in range(n)
        )
    )
    return list(peers), server, made


async def close(peers: list[Collective], server: BlockServer, made: Rendezvous) -> None:
    """Close the peers, then the rendezvous and its server."""
    for peer in peers:
        await peer.aclose()
    await made.aclose()
    await server.aclose()
