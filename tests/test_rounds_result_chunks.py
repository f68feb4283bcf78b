"""A coordinator's ``result_chunk_bytes``: aggregates cut into chunks of that size, their
CID the one ``put_update`` gives for the same values and chunk size (content addressing
holds), whichever path stored them."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from helpers.net import running
from tensorswap.rounds import Coordinator, RoundClient, RoundServer
from tensorswap.rounds.core import LayerSpec, RoundId, RoundSpec
from tensorswap.rounds.engine.fold import Bounds, piece_key
from tensorswap.rounds.engine.result import put_pieces
from tensorswap.store import (
    DEFAULT_CHUNK_BYTES,
    MemoryStore,
    ModelUpdate,
    get_update,
    put_update,
    read_manifest,
)

PER = DEFAULT_CHUNK_BYTES // 4
SMALL = 256 * 1024


def pieces_of(values: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], Bounds]:
    """``values`` cut where put_update cuts default chunks (as contributions' pieces are)."""
    pieces, bounds = {}, {}
    for name, flat in values.items():
        edges = (*range(0, flat.size, PER), flat.size) if flat.size else (0,)
        bounds[name] = edges
        for start, stop in itertools.pairwise(edges):
            pieces[piece_key(name, start)] = flat[start:stop]
    return pieces, bounds


def test_pieces_hold_several_result_chunks_same_cid_as_put_update() -> None:
    rng = np.random.default_rng(3)
    values = {
        "big": rng.standard_normal(PER * 2 + PER // 3).astype(np.float32),
        "odd": rng.standard_normal(12_345).astype(np.float32),
        "empty": np.zeros(0, np.float32),
    }
    layout = tuple(LayerSpec(n, "float32", (v.size,)) for n, v in values.items())
    pieces, bounds = pieces_of(values)
    fast, slow = MemoryStore(), MemoryStore()
    kwargs = {"num_samples": 2, "metadata": {"round": "1-a"}, "name": "1-a"}
    cid = put_pieces(fast, pieces, bounds, layout, chunk_bytes=SMALL, **kwargs)  # type: ignore[arg-type]
    expected = put_update(slow, ModelUpdate(values, 2, {"round": "1-a"}, name="1-a"),
                          chunk_bytes=SMALL)  # fmt: skip
    assert cid == expected
    assert set(fast) == set(slow)
    big = read_manifest(fast, read_manifest(fast, cid).links()[0])
    assert len(big.links()) == -(-values["big"].nbytes // SMALL)  # 2.33 pieces -> 35 chunks


def test_result_chunks_larger_than_the_pieces_are_left_to_the_caller() -> None:
    values = {"w": np.ones(PER * 3, np.float32)}
    pieces, bounds = pieces_of(values)
    layout = (LayerSpec("w", "float32", (PER * 3,)),)
    store = MemoryStore()
    kwargs = {"num_samples": 1, "metadata": {}, "name": ""}
    got = put_pieces(store, pieces, bounds, layout, chunk_bytes=2 * DEFAULT_CHUNK_BYTES, **kwargs)  # type: ignore[arg-type]
    assert got is None
    assert store.size().blocks == 0


@pytest.mark.parametrize("strategy", ["fedavg", "median"])
async def test_a_coordinator_cuts_its_aggregates_at_result_chunk_bytes(
    tmp_path: Path, strategy: str
) -> None:
    rid = RoundId(1, "lead")
    coordinator = Coordinator.open(tmp_path / "c")
    coordinator.result_chunk_bytes = 64 * 1024
    rng = np.random.default_rng(5)
    ups = [rng.standard_normal(200_000).astype(np.float32) for _ in range(3)]
    try:
        async with running(RoundServer(coordinator)) as server:
            clients = [
                await RoundClient.connect("127.0.0.1", server.port, peer=f"p{i}") for i in range(3)
            ]
            try:
                await clients[0].start_round(rid, RoundSpec(3, strategy=strategy))
                for client, values in zip(clients, ups, strict=True):
                    await client.submit(rid, {"w": values}, 1)
                cid = await clients[0].result(rid, timeout=30)
                got = await clients[1].fetch_result(rid, timeout=30)
            finally:
                for client in clients:
                    await client.aclose()
    finally:
        coordinator.close()
    want = np.mean(ups, axis=0) if strategy == "fedavg" else np.median(ups, axis=0)
    np.testing.assert_allclose(got["w"], want, rtol=1e-5, atol=1e-6)
    store = clients[1].store
    tensor = read_manifest(store, read_manifest(store, cid).links()[0])
    assert len(tensor.links()) == -(-200_000 * 4 // (64 * 1024))  # 13 chunks, not 1
    # the CID is put_update's for these values at this chunk size
    update = get_update(store, cid)
    assert put_update(MemoryStore(), update, chunk_bytes=64 * 1024) == cid


def test_serve_refuses_a_result_chunk_out_of_range(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from tensorswap.cli.serve_cmd import serve

    for size in ("1KiB", "128MiB"):
        args = ["--listen", "127.0.0.1:0", "--data", str(tmp_path / "d"), "--result-chunk", size]
        outcome = CliRunner().invoke(serve, args)
        assert outcome.exit_code == 2
        assert "--result-chunk" in outcome.output
