"""A run's top coordinator, regional tiers that fold it, and peers (tests of region runs)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from helpers.region import FAST, values
from tensorswap.cid import Cid
from tensorswap.region import RegionalTier, RunsProxy, UpstreamLink
from tensorswap.rounds.core import Clock
from tensorswap.rounds.engine import Coordinator
from tensorswap.rounds.protocol import PeerKeys
from tensorswap.rounds.server import RoundServer
from tensorswap.runs import RunManager, RunSpec
from tensorswap.runs.client import RunClient
from tensorswap.runs.service import RunService
from tensorswap.store import ModelUpdate, get_update

SIZE = 64 * 1024  # float32 values: a 256 KiB model
MODEL_BYTES = SIZE * 4
RUN = "fl"


@dataclass
class Tier:
    tier: RegionalTier
    server: RoundServer
    proxy: RunsProxy


@dataclass
class Top:
    server: RoundServer
    runs: RunManager


@asynccontextmanager
async def top(
    tmp: Path,
    name: str = "top",
    max_wait: float = 30,
    clock: Clock | None = None,
    peer_keys: PeerKeys | None = None,
) -> AsyncIterator[Top]:
    coord = Coordinator.open(tmp / name, durable=False, clock=clock)
    runs = RunManager.open(coord, durable=False)
    server = RoundServer(coord, max_wait=max_wait, peer_keys=peer_keys)
    RunService(runs, server)
    try:
        await server.start("127.0.0.1", 0)
        yield Top(server, runs)
    finally:
        await server.aclose()
        runs.close()
        coord.close()


@asynccontextmanager
async def tier(
    tmp: Path,
    name: str,
    port: int,
    max_wait: float = 30,
    clock: Clock | None = None,
    peer_key: bytes | None = None,
) -> AsyncIterator[Tier]:
    link = UpstreamLink("127.0.0.1", port, region=name, backoff=FAST, peer_key=peer_key)
    rt = await asyncio.to_thread(RegionalTier.open, tmp / name, link, durable=False, clock=clock)
    assert rt.coordinator is not None and rt.journal is not None
    server = RoundServer(rt.coordinator, max_wait=max_wait)
    proxy = RunsProxy(link, server, rt.journal)
    try:
        await server.start("127.0.0.1", 0)
        await rt.start()
        yield Tier(rt, server, proxy)
    finally:
        await rt.aclose()
        await server.aclose()
        await asyncio.to_thread(rt.close)


def initial() -> dict[str, np.ndarray]:
    return {"w": np.random.default_rng(99).standard_normal(SIZE, dtype=np.float32)}


def trained(i: int, model: dict[str, np.ndarray], version: int) -> dict[str, np.ndarray]:
    """Peer i's deterministic 'training' from a version's model."""
    return {"w": (0.5 * model["w"] + values(1000 * version + i, SIZE)).astype(np.float32)}


async def peer_loop(client: RunClient, i: int) -> int:
    """Peer i trains every task it gets until the run finishes; how many it did."""
    done = 0
    while (task := await client.next_task(RUN, timeout=60)) is not None:
        model = await client.fetch_model(task)
        await client.submit(task, trained(i, model, task.version), 10 + i)
        done += 1
    return done


async def drive(
    ports: Sequence[int],
    top_port: int,
    spec: RunSpec,
    peers: int = 12,
    silent: Sequence[int] = (),
    started: asyncio.Event | None = None,
) -> list[int]:
    """Peers 0..peers-1 (in order, ``peers / len(ports)`` per port) register, the driver
    creates the run at the top, and every peer but the ``silent`` ones works until the run
    finishes (``started`` is set once the run exists); what each peer did."""
    per = peers // len(ports)
    async with AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(
                await RunClient.connect("127.0.0.1", ports[i // per], peer=f"peer-{i}")
            )
            for i in range(peers)
        ]
        for i, client in enumerate(clients):
            await client.register({"num_samples": 10 + i})
        async with await RunClient.connect("127.0.0.1", top_port, peer="driver") as driver:
            await driver.create_run(RUN, spec, ModelUpdate(initial()))
        if started is not None:
            started.set()
        working = [(i, c) for i, c in enumerate(clients) if i not in silent]
        done = await asyncio.gather(*(peer_loop(c, i) for i, c in working))
        return [
            dict(zip([i for i, _ in working], done, strict=True)).get(i, 0) for i in range(peers)
        ]


def models(runs: RunManager) -> list[np.ndarray]:
    """Every version's global model of the run, from the top's store."""
    out = []
    for record in runs.versions(RUN):
        update = get_update(runs.store, Cid.parse(record.global_cid))
        out.append(np.asarray(update.tensors["w"]))
    return out
