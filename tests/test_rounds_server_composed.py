"""RoundServer holds a BlockServer: the rounds handler is registered through ``handlers``,
lifecycle and counters are the block server's, and its traffic is the wire's own count."""

from __future__ import annotations

import asyncio

import numpy as np

from tensorswap.rounds.client import RoundClient
from tensorswap.rounds.core import Complete, RoundId, RoundSpec, RoundStatus
from tensorswap.rounds.engine import Coordinator
from tensorswap.rounds.protocol import APP, APP_INLINE
from tensorswap.rounds.protocol.cut import APP_ANNOUNCE, APP_STREAM
from tensorswap.rounds.protocol.push import APP_FETCH
from tensorswap.rounds.server import RoundServer
from tensorswap.store import MemoryStore
from tensorswap.wire import BlockClient, BlockServer, memory_pair

RID = RoundId(1, "lead")


class WaitSeen(RoundServer):
    def __init__(self, coordinator: Coordinator) -> None:
        super().__init__(coordinator)
        self.waiting = asyncio.Event()

    async def _wait(self, rid: RoundId, timeout: float | None) -> RoundStatus:
        self.waiting.set()
        return await super()._wait(rid, timeout)


def test_the_round_server_composes_a_block_server() -> None:
    with Coordinator(MemoryStore(), run_timer=False) as coordinator:
        server = RoundServer(coordinator, max_connections=5)
        assert not isinstance(server, BlockServer)
        assert isinstance(server.blocks, BlockServer)
        cut = {APP_ANNOUNCE, APP_STREAM}
        assert server.blocks.handlers.keys() == {APP, APP_INLINE, APP_FETCH, *cut}
        assert server.store is coordinator.store is server.blocks.store
        assert server.stats is server.blocks.stats and server.errors is server.blocks.errors
        assert server.max_connections == server.blocks.max_connections == 5


async def test_lifecycle_and_address_are_the_block_servers() -> None:
    with Coordinator(MemoryStore(), run_timer=False) as coordinator:
        async with await RoundServer(coordinator).start("127.0.0.1", 0) as server:
            assert server.blocks.listener is server.listener is not None
            assert server.address == ("127.0.0.1", server.port) and server.port > 0
            assert server.blocks.port == server.port
        assert server.listener is not None and server.listener.connections == 0


async def test_waits_are_woken_on_a_server_that_was_never_started() -> None:
    """``handle`` alone (an in-memory transport, no listener) serves rounds, waits included."""
    with Coordinator(MemoryStore(), run_timer=False) as coordinator:
        server = WaitSeen(coordinator)
        pairs = [memory_pair(), memory_pair()]
        serving = [asyncio.ensure_future(server.handle(end)) for _, end in pairs]
        a, b = [
            RoundClient(await BlockClient.open(end), name)
            for (end, _), name in zip(pairs, "ab", strict=True)
        ]
        async with a, b, asyncio.timeout(10):
            assert await a.start_round(RID, RoundSpec(1))
            waiting = asyncio.create_task(a.wait(RID, timeout=8))
            await server.waiting.wait()  # the wait request is being served
            await b.submit(RID, {"w": np.ones(3, np.float32)}, 1)
            assert isinstance(await waiting, Complete)
        await asyncio.gather(*serving)
        assert server.stats.connections == 2 and not server.errors


async def test_traffic_is_the_wire_count_of_open_and_closed_connections() -> None:
    with Coordinator(MemoryStore(), run_timer=False) as coordinator:
        async with await RoundServer(coordinator).start("127.0.0.1", 0) as server:
            assert server.traffic().bytes_in == 0 == server.traffic().open_connections
            async with await RoundClient.connect("127.0.0.1", server.port, peer="a") as first:
                await first.start_round(RID, RoundSpec(2))
                live = server.traffic()
                sent = first.blocks.transport.bytes_sent
                received = first.blocks.transport.bytes_received
                assert (live.bytes_in, live.bytes_out) == (sent, received)
                assert (live.connections, live.open_connections) == (1, 1)
            async with await RoundClient.connect("127.0.0.1", server.port, peer="b") as second:
                report = await second.server_status()
                assert int(report.stats["bytes_in"]) >= sent
                assert int(report.stats["connections"]) == 2
                # the coordinator's counters, then the wire's, then those of the services
                # attached (the cut-through's own: ``stat_sources``)
                wire = [k for k in report.stats if not k.startswith("cut_")]
                assert list(report.stats)[-6:] == [
                    "cut_held_bytes", "cut_awaited_chunks", "cut_rounds", "cut_folded",
                    "cut_paced_waits", "cut_pacing_off",
                ]  # fmt: skip
                assert wire[-14:] == [
                    "bytes_in",
                    "bytes_out",
                    "connections",
                    "open_connections",
                    "blocks_stored",
                    "blocks_served",
                    "inflight_bytes",
                    "inflight_peak_bytes",
                    "inflight_limit_bytes",
                    "inflight_waits",
                    "inflight_refused",
                    "pool_in_use_bytes",
                    "pool_idle_bytes",
                    "pool_working_set_bytes",
                ]
