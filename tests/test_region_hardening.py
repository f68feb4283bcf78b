"""Regions that cannot collide or loop (issue 23, faults 4 and 5): one live coordinator per
region name upstream, a foreign contribution under the region's name never taken for the
region's own, a loop of regions refused at once (RegionLoop) with bounded connections, and
dials backed off link-wide."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from helpers.region import FAST, RID, Region, peer_round, region, serve, start, values
from tensorswap.region import (
    Backoff,
    DialThrottle,
    ForwardState,
    RegionalTier,
    RegionGate,
    RegionLoop,
    RegionNameTaken,
    RunsProxy,
    UpstreamLink,
    UpstreamUnavailable,
    coordinator_id,
)
from tensorswap.rounds.client import RoundClient
from tensorswap.rounds.core import Complete, DuplicateContribution, Failed, RoundId, RoundSpec
from tensorswap.rounds.engine import Coordinator
from tensorswap.rounds.protocol import error_info, raise_remote
from tensorswap.rounds.server import RoundServer
from tensorswap.runs.client import RunClient
from tensorswap.store import MemoryStore
from tensorswap.wire.errors import ServerBusy

ONE = RoundSpec(1)


async def until(check: Callable[[], object], what: str) -> None:
    """Until ``check()`` holds (every 10 ms, 2,000 times at most)."""
    for _ in range(2000):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


def link_to(port: int, name: str, identity: str | None = None) -> UpstreamLink:
    link = UpstreamLink("127.0.0.1", port, region=name, store=MemoryStore(), backoff=FAST)
    if identity is not None:
        link.identity = identity
    return link


# ── fault 4: two regions with one name ────────────────────────────────────────
async def test_a_second_live_region_with_the_same_name_is_refused_and_says_so(
    tmp_path: Path,
) -> None:
    with Coordinator.open(tmp_path / "top", durable=False) as top_coord:
        async with serve(top_coord) as top, AsyncExitStack() as stack:
            first = await stack.enter_async_context(region(tmp_path / "a", "eu", top.port))
            second = await stack.enter_async_context(region(tmp_path / "b", "eu", top.port))
            await start(top.port, RoundSpec(2))
            ours = asyncio.create_task(peer_round(first.port, "p0", values(0), 10, ONE))
            await until(lambda: top_coord.info(RID).peers == ("eu",), "the first region's fold")
            theirs = asyncio.create_task(peer_round(second.port, "p1", values(1), 10, ONE))
            async with await RoundClient.connect("127.0.0.1", top.port, peer="other") as c:
                await c.submit(RID, {"w": values(2)}, 10)
            (status, result), (refused, nothing) = await asyncio.gather(ours, theirs)
            with pytest.raises(RegionNameTaken) as raised:
                await second.tier.link.round_row(RID)
            peers = sorted(top_coord.info(RID).peers)
    assert isinstance(status, Complete) and result is not None
    # the second region's peer is told its round failed, and why; never Complete without it
    assert isinstance(refused, Failed) and nothing is None
    assert "region name 'eu'" in refused.reason and first.tier.link.identity in refused.reason
    assert raised.value.region == "eu"
    assert raised.value.holder == first.tier.link.identity
    assert raised.value.claimant == second.tier.link.identity
    assert peers == ["eu", "other"]
    want = (values(0) + values(2)) / 2
    np.testing.assert_allclose(result["w"], want, rtol=1e-5, atol=1e-6)


async def test_a_region_reconnecting_or_restarted_keeps_its_name_and_a_dead_one_gives_it_up(
    tmp_path: Path,
) -> None:
    with Coordinator.open(tmp_path / "top", durable=False) as top_coord:
        async with serve(top_coord) as top, AsyncExitStack() as stack:
            await start(top.port, RoundSpec(2))
            first, other = link_to(top.port, "eu"), link_to(top.port, "eu")
            # the same coordinator again (a restart over its data dir) while its old
            # connection still looks alive: accepted
            restarted = link_to(top.port, "eu", first.identity)
            for link in (first, other, restarted):
                stack.push_async_callback(link.aclose)
            await first.round_row(RID)
            await restarted.round_row(RID)
            with pytest.raises(RegionNameTaken):
                await other.round_row(RID)
            await first.aclose()
            await restarted.aclose()  # the region's connections are gone
            gate = _gate(top)
            await until(lambda: gate.stats()["regions_below"] == 0, "the connections closed")
            await until(lambda: other.throttle.wait() == 0, "the refusal's backoff passed")
            await other.round_row(RID)  # the name is free: taken over
            holders = gate.holders()
    assert holders == {"eu": other.identity}


def _gate(server: RoundServer) -> RegionGate:
    handler = server.blocks.handlers["region"]
    gate = getattr(handler, "__self__", None)
    assert isinstance(gate, RegionGate)
    return gate


async def test_a_duplicate_under_the_region_name_with_another_cid_fails_the_round(
    tmp_path: Path,
) -> None:
    with Coordinator.open(tmp_path / "top", durable=False) as top_coord:
        async with serve(top_coord) as top:
            await start(top.port, RoundSpec(2))
            # someone else's update under the region's name (as after a restart of the
            # region, the upstream holds a contribution from "eu")
            async with await RoundClient.connect("127.0.0.1", top.port, peer="eu") as c:
                held = await c.submit(RID, {"w": values(7)}, 10)
            async with region(tmp_path, "eu", top.port) as rg:
                mine = asyncio.create_task(peer_round(rg.port, "p0", values(0), 10, ONE))
                await until(lambda: _tried(rg), "the region submitted upstream")
                async with await RoundClient.connect("127.0.0.1", top.port, peer="other") as c:
                    await c.submit(RID, {"w": values(2)}, 10)
                status, result = await mine
    assert isinstance(status, Failed) and result is None
    assert "another region submits under the name 'eu'" in status.reason
    assert str(held.cid) in status.reason


def _tried(rg: Region) -> bool:
    """Whether the region's round failed, or its submit upstream was answered."""
    assert rg.tier.coordinator is not None and rg.tier.journal is not None
    info = rg.tier.coordinator.info(RID)
    record = rg.tier.journal.get(RID)
    failed = info is not None and info.status.is_terminal
    return failed or (record is not None and record.state is not ForwardState.PARTIAL)


