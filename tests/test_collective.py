"""The collective all-reduce: peers join through a rendezvous and average among themselves."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from helpers.collective import KEY, close, cut_after_commit, group
from helpers.collective import rendezvous as start_rendezvous
from tensorswap.cid import Cid
from tensorswap.collective import Collective, Rendezvous
from tensorswap.wire import BlockServer


def test_two_peers_average_a_dict() -> None:
    async def main() -> list[dict[str, np.ndarray]]:
        server, rendezvous = await start_rendezvous()
        address = f"127.0.0.1:{server.port}"
        inputs = [{"w": np.full(10, float(i + 1), np.float32)} for i in range(2)]

        async def peer(i: int) -> dict[str, np.ndarray]:
            g = await Collective.join(address, group="g", peer=f"p{i}", size=2, key=KEY)
            async with g:
                return await g.all_reduce(inputs[i], weight=float(i + 1))

        try:
            return list(await asyncio.gather(peer(0), peer(1)))
        finally:
            await rendezvous.aclose()
            await server.aclose()

    results = asyncio.run(main())
    expected = np.full(10, (1 * 1 + 2 * 2) / 3, np.float32)
    for result in results:
        np.testing.assert_array_equal(result["w"], expected)


def test_four_peers_weighted_mean_identical_bits_over_calls() -> None:
    rng = np.random.default_rng(7)
    inputs = [
        {"a": rng.standard_normal((33, 17)).astype(np.float32), "b": rng.standard_normal(1000)}
        for _ in range(4)
    ]
    weights = [1.0, 2.0, 3.0, 0.5]

    async def main() -> list[list[dict[str, np.ndarray]]]:
        peers, server, rendezvous = await group(4)
        try:
            calls = []
            for _ in range(2):
                calls.append(
                    list(
                        await asyncio.gather(
                            *(p.all_reduce(inputs[i], weights[i]) for i, p in enumerate(peers))
                        )
                    )
                )
            assert [p.members for p in peers] == [["p0", "p1", "p2", "p3"]] * 4
            return calls
        finally:
            await close(peers, server, rendezvous)

    for results in asyncio.run(main()):
        for name in ("a", "b"):
            want = sum(w * x[name].astype(np.float64) for w, x in zip(weights, inputs, strict=True))
            want = want / sum(weights)
            assert results[0][name].dtype == np.float32
            np.testing.assert_allclose(results[0][name], want, rtol=1e-5, atol=1e-6)
            for other in results[1:]:
                assert other[name].tobytes() == results[0][name].tobytes()


def test_torch_in_torch_out() -> None:
    torch = pytest.importorskip("torch")

    async def main() -> list[dict[str, object]]:
        peers, server, rendezvous = await group(2)
        try:
            return list(
                await asyncio.gather(
                    *(
                        p.all_reduce({"w": torch.full((3, 4), float(i))})
                        for i, p in enumerate(peers)
                    )
                )
            )
        finally:
            await close(peers, server, rendezvous)

    for result in asyncio.run(main()):
        assert isinstance(result["w"], torch.Tensor)
        assert torch.equal(result["w"], torch.full((3, 4), 0.5))


def test_bytes_sent_counts_every_push_of_a_call() -> None:
    # Each peer pushes its share of every other member's slice, at once: the count must add
    # up all of them (each non-reducer then fetches each reduced slice, as many bytes again).
    rng = np.random.default_rng(5)
    inputs = [{"w": rng.standard_normal(40_000).astype(np.float32)} for _ in range(4)]

    async def main() -> list[tuple[int, int]]:
        peers, server, rendezvous = await group(4)
        try:
            await asyncio.gather(*(p.all_reduce(inputs[i]) for i, p in enumerate(peers)))
            return [(p.stats.bytes_sent, p.stats.bytes_received) for p in peers]
        finally:
            await close(peers, server, rendezvous)

    counts = asyncio.run(main())
    sent = sum(s for s, _ in counts)
    assert sent == sum(r for _, r in counts)
    assert sent >= 4 * 3 * inputs[0]["w"].nbytes // 4  # 3 of 4 slices from every peer


def test_int8_compression_sends_fewer_bytes_and_reports_error() -> None:
    rng = np.random.default_rng(3)
    inputs = [{"w": rng.standard_normal(1 << 16).astype(np.float32)} for _ in range(2)]

    async def run(compression: str) -> tuple[list[dict[str, np.ndarray]], list[int], float]:
        peers, server, rendezvous = await group(2, compression=compression)  # type: ignore[arg-type]
        try:
            out = await asyncio.gather(*(p.all_reduce(inputs[i]) for i, p in enumerate(peers)))
            sent = [p.stats.bytes_sent + p.stats.bytes_received for p in peers]
            return list(out), sent, peers[0].stats.compression_error
        finally:
            await close(peers, server, rendezvous)

    plain, plain_bytes, _ = asyncio.run(run("none"))
    packed, packed_bytes, error = asyncio.run(run("int8"))
    assert packed[0]["w"].tobytes() == packed[1]["w"].tobytes()
    assert sum(plain_bytes) / sum(packed_bytes) > 3.5
    assert 0 < error < 0.02
    np.testing.assert_allclose(packed[0]["w"], plain[0]["w"], atol=0.05)


def test_a_peer_cut_mid_call_is_dropped_and_survivors_agree() -> None:
    """p2 commits and then vanishes (its server and connections closed, as a crash would):
    the other three finish the same call with the mean of their own inputs."""
    inputs = [{"w": np.full(4096, float(i), np.float32)} for i in range(3)]

    async def main() -> list[dict[str, np.ndarray]]:
        peers, server, rendezvous = await group(3)
        victim = peers[2]
        await cut_after_commit(victim, inputs[2])
        try:
            out = await asyncio.gather(*(p.all_reduce(inputs[i]) for i, p in enumerate(peers[:2])))
            assert peers[0].members == ["p0", "p1"] and "p2" in peers[0].stats.dropped
            return list(out)
        finally:
            await close(peers[:2], server, rendezvous)

    results = asyncio.run(main())
    np.testing.assert_array_equal(results[0]["w"], np.full(4096, 0.5, np.float32))
    assert results[0]["w"].tobytes() == results[1]["w"].tobytes()


def test_a_lying_peer_is_named_and_excluded() -> None:
    """p1 commits to one input and sends another: its reducer names it, it is excluded, and
    the honest peers end with their own mean; the liar's call raises PeerExcluded."""
    from tensorswap.collective import PeerExcluded

    inputs = [{"w": np.full(3000, float(i), np.float32)} for i in range(3)]

    async def main() -> tuple[list[object], dict[str, str]]:
        peers, server, rendezvous = await group(3)
        liar = peers[1]

        def forge(committed: list[Cid]) -> list[Cid]:
            store = liar.store
            return [
                store.put(np.frombuffer(store.get(c), np.float32) + np.float32(100))
                for c in committed
            ]

        try:
            liar.tamper = forge
            out = await asyncio.gather(
                *(p.all_reduce(inputs[i]) for i, p in enumerate(peers)), return_exceptions=True
            )
            return list(out), dict(peers[0].stats.dropped)
        finally:
            await close(peers, server, rendezvous)

    results, dropped = asyncio.run(main())
    assert isinstance(results[1], PeerExcluded) and results[1].peer == "p1"
    assert "p1" in dropped and "commitment" in dropped["p1"]
    for i in (0, 2):
        np.testing.assert_array_equal(results[i]["w"], np.full(3000, 1.0, np.float32))  # type: ignore[index]


