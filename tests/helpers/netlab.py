"""Rounds across the network lab: a coordinator process in one host, peers in others.

Peers are RoundClients on event loops of their own, each in a thread inside its host (so
their sockets are that host's); the coordinator is `tensorswap serve` started in its host.
The test watches the coordinator's block directory to act at a known point of an upload.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TypeVar

import numpy as np

from helpers.serve import SECRET, Server
from tensorswap.cid import Cid
from tensorswap.netlab import Host
from tensorswap.rounds import RoundClient
from tensorswap.rounds.engine import STORE_DIRNAME
from tensorswap.store import DirectoryStore, MemoryStore, ModelUpdate, manifest_closure, put_update
from tensorswap.wire import Timeouts

T = TypeVar("T")

PORT = 7000
"""Every coordinator listens here: a fixed port, so a restarted one is found again (each lab
host is a namespace of its own, so nothing else holds it)."""


def serve_in(host: Host, data: Path, *extra: str) -> Server:
    """`tensorswap serve` inside ``host`` on its address, port PORT, data in ``data``."""
    return Server(data, *extra, listen=f"{host.address}:{PORT}", popen=host.popen)


def model(value: float, tensors: int = 32, floats: int = 32 * 1024) -> dict[str, np.ndarray]:
    """``tensors`` tensors of ``floats`` float32 each (128 KiB: one chunk each)."""
    return {f"t{i:02d}": np.full(floats, value + i, np.float32) for i in range(tensors)}


def blocks_of(tensors: dict[str, np.ndarray], num_samples: int) -> tuple[list[Cid], list[int]]:
    """The CIDs a submit of this update sends (chunks and manifests), and their sizes."""
    store = MemoryStore()
    root = put_update(store, ModelUpdate(tensors, num_samples))
    cids = manifest_closure(store, root)
    return cids, [store.get(cid).nbytes for cid in cids]


def held(data: Path, cids: Sequence[Cid]) -> list[Cid]:
    """Which of ``cids`` the coordinator with data dir ``data`` has stored."""
    store = DirectoryStore(data / STORE_DIRNAME, create=False)
    lacking = set(store.missing(list(cids)))
    return [cid for cid in cids if cid not in lacking]


async def until(predicate: Callable[[], bool], what: str, seconds: float = 60.0) -> None:
    """Poll ``predicate`` (a state check) every 10 ms until it holds; TimeoutError naming
    ``what`` after ``seconds``."""
    try:
        async with asyncio.timeout(seconds):
            while not predicate():
                await asyncio.sleep(0.01)
    except TimeoutError as exc:
        raise TimeoutError(f"waited {seconds} s for {what}") from exc


async def connect(
    coordinator: Host | str, peer: str, *, read: float = 30.0, port: int = PORT
) -> RoundClient:
    """A RoundClient to the coordinator (a Host or an address); ``read`` s per frame."""
    address = coordinator if isinstance(coordinator, str) else coordinator.address
    return await RoundClient.connect(
        address, port, peer=peer, key=SECRET.encode(), timeouts=Timeouts(read=read)
    )


def in_host(host: Host, factory: Callable[[], Awaitable[T]]) -> asyncio.Future[T]:
    """Run ``factory()`` inside ``host`` on a loop of its own; awaitable from this loop."""
    return asyncio.wrap_future(host.start_async(factory))
