"""The SecAgg+ probe of issue 23 over the wire: a peer that sends a bad share ciphertext to
an honest neighbour no longer makes it abort (which left the attacker and one honest peer as
the survivors, and the released sum minus the attacker's delta was that peer's delta). The
recipient accuses the sender, the sender is dropped, and no sum of fewer than
``secagg_min_survivors`` peers is ever unmasked."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import numpy as np
import pytest

pytest.importorskip("cryptography")

from helpers.secagg_runs import (
    Served,
    aggregate,
    base_model,
    peer_delta,
    secagg_row,
    serve_secure_runs,
    train,
)
from tensorswap.privacy.secagg import SecureRoundFailed, ShareDecryptionFailed
from tensorswap.privacy.secagg import client as secagg_client
from tensorswap.privacy.secagg.protocol import SharesUpload
from tensorswap.rounds.core import Failed, RoundId
from tensorswap.runs import RunSpec
from tensorswap.store import ModelUpdate


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    async with serve_secure_runs(tmp_path) as running:
        yield running


def _attack(monkeypatch: pytest.MonkeyPatch, ids: dict[int, str], attacker: str, victim: str):  # type: ignore[no-untyped-def]
    """Make ``attacker``'s share upload carry a corrupted ciphertext for ``victim``."""
    original = secagg_client.SecAggClient._on_keys

    def on_keys(self: secagg_client.SecAggClient, message: object) -> SharesUpload:
        upload = original(self, message)  # type: ignore[arg-type]
        if ids.get(self.peer_id) != attacker:
            return upload
        target = {name: i for i, name in ids.items()}[victim]
        bad = dict(upload.ciphertexts)
        bad[target] = bad[target][:-1] + bytes([bad[target][-1] ^ 1])
        return msgspec.structs.replace(upload, ciphertexts=bad)

    monkeypatch.setattr(secagg_client.SecAggClient, "_on_keys", on_keys)


async def _attacked_round(served: Served, monkeypatch: pytest.MonkeyPatch, n: int) -> list[object]:
    """A secure run of ``n`` peers (quorum 0.6) whose round 1 peer p0 attacks by sending p1
    a corrupted share; every peer's submit result (or exception), peers closed after."""
    ids: dict[int, str] = {}
    _attack(monkeypatch, ids, attacker="p0", victim="p1")
    peers = [await served.client(f"p{i}") for i in range(n)]
    try:
        spec = RunSpec(per_round=n, min_clients=n, quorum=0.6, rounds=1, secagg=True)
        await peers[0].create_run("fl", spec, ModelUpdate(base_model()))
        ids.update(enumerate(sorted(p.peer for p in peers)))
        return await asyncio.gather(
            *(train(p, i) for i, p in enumerate(peers)), return_exceptions=True
        )
    finally:
        for p in peers:
            await p.aclose()


async def test_the_probe_three_peers_quorum_06_unmask_nothing(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    results = await _attacked_round(served, monkeypatch, 3)
    # nobody aborts on the bad share (before: p1's submit raised ShareDecryptionFailed)
    assert not any(isinstance(r, ShareDecryptionFailed) for r in results)
    assert all(isinstance(r, SecureRoundFailed) for r in results[1:])
    phase, survivors, _, cid, reason = secagg_row(served.manager, "fl", 1)
    assert phase == "failed" and not cid and survivors == "[]"  # no sum was released
    assert "fewer than the floor of 3" in reason and "peer 0 dropped" in reason
    status = served.manager.coordinator.status(RoundId(1, "fl"))
    assert isinstance(status, Failed) and "BelowSurvivorFloor" in status.reason


async def test_with_five_peers_the_attacker_is_dropped_and_the_honest_mean_released(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    results = await _attacked_round(served, monkeypatch, 5)
    assert not any(isinstance(r, Exception) for r in results[1:])  # the honest finish
    mean = await aggregate(served.manager, "fl", 1)
    _, survivors, dropped, _, _ = secagg_row(served.manager, "fl", 1)
    assert json.loads(survivors) == ["p1", "p2", "p3", "p4"]
    assert json.loads(dropped) == ["p0"]
    weights = {i: 10 + i for i in (1, 2, 3, 4)}
    plain = sum(w * peer_delta(i)["w"].astype(np.float64) for i, w in weights.items())
    np.testing.assert_allclose(mean["w"], plain / sum(weights.values()), atol=1e-3)


async def test_an_attacker_whose_key_cannot_be_rebuilt_fails_the_round_by_name(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With 4 peers (k = 3, t = 3) one corrupted share leaves the attacker's mask key with 2
    holders: its masks cannot be removed, so the round fails (as it would for any peer that
    sends bad shares) and the reason names the attacker; nothing is unmasked."""
    results = await _attacked_round(served, monkeypatch, 4)
    assert not any(isinstance(r, ShareDecryptionFailed) for r in results)
    phase, _, _, cid, reason = secagg_row(served.manager, "fl", 1)
    assert phase == "failed" and not cid
    assert "TooFewShares" in reason and "'p0' dropped: ['p1'] could not open" in reason
