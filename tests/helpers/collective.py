"""A rendezvous on port 0 and a group of in-process collective peers joined through it."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from tensorswap.collective import Collective, Rendezvous
from tensorswap.collective._compress import Compression
from tensorswap.collective.messages import PEER_APP, decode_slice
from tensorswap.store import MemoryStore
from tensorswap.wire import AppRequest, BlockServer

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


class _HeldClient:
    """A BlockClient whose first push of more than ``after`` blocks sends ``after`` of them,
    then waits for ``gate`` before the rest (every other use passes straight through)."""

    def __init__(self, inner: Any, gate: asyncio.Event, after: int, spent: list[bool]) -> None:
        self._inner, self._gate, self._after, self._spent = inner, gate, after, spent

    async def put_blocks(self, store: Any, cids: list[Any], **kw: Any) -> int:
        if self._spent[0] or len(cids) <= self._after:
            return int(await self._inner.put_blocks(store, cids, **kw))
        self._spent[0] = True
        sent = int(await self._inner.put_blocks(store, cids[: self._after], **kw))
        await self._gate.wait()
        return sent + int(await self._inner.put_blocks(store, cids[self._after :], **kw))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def hold_push(pusher: Collective, reducer: str, after: int = 1) -> asyncio.Event:
    """``pusher``'s push of its slice to ``reducer`` stops after ``after`` chunks until the
    returned event is set (a slow flow in the middle of the reduce-scatter)."""
    gate, spent = asyncio.Event(), [False]
    inner = pusher.client_of

    async def client_of(member):  # type: ignore[no-untyped-def]
        client = await inner(member)
        return _HeldClient(client, gate, after, spent) if member.peer == reducer else client

    pusher.client_of = client_of  # type: ignore[method-assign]
    return gate


def stored(peer: Collective, cid: Any) -> asyncio.Event:
    """An event set once ``peer``'s store holds ``cid`` (checked on each block it stores)."""
    event, loop = asyncio.Event(), asyncio.get_running_loop()
    inner = peer.store.on_put

    def on_put() -> None:
        if inner is not None:
            inner()
        if peer.store.has(cid):
            loop.call_soon_threadsafe(event.set)

    peer.store.on_put = on_put
    if peer.store.has(cid):
        event.set()
    return event


def noted(peer: Collective, sender: str, *, reduced: bool) -> asyncio.Event:
    """An event set once ``peer`` has taken a notice from ``sender`` of a pushed slice (of
    reduced chunks with ``reduced``)."""
    event = asyncio.Event()
    inner = peer.server.handlers[PEER_APP]

    async def handler(request: AppRequest) -> bytes:
        reply = await inner(request)
        sent = decode_slice(request.body)
        if sent.peer == sender and sent.reduced == reduced:
            event.set()
        return reply

    peer.server.handlers[PEER_APP] = handler
    return event


def mean_in_order(inputs: list[np.ndarray], weights: list[float]) -> np.ndarray:
    """sum(w_i x_i) / sum(w_i) in float32 with a reducer's operations in its order: the
    bits of the call's result (a fold chunk by chunk does the same per element)."""
    ws = [np.float32(w) for w in weights]
    total = np.float32(sum(float(w) for w in ws))
    acc = np.multiply(inputs[0], ws[0])
    for x, w in zip(inputs[1:], ws[1:], strict=True):
        acc = np.add(acc, np.multiply(x, w))
    return np.divide(acc, total)
