"""Swarm distribution over loopback: peers fetch a result from the coordinator and each other."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from helpers.net import CertFiles, running
from helpers.serve import SECRET, Server
from tensorswap.cid import Cid, Multicodec
from tensorswap.rounds.client import RoundClient
from tensorswap.rounds.core import FakeClock, RoundId, RoundSpec
from tensorswap.rounds.engine import Coordinator
from tensorswap.rounds.server import RoundServer
from tensorswap.store import MemoryStore, ModelUpdate, get_update, put_update
from tensorswap.swarm import SwarmPeer, SwarmReadOnly, SwarmTracker
from tensorswap.swarm.messages import TRACKER_APP, HoldersQuery, decode_answer, encode
from tensorswap.transport import TransportError
from tensorswap.wire import BlockClient, BlockServer, RemoteError
from tensorswap.wire.auth import client_ssl_context, server_ssl_context
from tensorswap.wire.connection import FrameConnection

KEY = b"swarm-test-key"
CHUNK = 16 * 1024


def model(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w": rng.standard_normal(64 * 1024, np.float32),  # 16 chunks of 16 KiB
        "b": rng.standard_normal(8 * 1024, np.float32),  # 2
    }


@pytest.fixture
async def coordinator() -> AsyncIterator[tuple[BlockServer, Cid]]:
    store = MemoryStore()
    root = put_update(store, ModelUpdate(model(), 10), chunk_bytes=CHUNK)
    server = BlockServer(store, key=KEY)
    SwarmTracker(store).attach(server)
    async with running(server):
        yield server, root


def bytes_out(server: BlockServer) -> int:
    return int(server.stats.bytes_out)


async def fetch(server: BlockServer, peer: SwarmPeer, root: Cid) -> tuple[int, int]:
    async with await BlockClient.connect("127.0.0.1", server.port, key=KEY) as client:
        report = await peer.fetch(client, root)
    assert np.array_equal(get_update(peer.store, root).tensors["w"], model()["w"])
    return report.from_coordinator, report.from_peers


async def test_later_peers_fetch_from_the_earlier_ones(
    coordinator: tuple[BlockServer, Cid],
) -> None:
    server, root = coordinator
    nbytes = sum(v.nbytes for v in model().values())
    async with (
        SwarmPeer(MemoryStore(), peer="p0", key=KEY) as p0,
        SwarmPeer(MemoryStore(), peer="p1", key=KEY) as p1,
        SwarmPeer(MemoryStore(), peer="p2", key=KEY) as p2,
    ):
        first = await fetch(server, p0, root)
        assert first[1] == 0 and first[0] >= nbytes  # only the coordinator held it
        sent = bytes_out(server)
        second = await fetch(server, p1, root)
        third = await fetch(server, p2, root)
        assert second[0] == third[0] == 0  # every chunk came from a peer
        assert second[1] >= nbytes and third[1] >= nbytes
        # the coordinator sent the manifests and tracker answers: a few KiB, not 2 models
        assert bytes_out(server) - sent < nbytes // 20


async def test_peers_fetching_together_share_the_coordinators_bytes(
    coordinator: tuple[BlockServer, Cid],
) -> None:
    server, root = coordinator
    nbytes = sum(v.nbytes for v in model().values())
    peers = [SwarmPeer(MemoryStore(), peer=f"p{i}", key=KEY, batch=1) for i in range(4)]
    for peer in peers:
        await peer.start()
    try:
        results = await asyncio.gather(*(fetch(server, p, root) for p in peers))
    finally:
        for peer in peers:
            await peer.aclose()
    assert sum(c + p for c, p in results) >= 4 * nbytes
    assert sum(c for c, _ in results) < 4 * nbytes  # some chunks never crossed its link twice


class LyingStore(MemoryStore):
    """A store whose chunks read back with one byte flipped (a bad disk, or a liar)."""

    lying = False

    def get(self, cid: Cid, *, verify: bool | None = None) -> memoryview:
        view = super().get(cid, verify=verify)
        if not self.lying or cid.codec is not Multicodec.RAW:
            return view
        data = bytearray(view)
        data[len(data) // 2] ^= 0xFF
        return memoryview(bytes(data))


async def test_a_lying_peer_costs_a_retry_never_a_wrong_value(
    coordinator: tuple[BlockServer, Cid],
) -> None:
    server, root = coordinator
    store = LyingStore()
    async with (
        SwarmPeer(store, peer="liar", key=KEY) as liar,
        SwarmPeer(MemoryStore(), peer="honest", key=KEY) as honest,
    ):
        await fetch(server, liar, root)
        store.lying = True
        async with await BlockClient.connect("127.0.0.1", server.port, key=KEY) as client:
            report = await honest.fetch(client, root)
        assert np.array_equal(get_update(honest.store, root).tensors["w"], model()["w"])
        (liars,) = [r for r in report.sources if r.name == "liar"]
        assert liars.failed is not None and "Mismatch" in liars.failed
        assert liars.blocks == 0 and report.from_coordinator > 0  # retried there


async def test_a_peer_that_goes_away_mid_fetch(coordinator: tuple[BlockServer, Cid]) -> None:
    server, root = coordinator
    async with SwarmPeer(MemoryStore(), peer="leaver", key=KEY) as leaver:
        await fetch(server, leaver, root)
        seeder = leaver.seeder
        assert seeder is not None
        served = 0
        original = seeder.server._answer_get

        async def answer_once(conn: FrameConnection, *args: Any, **kwargs: Any) -> None:
            nonlocal served  # the leaver serves one Get, then its connection dies
            served += 1
            if served > 1:
                conn.transport.abort()
                raise ConnectionResetError("the seeder went away")
            await original(conn, *args, **kwargs)

        seeder.server._answer_get = answer_once  # type: ignore[method-assign]
        async with SwarmPeer(MemoryStore(), peer="stayer", key=KEY, batch=1) as stayer:
            got = await fetch(server, stayer, root)
        assert served >= 2 and got[1] > 0 and got[0] > 0


async def test_a_peer_that_opts_out_is_never_listed(coordinator: tuple[BlockServer, Cid]) -> None:
    server, root = coordinator
    async with SwarmPeer(MemoryStore(), peer="quiet", key=KEY, serve=False) as quiet:
        assert (await fetch(server, quiet, root))[1] == 0
        async with await BlockClient.connect("127.0.0.1", server.port, key=KEY) as client:
            body = await client.request(TRACKER_APP, encode(HoldersQuery(root.to_bytes())))
        assert decode_answer(body).holders == []


async def test_an_unreachable_holder_falls_back_to_other_sources(
    coordinator: tuple[BlockServer, Cid],
) -> None:
    server, root = coordinator
    ghost = SwarmPeer(MemoryStore(), peer="ghost", key=KEY, advertise=("127.0.0.1", 1))
    async with ghost, SwarmPeer(MemoryStore(), peer="late", key=KEY) as late:
        await fetch(server, ghost, root)  # announced at 127.0.0.1:1, where nobody listens
        async with await BlockClient.connect("127.0.0.1", server.port, key=KEY) as client:
            report = await late.fetch(client, root)
        assert report.dial_failures and report.from_coordinator > 0


async def test_a_seeder_refuses_pushes(coordinator: tuple[BlockServer, Cid]) -> None:
    server, root = coordinator
    async with SwarmPeer(MemoryStore(), peer="seed", key=KEY) as seed:
        await fetch(server, seed, root)
        assert seed.seeder is not None
        other = MemoryStore()
        pushed = put_update(other, ModelUpdate(model(5), 1), chunk_bytes=CHUNK)
        async with await BlockClient.connect("127.0.0.1", seed.seeder.port, key=KEY) as c:
            # ERROR store_error, or the reset that follows it while the client still sends
            with pytest.raises((RemoteError, TransportError)):
                await c.push(other, pushed)
        assert any(isinstance(e, SwarmReadOnly) for e in seed.seeder.server.errors)


async def test_a_seeder_serves_only_what_it_announced(coordinator: tuple[BlockServer, Cid]) -> None:
    server, root = coordinator
    async with SwarmPeer(MemoryStore(), peer="seed", key=KEY) as seed:
        # its own update, in the same store
        private = put_update(seed.store, ModelUpdate(model(7), 1), chunk_bytes=CHUNK)
        await fetch(server, seed, root)
        assert seed.seeder is not None
        async with await BlockClient.connect("127.0.0.1", seed.seeder.port, key=KEY) as c:
            assert await c.get_blocks([private], MemoryStore()) == [private]
            assert await c.get_blocks([root], MemoryStore()) == []


async def test_a_wrong_key_is_refused_by_a_seeder(coordinator: tuple[BlockServer, Cid]) -> None:
    server, root = coordinator
    async with SwarmPeer(MemoryStore(), peer="seed", key=KEY) as seed:
        await fetch(server, seed, root)
        assert seed.seeder is not None
        with pytest.raises(Exception) as info:
            await BlockClient.connect("127.0.0.1", seed.seeder.port, key=b"wrong")
        assert type(info.value).__name__ == "AuthenticationFailed"


async def test_fetch_result_of_a_round_through_the_swarm(tmp_path: Path) -> None:
    rid = RoundId(1, "lead")
    with Coordinator.open(tmp_path, clock=FakeClock(), run_timer=False, durable=False) as coord:
        server = RoundServer(coord, key=KEY)
        tracker = SwarmTracker(coord.store).attach(server.blocks)
        async with running(server):
            clients = [
                await RoundClient.connect("127.0.0.1", server.port, peer=f"p{i}", key=KEY)
                for i in range(3)
            ]
            try:
                assert await clients[0].start_round(rid, RoundSpec(3))
                for i, client in enumerate(clients):
                    await client.submit(rid, {"w": np.full(1000, float(i), np.float32)}, 1)
                for client in clients:
                    async with SwarmPeer(client.store, peer=client.peer, key=KEY) as peer:
                        got = await peer.fetch_result(client, rid, timeout=30)
                    np.testing.assert_allclose(got["w"], 1.0)
            finally:
                for client in clients:
                    await client.aclose()
        assert tracker.announces == 3


async def test_a_swarm_fetch_into_the_clients_own_store_keeps_its_latest_rounds_only(
    tmp_path: Path,
) -> None:
    with Coordinator.open(tmp_path, clock=FakeClock(), run_timer=False, durable=False) as coord:
        server = RoundServer(coord, key=KEY)
        SwarmTracker(coord.store).attach(server.blocks)
        async with running(server):
            client = await RoundClient.connect("127.0.0.1", server.port, peer="p", key=KEY)
            results = []
            try:
                async with SwarmPeer(client.store, peer="p", key=KEY) as peer:
                    for r in range(1, 5):
                        rid = RoundId(r, "lead")
                        await client.start_round(rid, RoundSpec(1))
                        values = np.random.default_rng(r).standard_normal(300_000, np.float32)
                        await client.submit(rid, {"w": values}, 1)
                        got = await peer.fetch_result(client, rid, timeout=30)
                        np.testing.assert_allclose(got["w"], values)
                        results.append(await client.result(rid))
            finally:
                await client.aclose()
    assert client.retention is not None
    assert client.retention.held_rounds == [RoundId(3, "lead"), RoundId(4, "lead")]
    assert not client.store.has(results[0]) and client.store.has(results[-1])


@pytest.mark.slow
async def test_tensorswap_serve_tracks_holders(tmp_path: Path, servers: list[Server]) -> None:
    serve = Server(tmp_path / "coordinator")
    servers.append(serve)
    key, rid = SECRET.encode(), RoundId(1, "lead")
    values = np.arange(300_000, dtype=np.float32)
    connect = RoundClient.connect
    async with (
        await connect("127.0.0.1", serve.port, peer="a", key=key) as a,
        await connect("127.0.0.1", serve.port, peer="b", key=key) as b,
    ):
        assert await a.start_round(rid, RoundSpec(2))
        await a.submit(rid, {"w": values}, 1)
        await b.submit(rid, {"w": values + 2}, 1)
        async with (
            SwarmPeer(a.store, peer="a", key=key) as first,
            SwarmPeer(MemoryStore(), peer="b", key=key) as second,
        ):
            np.testing.assert_allclose((await first.fetch_result(a, rid, 30))["w"], values + 1)
            cid = await b.result(rid)
            report = await second.fetch(b.blocks, cid)
            assert report.from_coordinator == 0 and report.from_peers > values.nbytes // 2


async def test_a_coordinator_without_a_tracker_is_a_plain_source() -> None:
    store = MemoryStore()
    root = put_update(store, ModelUpdate(model(), 10), chunk_bytes=CHUNK)
    async with (
        running(BlockServer(store, key=KEY)) as server,
        SwarmPeer(MemoryStore(), peer="p", key=KEY) as peer,
    ):
        coordinator_bytes, peer_bytes = await fetch(server, peer, root)
    assert peer_bytes == 0 and coordinator_bytes >= sum(v.nbytes for v in model().values())


async def test_seeders_speak_tls_like_the_coordinator(
    coordinator: tuple[BlockServer, Cid], cert_files: CertFiles
) -> None:
    server, root = coordinator
    cert, key = cert_files
    tls = {"server_ssl": server_ssl_context(cert, key), "client_ssl": client_ssl_context(cert)}
    async with (
        SwarmPeer(MemoryStore(), peer="seed", key=KEY, **tls) as seed,  # type: ignore[arg-type]
        SwarmPeer(MemoryStore(), peer="next", key=KEY, **tls) as later,  # type: ignore[arg-type]
    ):
        await fetch(server, seed, root)
        assert (await fetch(server, later, root))[0] == 0  # all from the seed, over TLS