def test_a_duplicate_refusal_names_the_update_it_holds_across_the_wire() -> None:
    exc = DuplicateContribution("r1/lead", "eu", "bafyheld")
    with pytest.raises(DuplicateContribution) as raised:
        raise_remote(error_info(exc), "top")
    assert raised.value.cid == "bafyheld" and raised.value.peer == "eu"
    # an old coordinator's refusal carries no CID: no attribute, no guess
    with pytest.raises(DuplicateContribution) as old:
        raise_remote(error_info(DuplicateContribution("r1/lead", "eu")), "top")
    assert not hasattr(old.value, "cid")


def test_a_coordinator_id_is_made_once_and_kept(tmp_path: Path) -> None:
    first = coordinator_id(tmp_path / "data")
    assert first == coordinator_id(tmp_path / "data") and len(first) == 32
    assert first != coordinator_id(tmp_path / "elsewhere")


# ── fault 5: regions in a loop ─────────────────────────────────────────────────
@asynccontextmanager
async def loop_of_two(tmp: Path, backoff: Backoff) -> AsyncIterator[tuple[Region, Region]]:
    """Regions x and y, each the other's upstream, each relaying runs requests."""
    async with AsyncExitStack() as stack:
        made: list[Region] = []
        for name in ("x", "y"):
            link = UpstreamLink("127.0.0.1", 0, region=name, backoff=backoff)
            tier = await asyncio.to_thread(RegionalTier.open, tmp / name, link, durable=False)
            stack.callback(tier.close)
            assert tier.coordinator is not None
            server = RoundServer(tier.coordinator, max_connections=64)
            RegionGate(server, link=link)
            RunsProxy(link, server)
            await server.start("127.0.0.1", 0)
            stack.push_async_callback(server.aclose)
            stack.push_async_callback(tier.aclose)
            made.append(Region(tier, server))
        x, y = made
        x.tier.link.port, y.tier.link.port = y.port, x.port
        for rg in made:
            await rg.tier.start()
        yield x, y


