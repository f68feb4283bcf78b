"""Loss and reordering on real links (the network lab): rounds complete with nothing corrupted.

This kernel has no netem, iptables or nft. Loss comes from tbf with a shallow queue (what a
burst brings beyond the bucket and a few packets of queue is dropped, as at a real
bottleneck; the qdisc counts the drops) and from the packet shuffler (``netlab.reorder``,
a TUN device and a packet socket), which also reorders: it holds back every few packets
until later ones have gone. The kernel's own counters prove the faults happened: tbf's
drops, the sender's retransmitted segments, the receiver's out-of-order queue.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from helpers.netlab import connect, in_host, serve_in
from helpers.serve import Server
from tensorswap.netlab import Lab, TokenBucket
from tensorswap.netlab.reorder import Shuffler
from tensorswap.rounds import Coordinator, RoundId, RoundSpec
from tensorswap.store import MemoryStore, ModelUpdate, put_update

pytestmark = pytest.mark.timeout(180)

RID = RoundId(1, "lead")


def test_the_shuffler_holds_every_nth_packet_back_behind_later_ones() -> None:
    rule = Shuffler(every=3, depth=2, hold=1.0)
    out = []
    for i in range(1, 10):
        out += rule.take(bytes([i]), now=0.0)
    # 3 waits for 2 later packets (4, 5), 6 for (7, 8); 9 is still held
    assert out == [bytes([i]) for i in (1, 2, 4, 5, 3, 7, 8, 6)]
    assert rule.due(now=0.5) == []
    assert rule.wait(now=0.5) == pytest.approx(0.5)
    assert rule.due(now=1.0) == [bytes([9])]  # its hold ran out with nothing behind it
    assert rule.counters() == {"packets": 9, "reordered": 3, "dropped": 0}


def test_the_shuffler_drops_every_nth_packet_and_checks_its_rule() -> None:
    rule = Shuffler(every=100, depth=1, hold=1.0, drop=4)
    sent = [p for i in range(1, 13) for p in rule.take(bytes([i]), now=0.0)]
    assert sent == [bytes([i]) for i in range(1, 13) if i % 4]
    assert rule.counters()["dropped"] == 3
    for bad in ({"every": 1}, {"depth": 0}, {"hold": 0.0}, {"drop": -1}):
        with pytest.raises(ValueError, match="bad shuffle"):
            Shuffler(**{"every": 2, "depth": 1, "hold": 1.0, **bad})  # type: ignore[arg-type]


def test_a_shallow_tbf_limit_must_hold_a_packet() -> None:
    assert TokenBucket.mbit(20, limit=16 * 1024).limit == 16 * 1024
    with pytest.raises(ValueError, match="one full packet"):
        TokenBucket.mbit(20, limit=1000)


def expected_result(updates: dict[str, np.ndarray]) -> str:
    """The aggregate's CID, the same round run in this process on no network at all."""
    coordinator = Coordinator(MemoryStore(), run_timer=False)
    try:
        coordinator.start_round(RID, RoundSpec(len(updates)))
        for peer, values in sorted(updates.items()):
            cid = put_update(coordinator.store, ModelUpdate({"w": values}, 1))
            coordinator.submit(RID, peer, cid)
        return str(coordinator.result(RID, timeout=60))
    finally:
        coordinator.close()


@pytest.mark.slow
async def test_a_round_over_lossy_and_reordering_links_completes_uncorrupted(
    lab: Lab, tmp_path: Path, servers: list[Server]
) -> None:
    coord = lab.add_host("coord")
    lossy, shuffled = lab.add_host("lossy"), lab.add_host("shuffled")
    lossy.shape(20, limit=16 * 1024)  # 20 Mbit/s, 16 KiB of queue: bursts are cut
    up = shuffled.shuffle_to(coord, tmp_path / "up.json", every=6, depth=3, drop=50)
    down = coord.shuffle_to(shuffled, tmp_path / "down.json", every=5, depth=4, drop=60)
    data = tmp_path / "coordinator"
    servers.append(serve_in(coord, data, "--timeout", "60"))
    rng = np.random.default_rng(16)
    updates = {p: rng.standard_normal(512 * 1024, np.float32) for p in ("lossy", "shuffled")}

    async def lead() -> None:
        async with await connect(coord, "lead") as client:
            assert await client.start_round(RID, RoundSpec(2))

    await in_host(coord, lead)
    before = {h.name: h.tcp_counters() for h in (coord, lossy, shuffled)}

    async def peer(name: str) -> tuple[str, np.ndarray]:
        async with await connect(coord, name) as client:
            done = await client.submit(RID, {"w": updates[name]}, 1, wait=120)
            assert done.status.name == "Complete"
            result = await client.fetch_result(RID, timeout=120)
            return str(await client.result(RID)), result["w"]

    got = await asyncio.gather(
        in_host(lossy, lambda: peer("lossy")), in_host(shuffled, lambda: peer("shuffled"))
    )
    want = expected_result(updates)
    mean = (updates["lossy"] + updates["shuffled"]) / 2
    for cid, values in got:
        assert cid == want  # bit for bit the aggregate of a loss-free network
        np.testing.assert_allclose(values, mean, rtol=1e-6)
    np.testing.assert_array_equal(got[0][1], got[1][1])

    after = {h.name: h.tcp_counters() for h in (coord, lossy, shuffled)}

    def grew(host: str, counter: str) -> int:
        return after[host][counter] - before[host][counter]

    # the faults happened: tbf dropped, the senders retransmitted, receivers saw disorder
    assert sum(lossy.drops()) > 0
    assert grew("lossy", "RetransSegs") > 0
    ups, downs = up.stop(), down.stop()
    assert ups["reordered"] > 0 and ups["dropped"] > 0
    assert downs["reordered"] > 0 and downs["dropped"] > 0
    assert grew("coord", "TCPOFOQueue") > 0  # the shuffled upload came out of order
    assert grew("shuffled", "TCPOFOQueue") > 0  # and so did its download
    assert grew("shuffled", "RetransSegs") > 0 and grew("coord", "RetransSegs") > 0
