"""A RoundClient or RunClient call cancelled at any await point leaves its connection usable.

Each sweep cancels one call at its 1st, 2nd, ... suspension until it completes, and after
every cancel checks that the next calls on the same client get the right answers (never a
reply meant for the cancelled call). Over loopback TCP the unread answers are dropped, or
the client reconnects when the answer owed is a wait's; over ``Stepwise`` (every frame can
be cut in the middle, both ways) a cut send breaks the connection and the next call
reconnects, or raises ConnectionBroken where the client cannot dial.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from helpers.cancel import CancelAt, Stepwise, sweep
from tensorswap.rounds import (
    Coordinator,
    DuplicateContribution,
    FakeClock,
    RoundAlreadyTerminal,
    RoundClient,
)
from tensorswap.rounds.core import Collecting, Complete, RoundId, RoundSpec
from tensorswap.rounds.protocol import APP as ROUNDS_APP
from tensorswap.rounds.protocol import page_peers
from tensorswap.rounds.server import RoundServer
from tensorswap.runs import RunManager, RunSpec
from tensorswap.runs.client import RunClient
from tensorswap.runs.messages import APP as RUNS_APP
from tensorswap.runs.service import RunService
from tensorswap.store import MemoryStore, ModelUpdate, put_update
from tensorswap.wire import (
    AppRequest,
    BlockClient,
    ConnectionBroken,
    FrameConnection,
    FrameKind,
    memory_pair,
)
from tensorswap.wire._exchange import MAX_OWED, Exchanges, ExchangeStats

KEY = b"cancel-key"


def _update(seed: int) -> dict[str, np.ndarray]:
    """Three tensors (seven blocks), 36 KiB: a push of several blocks, still small."""
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(3000).astype(np.float32) for name in ("a", "b", "c")}


class Arrivals:
    """An event per application, set as the server begins to answer one of its requests
    (a long-poll is waiting there from then on)."""

    def __init__(self, server: RoundServer) -> None:
        self.events = {app: asyncio.Event() for app in (ROUNDS_APP, RUNS_APP)}
        for app, event in self.events.items():
            server.blocks.handlers[app] = _flagging(server.blocks.handlers[app], event)


def _flagging(
    handler: Callable[[AppRequest], Awaitable[bytes]], event: asyncio.Event
) -> Callable[[AppRequest], Awaitable[bytes]]:
    async def handle(request: AppRequest) -> bytes:
        event.set()
        return await handler(request)

    return handle


@dataclass
class Served:
    server: RoundServer
    runs: RunManager
    arrivals: Arrivals
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def client(self, peer: str) -> RoundClient:
        return await RoundClient.connect("127.0.0.1", self.server.port, peer=peer, key=KEY)

    async def memory(self, peer: str) -> RoundClient:
        """A client over an in-memory connection, served here; it cannot dial again, so
        what a cancelled call leaves owed is always read and dropped."""
        near, far = memory_pair()
        self.tasks.append(asyncio.ensure_future(self.server.handle(far)))
        return RoundClient(await BlockClient.open(near, key=KEY), peer)

    async def stepwise(self, peer: str, *, redial: bool = True) -> RoundClient:
        """A client over in-memory connections cut in halves (``Stepwise``), served here."""

        async def dial() -> BlockClient:
            near, far = memory_pair()
            self.tasks.append(asyncio.ensure_future(self.server.handle(far)))
            return await BlockClient.open(Stepwise(near), key=KEY)

        blocks = await dial()
        if redial:

            async def again() -> Any:
                fresh = await dial()
                return fresh.conn, fresh.welcome

            blocks.redial = again
        return RoundClient(blocks, peer)


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    coord = Coordinator.open(tmp_path, clock=FakeClock(), run_timer=False, durable=False)
    runs = RunManager.open(coord, durable=False)
    server = RoundServer(coord, key=KEY, max_wait=30)
    RunService(runs, server)
    here = Served(server, runs, Arrivals(server))
    try:
        await server.start("127.0.0.1", 0)
        yield here
    finally:
        await server.aclose()
        for task in here.tasks:
            task.cancel()
        await asyncio.gather(*here.tasks, return_exceptions=True)
        runs.close()
        coord.close()


async def _first(*waits: Awaitable[Any]) -> None:
    """Until the first of ``waits`` is done (the others cancelled)."""
    futures = [asyncio.ensure_future(w) for w in waits]
    await asyncio.wait(futures, return_when=asyncio.FIRST_COMPLETED)
    for future in futures:
        future.cancel()
    await asyncio.gather(*futures, return_exceptions=True)


async def _done(task: asyncio.Task[Any]) -> None:
    await asyncio.wait([task])


# ── the probe: a timeout around a waiting call ──────────────────────────────
async def test_a_timeout_around_a_waiting_runs_call_leaves_the_next_call_its_own_answer(
    served: Served,
) -> None:
    """The issue's probe: a timeout scope ends ``versions(wait=)`` while the coordinator holds
    it; the answer still comes (a version is made), and the next call reads its own."""
    driver = RunClient(await served.client("driver"))
    peer = RunClient(await served.client("p0"))
    try:
        await peer.register({"num_samples": 1})
        await driver.create_run("follow", RunSpec(rounds=2, seed=2), ModelUpdate(_update(0)))
        arrived = served.arrivals.events[RUNS_APP]
        arrived.clear()

        async def follow() -> None:
            async with asyncio.timeout(None) as scope:
                waiting = asyncio.ensure_future(driver.versions("follow", since=1, wait=60))
                await _first(arrived.wait(), _done(waiting))
                scope.reschedule(asyncio.get_running_loop().time())  # the timeout fires
                await waiting

        with pytest.raises(TimeoutError):
            await follow()
        task = await peer.next_task("follow", timeout=30)
        assert task is not None
        await peer.submit(task, _update(1), num_samples=1)  # version 1: the answer comes
        # before: ProtocolViolation (the cancelled call's reply, stream 4, read for 5)
        got = await driver.versions("follow", since=1, wait=30)
        assert [v.version for v in got] == [1] and got[0].participants == ["p0"]
        assert (await driver.run("follow")).version == 1
    finally:
        await driver.aclose()
        await peer.aclose()


# ── plain requests ──────────────────────────────────────────────────────────
@pytest.mark.parametrize("kind", ["tcp", "memory"])
async def test_status_cancelled_at_each_await_point(served: Served, kind: str) -> None:
    client = await (served.client("a") if kind == "tcp" else served.memory("a"))
    rid = RoundId(1, "status")
    try:
        await client.start_round(rid, RoundSpec(2))
        await client.submit(rid, _update(1), 1)
        want = Collecting(received=1, expected=2)

        async def check(k: int, cancelled: bool) -> None:
            assert await client.status(rid) == want
            assert (await client.round_row(rid)).peers == ["a"]

        cut = await sweep(lambda k: client.status(rid), check)
        stats = client.blocks.exchange_stats
        assert cut >= 1 and stats.abandoned >= 1 and stats.discarded_frames >= 1
    finally:
        await client.aclose()


async def test_status_over_cut_frames_cancelled_at_each_await_point(served: Served) -> None:
    client = await served.stepwise("a")
    rid = RoundId(1, "status")
    try:
        await client.start_round(rid, RoundSpec(2))
        want = await client.status(rid)

        async def check(k: int, cancelled: bool) -> None:
            assert await client.status(rid) == want

        assert await sweep(lambda k: client.status(rid), check) >= 2
        stats = client.blocks.exchange_stats
        assert stats.reconnects >= 1 and stats.reconnects == stats.broken
    finally:
        await client.aclose()


# ── waits (long-polls) ──────────────────────────────────────────────────────
@pytest.mark.parametrize("kind", ["tcp", "memory"])
async def test_a_round_wait_cancelled_at_each_await_point(served: Served, kind: str) -> None:
    """Over TCP the client reconnects rather than wait for the wait's answer; in memory
    (no way to dial) the answer is read and dropped once the round completes."""
    waiter = await (served.client("waiter") if kind == "tcp" else served.memory("waiter"))
    helper = await served.client("helper")
    arrived = served.arrivals.events[ROUNDS_APP]
    try:

        async def prepare(k: int) -> None:
            await helper.start_round(RoundId(k, "wait"), RoundSpec(1))
            arrived.clear()

        async def meanwhile(k: int, stepper: CancelAt, task: asyncio.Task[Any]) -> None:
            # once the wait is at the coordinator (or was cut before it got there), the
            # round completes: its answer comes, whether or not anyone reads it
            await _first(arrived.wait(), stepper.injected.wait())
            await helper.submit(RoundId(k, "wait"), _update(k), 1)

        async def check(k: int, cancelled: bool) -> None:
            status = await waiter.wait(RoundId(k, "wait"), timeout=60)
            assert isinstance(status, Complete)
            assert await waiter.status(RoundId(k, "wait")) == status

        async def make(k: int) -> Any:
            return await waiter.wait(RoundId(k, "wait"), timeout=60)

        await sweep_with(prepare, make, check, meanwhile)
        stats = waiter.blocks.exchange_stats
        if kind == "tcp":
            assert stats.reconnects >= 1  # a wait owed: reconnected
        else:
            assert stats.reconnects == 0 and stats.discarded_frames >= 1
    finally:
        await waiter.aclose()
        await helper.aclose()


@pytest.mark.parametrize("kind", ["tcp", "memory"])
async def test_a_runs_long_poll_cancelled_at_each_await_point(served: Served, kind: str) -> None:
    driver = RunClient(await (served.client("driver") if kind == "tcp" else served.memory("d")))
    peer = RunClient(await served.client("p0"))
    arrived = served.arrivals.events[RUNS_APP]
    try:
        await peer.register({"num_samples": 1})

        async def prepare(k: int) -> None:
            await driver.create_run(f"r{k}", RunSpec(rounds=1, seed=k), ModelUpdate(_update(0)))
            arrived.clear()

        async def meanwhile(k: int, stepper: CancelAt, task: asyncio.Task[Any]) -> None:
            await _first(arrived.wait(), stepper.injected.wait())
            task_ = await peer.next_task(f"r{k}", timeout=30)
            assert task_ is not None
            await peer.submit(task_, _update(k), num_samples=1)

        async def make(k: int) -> Any:
            return await driver.versions(f"r{k}", since=1, wait=60)

        async def check(k: int, cancelled: bool) -> None:
            got = await driver.versions(f"r{k}", since=1, wait=60)
            assert [v.version for v in got] == [1] and got[0].participants == ["p0"]
            assert (await driver.run(f"r{k}")).version == 1

        await sweep_with(prepare, make, check, meanwhile)
    finally:
        await driver.aclose()
        await peer.aclose()


async def test_next_task_cancelled_at_each_await_point(served: Served) -> None:
    driver = RunClient(await served.client("driver"))
    peer = RunClient(await served.client("p0"))
    try:
        await peer.register({"num_samples": 1})
        await driver.create_run("tasks", RunSpec(rounds=1, seed=1), ModelUpdate(_update(0)))

        async def check(k: int, cancelled: bool) -> None:
            task = await peer.next_task("tasks", timeout=30)
            assert task is not None and task.round_id.round == 1 and task.version == 0

        assert await sweep(lambda k: peer.next_task("tasks", timeout=30), check) >= 1
    finally:
        await driver.aclose()
        await peer.aclose()


# ── submits that push blocks ────────────────────────────────────────────────
@pytest.mark.parametrize("stepwise", [False, True], ids=["tcp", "cut-frames"])
async def test_a_pushing_submit_cancelled_at_each_await_point(
    served: Served, stepwise: bool
) -> None:
    client = await (served.stepwise("a") if stepwise else served.client("a"))
    helper = await served.client("helper")
    client.inline = False  # offer, the blocks lacking, submit
    try:

        async def prepare(k: int) -> None:
            await helper.start_round(RoundId(k, "push"), RoundSpec(2))

        async def make(k: int) -> Any:
            return await client.submit(RoundId(k, "push"), _update(k), 1)

        async def check(k: int, cancelled: bool) -> None:
            rid = RoundId(k, "push")
            mine = await client.status(rid)  # after what the cancelled call left running
            truth = await helper.status(rid)
            assert mine == truth
            try:  # submitted again: accepted, or refused if the cancelled one landed
                result = await client.submit(rid, _update(k), 1)
                assert cancelled and result.status == Collecting(received=1, expected=2)
            except DuplicateContribution:
                assert truth == Collecting(received=1, expected=2)
            assert (await client.round_row(rid)).peers == ["a"]

        await sweep_with(prepare, make, check)
        if stepwise:
            assert client.blocks.exchange_stats.broken >= 1
    finally:
        await client.aclose()
        await helper.aclose()


async def test_a_submit_with_wait_and_its_pushed_result_cancelled_at_each_await_point(
    served: Served,
) -> None:
    """A submit that waits for the round's end gets the result's blocks behind its answer
    (``rounds/fetch``: a reply streamed as REPLY, BLOCK frames, GOT)."""
    client, helper = await served.client("a"), await served.client("helper")
    try:

        async def prepare(k: int) -> None:
            rid = RoundId(k, "fetch")
            await helper.start_round(rid, RoundSpec(2))
            await helper.submit(rid, _update(1000 + k), 1)
            client.store = MemoryStore()

        async def make(k: int) -> Any:
            return await client.submit(RoundId(k, "fetch"), _update(k), 1, wait=60)

        async def check(k: int, cancelled: bool) -> None:
            rid = RoundId(k, "fetch")
            if not (await client.status(rid)).is_terminal:  # the cancelled submit not in yet
                assert cancelled
                # it was, the coordinator ran it after all: DuplicateContribution, or the
                # round already complete with it
                with contextlib.suppress(DuplicateContribution, RoundAlreadyTerminal):
                    await client.submit(rid, _update(k), 1, wait=60)
            result = await client.fetch_result(rid, timeout=60)
            for name, mine in _update(k).items():
                np.testing.assert_allclose(result[name], (mine + _update(1000 + k)[name]) / 2)

        await sweep_with(prepare, make, check)
    finally:
        await client.aclose()
        await helper.aclose()


# ── streamed and paged replies ──────────────────────────────────────────────
@pytest.mark.parametrize("stepwise", [False, True], ids=["tcp", "cut-frames"])
async def test_a_fetch_cancelled_at_each_await_point(served: Served, stepwise: bool) -> None:
    client = await (served.stepwise("a") if stepwise else served.client("a"))
    values = _update(7)
    cid = await asyncio.to_thread(put_update, served.server.store, ModelUpdate(values, 1))
    try:

        async def prepare(k: int) -> None:
            client.store = MemoryStore()  # the whole update to fetch again

        async def make(k: int) -> Any:
            return await client.fetch(cid)

        async def check(k: int, cancelled: bool) -> None:
            got = (await client.fetch(cid)).tensors
            for name, want in values.items():
                np.testing.assert_array_equal(got[name], want)

        await sweep_with(prepare, make, check)
    finally:
        await client.aclose()


async def test_a_page_of_peers_cancelled_at_each_await_point(served: Served) -> None:
    client, helper = await served.client("reader"), await served.client("p")
    rid = RoundId(1, "paged")
    try:
        await helper.start_round(rid, RoundSpec(4))
        for i in range(3):
            helper.peer = f"p{i}"
            await helper.submit(rid, _update(i), 1)

        async def check(k: int, cancelled: bool) -> None:
            page = await page_peers(client, rid, 1, 2)
            assert page.peers == ["p1", "p2"] and page.total == 3 and page.next is None

        await sweep(lambda k: page_peers(client, rid, 1, 2), check)
    finally:
        await client.aclose()
        await helper.aclose()


# ── a client that cannot dial again ─────────────────────────────────────────
async def test_a_cut_frame_on_a_client_that_cannot_dial_raises_connection_broken(
    served: Served,
) -> None:
    client = await served.stepwise("a", redial=False)
    rid = RoundId(1, "broken")
    try:
        await client.start_round(rid, RoundSpec(2))
        sends = asyncio.Event()
        send = client.blocks.conn.transport.send

        async def stalling(*parts: Any) -> None:  # the request's frame stops half-way
            await send(parts[0])
            sends.set()
            await asyncio.Event().wait()

        client.blocks.conn.transport.send = stalling  # type: ignore[method-assign]
        call = asyncio.ensure_future(client.status(rid))
        await sends.wait()
        call.cancel()
        await asyncio.wait([call])
        with pytest.raises(ConnectionBroken, match="a send was cut inside a frame") as err:
            await client.status(rid)
        assert err.value.peer == client.blocks.conn.peer
        assert client.blocks.exchange_stats.broken == 1
    finally:
        await client.aclose()


async def sweep_with(
    prepare: Callable[[int], Awaitable[None]],
    make: Callable[[int], Coroutine[Any, Any, Any]],
    check: Callable[[int, bool], Awaitable[None]],
    meanwhile: Callable[[int, CancelAt, asyncio.Task[Any]], Awaitable[None]] | None = None,
) -> int:
    """``sweep``, with ``prepare(k)`` before each call (a fresh round, a fresh store)."""

    cut = 0

    async def checked(k: int, cancelled: bool) -> None:
        nonlocal cut
        cut += cancelled
        await check(k, cancelled)
        await prepare(k + 1)

    await prepare(1)
    await sweep(make, checked, meanwhile=meanwhile)
    assert cut >= 1
    return cut


async def test_the_answers_owed_are_bounded() -> None:
    """Past MAX_OWED answers owed to cancelled calls, a connection is given up."""
    near, far = memory_pair()
    exchanges = Exchanges(FrameConnection(near), ExchangeStats())
    for _ in range(MAX_OWED):
        exchanges.expect(exchanges.next_stream(), FrameKind.REPLY)
    exchanges.abandon(asyncio.CancelledError())
    assert exchanges.broken is None and exchanges.stats.abandoned == 1
    exchanges.expect(exchanges.next_stream(), FrameKind.REPLY)
    exchanges.abandon(asyncio.CancelledError())
    assert exchanges.broken == f"more than {MAX_OWED} answers owed to cancelled calls"
    assert exchanges.stats.broken == 1
    await far.aclose()