def connections(*regions: Region) -> int:
    return sum(rg.server.traffic().connections for rg in regions)


@pytest.mark.timeout(120)
async def test_a_request_relayed_round_a_loop_is_refused_typed_and_connections_stay_few(
    tmp_path: Path,
) -> None:
    patient = Backoff(first=0.01, cap=0.05, give_up_after=5.0)
    async with loop_of_two(tmp_path, patient) as (x, y):
        async with await RunClient.connect("127.0.0.1", x.port, peer="p") as peer:
            with pytest.raises(RegionLoop) as raised:
                await peer.register()
            after_first = connections(x, y)
            for _ in range(20):  # more requests: answered at once, no new dials
                with pytest.raises(RegionLoop):
                    await peer.register()
            after_more = connections(x, y)
        states = [rg.tier.stats().upstream_state for rg in (x, y)]
        async with await RoundClient.connect("127.0.0.1", x.port, peer="watch") as watch:
            report = await watch.server_status()
    ids = {x.tier.link.identity, y.tier.link.identity}
    assert raised.value.coordinator in ids
    assert all(i in raised.value.chain for i in ids)
    # the peer's connection, x -> y once, y -> x once (refused)
    assert after_first <= 4
    assert after_more == after_first
    assert all(state.startswith("stopped: region loop") for state in states)
    # x found itself on the chain x -> y -> x: it refused y and stopped its own link
    assert report.stats["region_loops_refused"] == 1
    assert str(report.stats["upstream_state"]).startswith("stopped: region loop")


@pytest.mark.timeout(120)
async def test_two_regions_forwarding_rounds_to_each_other_both_stop_at_once(
    tmp_path: Path,
) -> None:
    patient = Backoff(first=0.01, cap=0.05, give_up_after=5.0)
    later = RoundId(2, "lead")
    async with loop_of_two(tmp_path, patient) as (x, y):
        at_x = asyncio.create_task(peer_round(x.port, "p0", values(0), 10, ONE))
        await until(lambda: x.tier.link.upstream_path != (), "x dialled y")

        async def at_y() -> object:
            async with await RoundClient.connect("127.0.0.1", y.port, peer="p1") as c:
                await c.start_round(later, ONE)
                await c.submit(later, {"w": values(1)}, 10)
                return await c.wait(later, timeout=60)

        (x_status, _), y_status = await asyncio.gather(at_x, at_y())
        total = connections(x, y)
        stopped = [rg.tier.link.stopped for rg in (x, y)]
    for status in (x_status, y_status):
        assert isinstance(status, Failed)
        assert "region loop" in status.reason  # not UpstreamUnavailable after the patience
    assert all(isinstance(s, RegionLoop) for s in stopped)
    assert total <= 8


async def test_regions_dialling_each_other_at_once_still_find_the_loop(tmp_path: Path) -> None:
    async with loop_of_two(tmp_path, FAST) as (x, y):
        top = RoundSpec(1)
        await start(y.port, top)
        await x.tier.link.round_row(RID)  # x -> y: accepted (y knows nothing above it)
        y_knew = y.tier.link.upstream_path
        # as if y's hello had crossed x's: y's gate knew nothing of x above when it accepted,
        # and x's answer to y names nothing above x
        x.tier.link.upstream_path = ()
        await start(x.port, top)
        with pytest.raises(RegionLoop) as raised:
            await y.tier.link.round_row(RID)  # y -> x: the answer names x, below y
    assert y_knew == ()
    assert "is below this coordinator too" in str(raised.value)
    assert isinstance(y.tier.link.stopped, RegionLoop)


