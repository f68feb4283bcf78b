"""Faults on real links (the network lab): a link down mid-upload, a peer partitioned for good,
the coordinator killed and restarted, a slow peer on a 1 Mbit/s link.

The coordinator is a `tensorswap serve` process in its own host; peers are RoundClients in
hosts of their own. Synchronisation is on state (the coordinator's stored blocks, a round's
status, events), never on sleeps.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import numpy as np
import pytest

from helpers.netlab import blocks_of, connect, held, in_host, model, serve_in, until
from helpers.serve import Server
from tensorswap.netlab import Lab
from tensorswap.rounds import Backoff, RoundClient, retrying
from tensorswap.rounds.core import Collecting, Complete, RoundId, RoundSpec
from tensorswap.transport import TransportError

pytestmark = pytest.mark.timeout(180)


async def start_round(coordinator: str, rid: RoundId, spec: RoundSpec) -> None:
    async with await connect(coordinator, rid.initiator) as lead:
        assert await lead.start_round(rid, spec)


@pytest.mark.slow
async def test_a_link_down_mid_upload_then_up_resends_only_the_missing_blocks(
    lab: Lab, tmp_path: Path, servers: list[Server]
) -> None:
    coord, flaky = lab.add_host("coord"), lab.add_host("flaky", mbit=20)
    data = tmp_path / "coordinator"
    servers.append(serve_in(coord, data, "--timeout", "5"))
    rid = RoundId(1, "lead")
    await in_host(coord, lambda: start_round(coord.address, rid, RoundSpec(1)))
    tensors = model(1.0)  # 32 chunks of 128 KiB, 4 MiB: ~1.7 s at 20 Mbit/s
    cids, sizes = blocks_of(tensors, 10)
    size_of = dict(zip(cids, sizes, strict=True))

    async def first_try() -> None:
        async with await connect(coord, "flaky", read=3.0) as peer:
            await peer.submit(rid, tensors, 10)

    failing = in_host(flaky, first_try)
    await until(lambda: len(held(data, cids)) >= 8, "8 blocks of the upload stored")
    flaky.link_down()
    with pytest.raises(TransportError):  # the peer notices (its send or read times out)
        await failing
    stored = held(data, cids)
    assert 8 <= len(stored) < len(cids)
    flaky.link_up()

    async def retry() -> tuple[int, int, int, dict[str, np.ndarray]]:
        async with await connect(coord, "flaky") as peer:
            done = await peer.submit(rid, tensors, 10)
            result = await peer.fetch_result(rid, timeout=60)
        return done.push.offered, done.push.sent_blocks, done.push.sent_bytes, result

    offered, sent_blocks, sent_bytes, result = await in_host(flaky, retry)
    missing = [cid for cid in cids if cid not in set(stored)]
    assert offered == len(cids)
    assert sent_blocks == len(missing)
    assert sent_bytes == sum(size_of[cid] for cid in missing) < sum(sizes)
    np.testing.assert_array_equal(result["t05"], tensors["t05"])


@pytest.mark.slow
async def test_a_peer_partitioned_for_good_the_round_completes_by_quorum_at_its_deadline(
    lab: Lab, tmp_path: Path, servers: list[Server]
) -> None:
    coord = lab.add_host("coord")
    a, b, lost = lab.add_host("a"), lab.add_host("b"), lab.add_host("lost", mbit=5)
    data = tmp_path / "coordinator"
    servers.append(serve_in(coord, data, "--timeout", "60"))  # its stuck connection stays
    rid = RoundId(1, "lead")
    await in_host(coord, lambda: start_round(coord.address, rid, RoundSpec(3, 2, 6.0)))
    big = model(9.0)
    cids, _ = blocks_of(big, 1)

    async def upload() -> None:
        async with await connect(coord, "lost", read=2.0) as peer:
            await peer.submit(rid, big, 1)

    lost_try = in_host(lost, upload)
    await until(lambda: len(held(data, cids)) >= 1, "the lost peer's upload under way")
    lab.partition(lost)

    async def contribute(name: str, value: float) -> tuple[Collecting | Complete, np.ndarray]:
        async with await connect(coord, name) as peer:
            done = await peer.submit(rid, {"t00": np.full(8, value, np.float32)}, 1)
            # while the lost peer's connection hangs, this one is answered at once
            status = await peer.status(rid)
            assert isinstance(done.status, Collecting) and isinstance(status, Collecting)
            final = await peer.wait(rid, timeout=60)
            assert isinstance(final, Complete)
            return final, (await peer.fetch_result(rid, timeout=60))["t00"]

    results = await asyncio.gather(
        in_host(a, lambda: contribute("a", 1.0)), in_host(b, lambda: contribute("b", 3.0))
    )
    for final, values in results:
        assert isinstance(final, Complete)
        np.testing.assert_allclose(values, 2.0)  # a and b only
    with pytest.raises(TransportError):
        await lost_try

    async def report() -> tuple[int, list[str]]:
        async with await connect(coord, "a") as peer:
            (row,) = (await peer.server_status()).rounds
            return row.received, sorted(row.peers)

    assert await in_host(a, report) == (2, ["a", "b"])


@pytest.mark.slow
async def test_the_coordinator_killed_and_restarted_peers_reconnect_with_backoff(
    lab: Lab, tmp_path: Path, servers: list[Server]
) -> None:
    coord = lab.add_host("coord")
    hosts = {name: lab.add_host(name) for name in ("a", "b", "c")}
    data = tmp_path / "coordinator"
    first = serve_in(coord, data)
    servers.append(first)
    rid = RoundId(1, "lead")
    await in_host(coord, lambda: start_round(coord.address, rid, RoundSpec(3)))

    async def submit_a() -> None:
        async with await connect(coord, "a") as peer:
            await peer.submit(rid, {"w": np.full(4, 1.0, np.float32)}, 1)

    await in_host(hosts["a"], submit_a)
    first.kill()  # SIGKILL, inside its namespace

    retried = {name: threading.Event() for name in hosts}
    backoff = Backoff(first=0.05, factor=2.0, cap=0.5, give_up_after=120.0)

    def peer_loop(name: str, value: float) -> asyncio.Future[np.ndarray]:
        async def operation(client: RoundClient) -> np.ndarray:
            if name != "a":
                await client.submit(rid, {"w": np.full(4, value, np.float32)}, 1)
            return (await client.fetch_result(rid, timeout=60))["w"]

        async def run() -> np.ndarray:
            return await retrying(
                lambda: connect(coord, name, read=5.0),
                operation,
                backoff,
                on_retry=lambda attempt, exc, wait: retried[name].set(),
            )

        return in_host(hosts[name], run)

    loops = [peer_loop("a", 1.0), peer_loop("b", 2.0), peer_loop("c", 6.0)]
    await until(lambda: all(e.is_set() for e in retried.values()), "every peer to back off")
    servers.append(serve_in(coord, data))  # same data dir, same address and port
    for values in await asyncio.gather(*loops):
        np.testing.assert_allclose(values, 3.0)  # (1 + 2 + 6) / 3: a's contribution kept


@pytest.mark.slow
async def test_a_slow_peer_on_a_1_mbit_link_does_not_slow_the_others(
    lab: Lab, tmp_path: Path, servers: list[Server]
) -> None:
    coord, slow = lab.add_host("coord", mbit=200), lab.add_host("slow", mbit=1)
    fast = [lab.add_host(f"fast{i}", mbit=200) for i in range(2)]
    data = tmp_path / "coordinator"
    servers.append(serve_in(coord, data, "--timeout", "60"))
    slow_round, fast_round = RoundId(1, "slowlead"), RoundId(1, "fastlead")
    await in_host(coord, lambda: start_round(coord.address, slow_round, RoundSpec(1)))
    await in_host(coord, lambda: start_round(coord.address, fast_round, RoundSpec(2)))
    trickle = model(5.0, tensors=16)  # 2 MiB: ~17 s at 1 Mbit/s
    slow_cids, _ = blocks_of(trickle, 1)

    async def upload_slowly() -> None:
        async with await connect(coord, "slow", read=3.0) as peer:
            await peer.submit(slow_round, trickle, 1)

    slow_try = in_host(slow, upload_slowly)
    await until(lambda: len(held(data, slow_cids)) >= 1, "the slow upload under way")

    async def fast_peer(name: str, value: float) -> np.ndarray:
        async with await connect(coord, name) as peer:
            await peer.submit(fast_round, model(value, tensors=16), 1)
            return (await peer.fetch_result(fast_round, timeout=60))["t03"]

    results = await asyncio.gather(
        in_host(fast[0], lambda: fast_peer("fast0", 1.0)),
        in_host(fast[1], lambda: fast_peer("fast1", 3.0)),
    )
    for values in results:
        np.testing.assert_allclose(values, 2.0 + 3)
    assert not slow_try.done()  # the slow peer is still uploading
    assert len(held(data, slow_cids)) < len(slow_cids)
    slow.link_down()  # end it: its send times out
    with pytest.raises(TransportError):
        await slow_try
