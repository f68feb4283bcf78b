"""A call's traffic with a relayed member, through the rendezvous (``RelayPut``, a Get)."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from tensorswap.cid import Cid
from tensorswap.collective.messages import APP, CallView, RelayPut, decode_answer, encode
from tensorswap.errors import TensorSwapError

__all__ = ["CallRun", "pull_from_relay", "put_to_relay", "start_pulls"]


class CallRun(Protocol):
    """What the relay's traffic needs of a call in progress (``_call.CallRun``; a protocol,
    so that module and this one do not import each other)."""

    owner: Any  # the Collective
    number: int
    stats: Any  # its CallStats

    def start_task(
        self, key: tuple[Any, ...], work: Callable[..., Coroutine[Any, Any, None]], *args: Any
    ) -> None: ...

    async def forget_later(self, key: tuple[Any, ...]) -> None: ...


async def put_to_relay(run: CallRun, j: int, cids: list[Cid], *, reduced: bool) -> bool:
    """Hand these blocks of slice j to the rendezvous, one request each (the relay checks
    each against its CID and, for inputs, this peer's commitment); whether all were taken.
    The relay skips the bytes of a block it already holds only after they arrive."""
    owner = run.owner
    try:
        client = await owner.relay_client()
        for cid in cids:
            data = bytes(owner.store.get(cid))
            put = RelayPut(
                owner.group, run.number, owner.peer, j, cid.to_bytes(), data, reduced=reduced
            )
            answer = decode_answer(await client.request(APP, encode(put)), owner.peer)
            if answer.error is not None:
                return False
            if not reduced:
                run.stats.bytes_sent += len(data)
    except (TensorSwapError, OSError):
        await owner.forget_relay()
        return False
    return True


def start_pulls(run: CallRun, view: CallView, j: int, chunks: range) -> None:
    """As slice j's relayed reducer: fetch from the relay each live participant's chunks of
    slice j that the relay now holds (``view.relayed``) and this peer has not yet."""
    owner = run.owner
    for peer, slices in view.relayed.items():
        live = peer not in view.dropped and peer in view.commits and peer != owner.peer
        if live and j in slices and (run.number, peer, j) not in owner.received:
            run.start_task(("pull", j, peer), pull_from_relay, run, view, j, peer, chunks)


async def pull_from_relay(run: CallRun, view: CallView, j: int, peer: str, chunks: range) -> None:
    """Fetch ``peer``'s committed chunks of slice j from the relay (each hash-checked), then
    count them as that peer's push of slice j here (as a SliceSent would)."""
    owner = run.owner
    committed = [view.commits[peer].chunks[k] for k in chunks]
    lacking = [c for c in (Cid.parse(raw) for raw in committed) if not owner.store.has(c)]
    try:
        client = await owner.relay_client()
        missing = await client.get_blocks(lacking, into=owner.store)
    except (TensorSwapError, OSError):
        await owner.forget_relay()
        missing = lacking
    if missing:
        await run.forget_later(("pull", j, peer))
        return
    run.stats.bytes_received += sum(owner.store.size_of(c) for c in lacking)
    owner.received[(run.number, peer, j)] = committed
    owner.arrivals[(run.number, peer, j)] = owner.clock()
    owner.wake.set()