# ── backoff ─────────────────────────────────────────────────────────────────────
def test_the_backoff_is_a_pure_function_of_the_failures_and_the_draw() -> None:
    b = Backoff(first=0.1, factor=2.0, cap=5.0, jitter=0.2)
    assert [b.delay(k) for k in range(1, 9)] == pytest.approx(
        [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0]
    )
    assert b.delay(3, 1.0) == pytest.approx(0.4 * 0.8)  # the jitter shortens, never lengthens
    assert b.delay(10**9, 0.5) == pytest.approx(5.0 * 0.9)  # no overflow far past the cap
    rng_a, rng_b = iter([0.3, 0.9, 0.1, 0.0]), iter([0.3, 0.9, 0.1, 0.0])

    class Draws:
        def __init__(self, it: Any) -> None:
            self.it = it

        def random(self) -> float:
            return next(self.it)

    got = list(itertools.islice(b.delays(Draws(rng_a)), 4))  # type: ignore[arg-type]
    assert got == [b.delay(k, next(rng_b)) for k in range(1, 5)]
    with pytest.raises(ValueError):
        b.delay(0)


def test_the_dial_throttle_backs_off_on_failures_and_holds_a_refusal() -> None:
    now = [100.0]
    draws = iter([0.0, 0.0, 0.0, 0.5])
    throttle = DialThrottle(
        Backoff(first=1.0, cap=3.0, jitter=0.2), clock=lambda: now[0], draw=lambda: next(draws)
    )
    assert throttle.admit() is None  # nothing failed: dial
    busy = ServerBusy("top", "at its connection cap")
    assert throttle.failed(busy) == 1.0
    assert throttle.admit() is busy and throttle.wait() == 1.0  # no dial for a second
    now[0] += 1.0
    assert throttle.admit() is None  # the probe
    assert throttle.admit() is busy  # one probe at a time
    assert throttle.failed(busy) == 2.0
    now[0] += 2.0
    assert throttle.admit() is None
    taken = RegionNameTaken("eu", "a", "b")
    assert throttle.failed(taken, refused=True) == 3.0  # capped
    assert throttle.admit() is taken and throttle.refused
    now[0] += 3.0
    assert throttle.admit() is None
    throttle.succeeded()
    assert throttle.admit() is None and throttle.admit() is None  # healthy: dial at will
    assert throttle.dials == 6


class VirtualTime:
    """A clock and a sleep for tasks that only sleep: time jumps to the next wake-up once
    every task is waiting."""

    def __init__(self) -> None:
        self.now = 0.0
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        future = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self.now + seconds, next(self._seq), future))
        await future

    async def run(self, work: Coroutine[Any, Any, Any]) -> Any:
        task = asyncio.ensure_future(work)
        while not task.done():
            for _ in range(50):  # let every task run until it sleeps
                await asyncio.sleep(0)
            if self._sleepers and not task.done():
                wake, _, future = heapq.heappop(self._sleepers)
                self.now = max(self.now, wake)
                future.set_result(None)
        return task.result()


async def test_a_flood_of_relays_to_a_busy_upstream_dials_once_per_backoff() -> None:
    time = VirtualTime()
    link = UpstreamLink(
        "127.0.0.1",
        1,
        region="eu",
        store=MemoryStore(),
        backoff=Backoff(first=0.1, cap=5.0, give_up_after=30.0),
        sleep=time.sleep,
        clock=time.clock,
    )
    dials: list[float] = []

    async def busy(chain: tuple[str, ...]) -> RoundClient:
        dials.append(time.now)
        raise ServerBusy("127.0.0.1:1", "at its connection cap (2063); retry later")

    link._dial = busy  # type: ignore[method-assign]

    async def one() -> BaseException:
        try:
            await link.relay("runs", b"")
        except UpstreamUnavailable as exc:
            return exc
        raise AssertionError("relayed through a busy upstream")

    async def flood() -> list[BaseException]:
        return list(await asyncio.gather(*(one() for _ in range(200))))

    failures = await time.run(flood())
    assert all(isinstance(f, UpstreamUnavailable) for f in failures)
    # 200 relays for 30 s: one dial per link-wide delay (0.1 s doubling to 5 s), not
    # one per relay per attempt
    assert 5 <= len(dials) <= 16  # it kept probing, a few times
    assert all(b > a for a, b in itertools.pairwise(dials))  # never two dials at once
