"""A rendezvous on port 0 and a group of in-process collective peers joined through it."""

from __future__ import annotations

import asyncio
from typing import Any

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


async def cut_after_commit(victim: Collective, values: dict[str, Any]) -> None:
    """Start ``victim``'s call with ``values``; once its commit is answered, hang it, cancel
    it and close the peer (its server and connections go, as a killed process's would)."""
    committed = asyncio.Event()
    original = victim.ask

    async def ask_then_die(message):  # type: ignore[no-untyped-def]
        answer = await original(message)
        committed.set()
        await asyncio.Event().wait()  # never returns: the peer hangs, then is cut
        return answer

    victim.ask = ask_then_die  # type: ignore[method-assign]
    dying = asyncio.ensure_future(victim.all_reduce(values))
    await committed.wait()
    dying.cancel()
    await victim.aclose()
