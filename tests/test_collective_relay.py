"""The NAT relay: a peer that opens no listener sends and receives through the rendezvous."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from helpers.collective import KEY, close, cut_after_commit
from helpers.collective import rendezvous as start_rendezvous
from tensorswap.cid import Cid
from tensorswap.collective import Collective, Rendezvous
from tensorswap.collective._relay import Relay, RelayRefused
from tensorswap.collective._state import CallState
from tensorswap.collective.messages import CommitInfo, Member, RelayPut
from tensorswap.store import MemoryStore
from tensorswap.wire import BlockServer


async def _group(relayed: str) -> tuple[list[Collective], BlockServer, Rendezvous]:
    """p0, p1, p2 of group "g"; ``relayed`` joins with no listener."""
    server, made = await start_rendezvous()
    address = f"127.0.0.1:{server.port}"
    peers = await asyncio.gather(
        *(
            Collective.join(
                address,
                group="g",
                peer=f"p{i}",
                size=3,
                key=KEY,
                listen=None if f"p{i}" == relayed else "127.0.0.1:0",
            )
            for i in range(3)
        )
    )
    return list(peers), server, made


def test_a_relayed_peer_takes_part_and_the_relay_is_emptied() -> None:
    """p1 opens no listener: all three get the weighted mean, bit-identical, over two calls;
    the roster marks p1 relayed, and the rendezvous's store holds nothing after each call."""
    rng = np.random.default_rng(11)
    inputs = [{"w": rng.standard_normal((300, 70)).astype(np.float32)} for _ in range(3)]
    weights = [1.0, 2.5, 0.5]

    async def main() -> tuple[list[list[Any]], bool, list[str], list[int]]:
        peers, server, made = await _group("p1")
        try:
            calls, held = [], []
            for _ in range(2):
                out = await asyncio.gather(
                    *(p.all_reduce(inputs[i], weights[i]) for i, p in enumerate(peers))
                )
                calls.append(list(out))
                held.append(len(list(server.store)) + made.relay.bytes)
            view = peers[0].view(0)
            assert view is not None
            listening = peers[1].server.listener is not None
            return calls, listening, [m.peer for m in view.participants if m.relayed], held
        finally:
            await close(peers, server, made)

    calls, listening, relayed, held = asyncio.run(main())
    assert not listening and relayed == ["p1"]
    assert held == [0, 0]
    want = sum(w * x["w"].astype(np.float64) for w, x in zip(weights, inputs, strict=True))
    want /= sum(weights)
    for results in calls:
        np.testing.assert_allclose(results[0]["w"], want, rtol=1e-5, atol=1e-6)
        for other in results[1:]:
            assert other["w"].tobytes() == results[0]["w"].tobytes()


def test_a_relayed_peer_that_dies_mid_call_is_dropped() -> None:
    """p2 (relayed) commits, then vanishes (its connections closed): it has no port to
    probe, so the rendezvous finds its connections closed and drops it; p0 and p1 end with
    the mean of their own inputs, bit-identical."""
    inputs = [{"w": np.full(5000, float(i), np.float32)} for i in range(3)]

    async def main() -> tuple[list[Any], dict[str, str]]:
        peers, server, made = await _group("p2")
        victim = peers[2]
        await cut_after_commit(victim, inputs[2])
        try:
            out = await asyncio.gather(*(p.all_reduce(inputs[i]) for i, p in enumerate(peers[:2])))
            assert peers[0].members == ["p0", "p1"]
            return list(out), dict(peers[0].stats.dropped)
        finally:
            await close(peers[:2], server, made)

    results, dropped = asyncio.run(main())
    assert "closed" in dropped["p2"]
    np.testing.assert_array_equal(results[0]["w"], np.full(5000, 0.5, np.float32))
    assert results[0]["w"].tobytes() == results[1]["w"].tobytes()


def test_a_peer_relaying_uncommitted_chunks_is_excluded_by_the_rendezvous() -> None:
    """p0 commits to one input and sends another to p1, which is relayed: the rendezvous
    refuses the first uncommitted block and drops p0 as a liar; p1 ends with its own input."""
    from tensorswap.collective import PeerExcluded

    async def main() -> tuple[list[Any], list[str]]:
        server, made = await start_rendezvous()
        address = f"127.0.0.1:{server.port}"
        peers = list(
            await asyncio.gather(
                Collective.join(address, group="g", peer="p0", size=2, key=KEY),
                Collective.join(address, group="g", peer="p1", size=2, key=KEY, listen=None),
            )
        )
        liar = peers[0]

        def forge(committed: list[Cid]) -> list[Cid]:
            store = liar.store
            return [store.put(np.frombuffer(store.get(c), np.float32) + 1) for c in committed]

        liar.tamper = forge
        try:
            out = await asyncio.gather(
                *(
                    p.all_reduce({"w": np.full(100, float(i), np.float32)})
                    for i, p in enumerate(peers)
                ),
                return_exceptions=True,
            )
            view = peers[1].view(0)
            assert view is not None
            return list(out), list(view.liars)
        finally:
            await close(peers, server, made)

    (lied, honest), liars = asyncio.run(main())
    assert isinstance(lied, PeerExcluded) and "relayed" in lied.reason
    assert liars == ["p0"]
    np.testing.assert_array_equal(honest["w"], np.full(100, 1.0, np.float32))


def test_the_relay_holds_only_committed_blocks_within_its_budget() -> None:
    """Admission: a committed chunk for a relayed reducer, nothing for a direct one, nothing
    uncommitted; a relayed reducer's reduced chunks at most twice the call's chunk count; no
    block beyond ``max_bytes``; a call's blocks go once every final member reported."""
    data = [bytes([i]) * 64 for i in range(6)]
    cids = [Cid.of(d) for d in data]
    members = [Member("a", "h", 1), Member("r", "", 0, relayed=True)]
    state = CallState(0, members, 2)
    for name in ("a", "r"):
        state.commits[name] = CommitInfo(1.0, bytes(32), [c.to_bytes() for c in cids[:2]])
    relay = Relay(MemoryStore(), max_bytes=3 * 64)

    def put(peer: str, j: int, i: int, reduced: bool = False) -> str | None:
        message = RelayPut("g", 0, peer, j, cids[i].to_bytes(), data[i], reduced)

        async def go() -> None:
            await relay.put(message, relay.admit(state, {"r"}, message))

        try:
            asyncio.run(go())
        except RelayRefused as exc:
            return f"{'liar: ' if exc.liar else ''}{exc}"
        return None

    assert put("a", 1, 1) is None  # a's committed chunk of slice 1, whose reducer r is relayed
    assert put("r", 0, 0) is not None and "not relayed" in str(put("r", 0, 0))
    assert str(put("a", 1, 0)).startswith("liar: ")  # chunk 0 is a's slice 0, not slice 1
    assert put("r", 1, 2, reduced=True) is None and put("r", 1, 3, reduced=True) is None
    assert "full" in str(put("r", 1, 4, reduced=True))
    assert "reduce" in str(put("a", 1, 5, reduced=True))
    relay.max_bytes = 1 << 20
    assert put("r", 1, 4, reduced=True) is None and put("r", 1, 5, reduced=True) is None
    assert "share" in str(put("r", 1, 0, reduced=True))  # a fifth: over 2 x 2 chunks
    state.final, state.roots = ["a", "r"], {"a": b"x"}
    relay.release_if_done(state, "g")
    assert relay.bytes == 5 * 64
    state.roots["r"] = b"x"
    relay.release_if_done(state, "g")
    assert relay.bytes == 0 and list(relay.store) == []