def test_blocking_twin_from_threads() -> None:
    import threading

    from tensorswap.collective import BlockingCollective

    async def start() -> tuple[BlockServer, Rendezvous]:
        return await start_rendezvous()

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server, rendezvous = asyncio.run_coroutine_threadsafe(start(), loop).result()
    address = f"127.0.0.1:{server.port}"
    results: dict[int, np.ndarray] = {}

    def peer(i: int) -> None:
        with BlockingCollective(address, group="b", peer=f"q{i}", size=2, key=KEY) as g:
            results[i] = g.all_reduce({"w": np.full(8, float(i), np.float32)})["w"]

    threads = [threading.Thread(target=peer, args=(i,)) for i in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        asyncio.run_coroutine_threadsafe(rendezvous.aclose(), loop).result()
        asyncio.run_coroutine_threadsafe(server.aclose(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
    np.testing.assert_array_equal(results[0], np.full(8, 0.5, np.float32))
    np.testing.assert_array_equal(results[1], results[0])


def test_bad_rendezvous_messages_are_typed_refusals() -> None:
    from tensorswap.collective import BadCollectiveMessage
    from tensorswap.collective.messages import Commit, Join, decode_call, encode

    with pytest.raises(BadCollectiveMessage):
        decode_call(b"\xc1 not msgpack")
    with pytest.raises(BadCollectiveMessage, match="group"):
        decode_call(encode(Join("x" * 1000, "p", 2, "", 1)))
    with pytest.raises(BadCollectiveMessage, match="size"):
        decode_call(encode(Join("g", "p", 100_000, "", 1)))
    with pytest.raises(BadCollectiveMessage, match="weight"):
        decode_call(encode(Commit("g", 0, "p", float("nan"), bytes(32), [])))
    with pytest.raises(BadCollectiveMessage, match="chunks"):
        decode_call(encode(Commit("g", 0, "p", 1.0, bytes(32), [b"c"] * (1 << 17))))


def test_diloco_peers_hold_identical_parameters_and_learn() -> None:
    torch = pytest.importorskip("torch")
    from tensorswap.collective import DiLoCo

    torch.manual_seed(0)
    target = torch.randn(8, 1)
    data = [torch.randn(64, 8) for _ in range(2)]

    async def main() -> tuple[list[object], list[float], float]:
        peers, server, rendezvous = await group(2)
        models = [torch.nn.Linear(8, 1, bias=False) for _ in range(2)]
        models[1].load_state_dict(models[0].state_dict())
        initial = float(((data[0] @ target - models[0](data[0])) ** 2).mean().detach())
        inner = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
        dilocos = [DiLoCo(m, g, inner_steps=5) for m, g in zip(models, peers, strict=True)]

        async def train(i: int) -> float:
            loss = torch.tensor(0.0)
            for _ in range(40):
                inner[i].zero_grad()
                loss = ((data[i] @ target - models[i](data[i])) ** 2).mean()
                loss.backward()
                inner[i].step()
                await dilocos[i].step()
            return float(loss.detach())

        try:
            losses = await asyncio.gather(train(0), train(1))
            return [m.weight.detach().clone() for m in models], list(losses), initial
        finally:
            await close(peers, server, rendezvous)

    weights, losses, initial = asyncio.run(main())
    assert torch.equal(weights[0], weights[1])  # type: ignore[arg-type]
    assert max(losses) < initial / 4


def test_a_late_joiner_takes_part_from_the_next_call() -> None:
    async def main() -> tuple[list[dict[str, np.ndarray]], list[str], list[str]]:
        peers, server, rendezvous = await group(2)
        first = await asyncio.gather(
            *(p.all_reduce({"w": np.full(5, float(i), np.float32)}) for i, p in enumerate(peers))
        )
        members_before = list(peers[0].members)
        late = await Collective.join(
            f"127.0.0.1:{server.port}", group="g", peer="late", size=2, key=KEY
        )
        peers.append(late)
        try:
            second = await asyncio.gather(
                *(
                    p.all_reduce({"w": np.full(5, float(i), np.float32)})
                    for i, p in enumerate(peers)
                )
            )
            assert first[0]["w"].tolist() == [0.5] * 5
            return list(second), members_before, list(late.members)
        finally:
            await close(peers, server, rendezvous)

    second, before, after = asyncio.run(main())
    assert before == ["p0", "p1"] and after == ["p0", "p1", "late"]
    for result in second:
        np.testing.assert_array_equal(result["w"], np.full(5, 1.0, np.float32))
