"""Secure runs over the wire: peers run SecAgg+ inside ``RunClient.submit``; the coordinator
learns the sum only (exactly the sum of the quantized inputs), survives dropouts, refuses
tampered and replayed messages with typed errors, and keeps no block that is one update."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("cryptography")

from helpers.secagg_runs import TIMEOUT, Served, serve_secure_runs
from helpers.secagg_runs import aggregate as _aggregate
from helpers.secagg_runs import base_model as _model
from helpers.secagg_runs import peer_delta as _delta
from helpers.secagg_runs import secagg_row as _secagg_row
from helpers.secagg_runs import secure_task as _task
from helpers.secagg_runs import train as _train
from tensorswap.cid import Cid, Multicodec
from tensorswap.privacy.secagg import (
    MalformedSecAggMessage,
    OutOfPhase,
    Quantizer,
    ReplayedMessage,
    SecureRoundFailed,
    UnknownParticipant,
    decode,
    encode,
)
from tensorswap.privacy.secagg import client as secagg_client
from tensorswap.privacy.secagg.protocol import KeysAdvert, MaskedInput, PeerKeys, SharesUpload
from tensorswap.privacy.secagg.quantize import max_bits
from tensorswap.rounds.core import Complete, Failed, RoundId
from tensorswap.rounds.storage import CoordinatorStore
from tensorswap.runs import InvalidRunSpec, RunSpec
from tensorswap.runs.client import RunClient
from tensorswap.runs.errors import RunsError
from tensorswap.runs.manager import Task
from tensorswap.runs.messages import SecAggRequest
from tensorswap.store import DirectoryStore, ModelUpdate, get_update
from tensorswap.store.manifest import UpdateManifest, read_manifest


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    async with serve_secure_runs(tmp_path) as running:
        yield running


async def test_the_unmasked_sum_is_exactly_the_sum_of_the_quantized_inputs(
    served: Served,
) -> None:
    peers = [await served.client(f"p{i}") for i in range(4)]
    try:
        spec = RunSpec(per_round=4, min_clients=4, rounds=1, secagg=True, secagg_clip=0.5)
        await peers[0].create_run("fl", spec, ModelUpdate(_model()))
        await asyncio.gather(*(_train(p, i) for i, p in enumerate(peers)))
        mean = await _aggregate(served.manager, "fl", 1)
        quantized = [p.secagg_quantized for p in peers]
        assert all(q is not None for q in quantized)
        total = np.sum(np.stack(quantized).astype(np.uint64), axis=0).astype(np.uint32)
        assert int(total[-1]) == sum(10 + i for i in range(4))  # the weights, in the sum
        expected = Quantizer(0.5, max_bits(4), 1 << 16).weighted_mean(total, 4)
        got = np.concatenate([mean["w"].ravel(), mean["b"].ravel()])
        np.testing.assert_array_equal(got, expected)  # bit for bit: the sum is exact
        # and it is FedAvg of the deltas, within the quantization bound
        weights = np.array([10 + i for i in range(4)], np.float64)
        plain = sum(w * _delta(i)["w"].astype(np.float64) for i, w in enumerate(weights))
        np.testing.assert_allclose(mean["w"], plain / weights.sum(), atol=1e-3)
        final = await peers[0].run("fl")
        assert final.finished and sorted(final.participants) == ["p0", "p1", "p2", "p3"]
        model = (await peers[0].rounds.fetch(Cid.parse(final.global_cid))).tensors
        np.testing.assert_allclose(model["w"], _model()["w"] + mean["w"], rtol=0, atol=1e-6)
    finally:
        for p in peers:
            await p.aclose()


@pytest.mark.parametrize("when", ["before", "after"])
async def test_two_of_eight_peers_drop_around_the_masked_input(
    served: Served, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """``before``: 2 vanish after the share phase (no masked input): the sum is the 6
    survivors'. ``after``: 2 vanish after sending it: all 8 are in the sum, unmasked from the
    6 that answer the unmask request."""
    gone = {"p3", "p6"}
    ids: dict[int, str] = {}
    target = "_on_shares" if when == "before" else "_on_unmask"
    original = getattr(secagg_client.SecAggClient, target)

    def vanish(self: secagg_client.SecAggClient, message: object) -> object:
        if ids.get(self.peer_id) in gone:
            raise ConnectionResetError("this peer vanished")
        return original(self, message)

    monkeypatch.setattr(secagg_client.SecAggClient, target, vanish)
    peers = [await served.client(f"p{i}") for i in range(8)]
    try:
        # a round deadline: without one the masked-input phase (peers train in it) waits for all
        spec = RunSpec(
            per_round=8, min_clients=8, quorum=0.5, rounds=1, secagg=True,
            secagg_phase_timeout_s=5.0, round_timeout_s=5.0,
        )  # fmt: skip
        await peers[0].create_run("fl", spec, ModelUpdate(_model()))
        names = sorted(p.peer for p in peers)
        ids.update(enumerate(names))
        done = asyncio.gather(*(_train(p, i) for i, p in enumerate(peers)), return_exceptions=True)
        phase = "masked input" if when == "before" else "unmask"  # the one they skip
        await served.advance_until(done, gone, 5.0, phase)
        results = await done
        failed = {p.peer for p, r in zip(peers, results, strict=True) if isinstance(r, Exception)}
        assert failed == gone
        mean = await _aggregate(served.manager, "fl", 1)
        _, survivors, dropped, _, _ = _secagg_row(served.manager, "fl", 1)
        counted = [i for i, p in enumerate(peers) if when == "after" or p.peer not in gone]
        assert json.loads(survivors) == sorted(peers[i].peer for i in counted)
        assert json.loads(dropped) == ([] if when == "after" else sorted(gone))
        weights = {i: 10 + i for i in counted}
        plain = sum(w * _delta(i)["w"].astype(np.float64) for i, w in weights.items())
        np.testing.assert_allclose(mean["w"], plain / sum(weights.values()), atol=1e-3)
    finally:
        for p in peers:
            await p.aclose()


async def test_a_peer_runs_the_key_phases_as_it_takes_its_task(served: Served) -> None:
    """``next_task`` begins the key phases (on a second connection): by the time the peers
    train, the round's session is past its shares; the same task is handed out again until
    it is submitted, and the secure round completes with the exact mean."""
    peers = [await served.client(f"p{i}") for i in range(3)]
    try:
        spec = RunSpec(per_round=3, min_clients=3, rounds=1, secagg=True)
        await peers[0].create_run("fl", spec, ModelUpdate(_model()))
        tasks = [await _task(p) for p in peers]
        session = served.manager.secure.session(tasks[0].round_id.as_key())
        assert session is not None
        for _ in range(500):  # no peer has trained or submitted: the keys are exchanged
            if session.phase == "masked input":
                break
            await asyncio.sleep(0.01)
        assert session.phase == "masked input" and session.joined == {p.peer for p in peers}
        assert await peers[0].next_task("fl", timeout=0) == tasks[0]  # held, not yet done
        statuses = []
        for i, (peer, task) in enumerate(zip(peers, tasks, strict=True)):
            model = await peer.fetch_model(task)
            new = {k: model[k] + _delta(i)[k] for k in model}
            statuses.append(peer.submit(task, new, num_samples=10 + i))
        await asyncio.gather(*statuses)
        mean = await _aggregate(served.manager, "fl", 1)
        weights = {i: 10 + i for i in range(3)}
        plain = sum(w * _delta(i)["w"].astype(np.float64) for i, w in weights.items())
        np.testing.assert_allclose(mean["w"], plain / sum(weights.values()), atol=1e-3)
        assert await peers[0].next_task("fl", timeout=0) is None  # submitted: none held
    finally:
        for p in peers:
            await p.aclose()


async def test_a_peer_that_closes_with_a_begun_task_leaves_nothing_running(
    served: Served,
) -> None:
    peers = [await served.client(f"p{i}") for i in range(2)]
    try:
        spec = RunSpec(per_round=2, min_clients=2, rounds=1, secagg=True, secagg_min_survivors=2)
        await peers[0].create_run("fl", spec, ModelUpdate(_model()))
        await _task(peers[0])  # its key phases wait for p1, which never asks
        held = peers[0].secure_tasks.work("fl")
        assert held is not None
        await asyncio.sleep(0.05)
        assert not held.done()
    finally:
        for p in peers:
            await p.aclose()
    assert held.cancelled() and peers[0].secure_tasks.connected() == []


async def test_a_begun_task_of_a_round_that_failed_gives_way_to_the_next_round(
    served: Served,
) -> None:
    """p0 begins round 1's key phases and waits for p1, which does not come before the
    round's deadline: round 1 fails, its waiting request is cancelled with its task (that
    connection is closed, never reused half-read), and round 2 goes through."""
    p0, p1 = await served.client("p0"), await served.client("p1")
    try:
        spec = RunSpec(
            per_round=2, min_clients=2, rounds=1, secagg=True, round_timeout_s=10.0,
            secagg_min_survivors=2,
        )  # fmt: skip
        await p0.create_run("fl", spec, ModelUpdate(_model()))
        first = await _task(p0)
        waiting = p0.secure_tasks.work("fl")
        assert waiting is not None
        session = served.manager.secure.session(first.round_id.as_key())
        assert session is not None
        for _ in range(500):  # p0 has joined: its setup request came
            if session.joined:
                break
            await asyncio.sleep(0.01)
        assert session.joined == {"p0"}
        served.clock.advance(11)  # round 1's deadline: one of two advertised, below t
        for _ in range(500):
            if (await p0.run("fl")).round == 2:
                break
            await asyncio.sleep(0.01)
        second = await _task(p0)  # the held round-1 task gives way
        assert second.round_id.round == 2 and waiting.done()
        assert p0.secure_tasks.held("fl") == second
        other = await _task(p1)

        async def train(i: int, peer: RunClient, task: Task) -> None:
            model = await peer.fetch_model(task)
            await peer.submit(task, {k: v + _delta(i)[k] for k, v in model.items()}, 10)

        await asyncio.gather(train(0, p0, second), train(1, p1, other))
        mean = await _aggregate(served.manager, "fl", 2)
        want = (_delta(0)["w"] + _delta(1)["w"]) / 2
        np.testing.assert_allclose(mean["w"], want, atol=1e-3)
    finally:
        await p0.aclose()
        await p1.aclose()


async def test_no_block_in_the_coordinators_store_is_one_peers_update(
    served: Served, tmp_path: Path
) -> None:
    peers = [await served.client(f"p{i}") for i in range(3)]
    try:
        spec = RunSpec(per_round=3, min_clients=3, rounds=1, secagg=True)
        await peers[0].create_run("fl", spec, ModelUpdate(_model()))
        await asyncio.gather(*(_train(p, i) for i, p in enumerate(peers)))
        await _aggregate(served.manager, "fl", 1)
    finally:
        for p in peers:
            await p.aclose()
    store = served.manager.store
    assert isinstance(store, DirectoryStore)
    secrets = []
    for i, peer in enumerate(peers):
        d = _delta(i)
        secrets += [d["w"], d["b"], _model()["w"] + d["w"]]
        assert peer.secagg_quantized is not None
        secrets.append(peer.secagg_quantized)
    raw = {bytes(np.ascontiguousarray(s).data) for s in secrets}
    updates = 0
    for cid in list(store):
        data = bytes(store.get(cid))
        assert data not in raw
        assert not any(r in data for r in raw)
        try:
            manifest = read_manifest(store, cid)
        except Exception:
            continue
        if not isinstance(manifest, UpdateManifest):
            continue
        updates += 1
        for values in get_update(store, cid).tensors.values():
            for secret in secrets:
                if np.shape(values) == np.shape(secret):
                    assert not np.allclose(values, secret, atol=1e-4)
    assert updates >= 3  # the initial model, the unmasked mean, the new version (at least)


async def test_masked_vectors_never_reach_a_file_and_go_once_folded(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = served.manager.store
    assert isinstance(store, CoordinatorStore)
    files: list[str] = []
    held: list[Cid] = []
    put = store.volatile.put

    def recording_write(point: str, path: str) -> None:
        if point == "write":
            files.append(path)

    def recording_put(cid: Cid, data: memoryview, adopt: bool) -> bool:
        held.append(cid)
        return put(cid, data, adopt)

    monkeypatch.setattr(store, "fault_point", recording_write)
    monkeypatch.setattr(store.volatile, "put", recording_put)
    peers = [await served.client(f"p{i}") for i in range(3)]
    try:
        spec = RunSpec(per_round=3, min_clients=3, rounds=1, secagg=True)
        await peers[0].create_run("fl", spec, ModelUpdate(_model()))
        await asyncio.gather(*(_train(p, i) for i, p in enumerate(peers)))
        await _aggregate(served.manager, "fl", 1)
    finally:
        for p in peers:
            await p.aclose()
    assert len(held) == 3 and {c.codec for c in held} == {Multicodec.TENSORSWAP_MASKED}
    assert not any(str(c) in path for c in held for path in files)
    assert files  # the models and the mean still go to files
    assert store.volatile.nbytes == 0 and not any(store.has(c) for c in held)


async def test_a_refused_masked_input_leaves_no_block(served: Served) -> None:
    peers = [await served.client(f"p{i}") for i in range(3)]
    try:
        spec = RunSpec(per_round=3, min_clients=3, rounds=1, secagg=True)
        await peers[0].create_run("fl", spec, ModelUpdate(_model()))
        me = peers[0]
        me.secure_ahead = False  # this test speaks the phases itself
        task = await _task(me)
        answer = await me.call(SecAggRequest(peer=me.peer, run="fl", round=1, after=0))
        setup = decode(answer.secagg or b"")
        local = me.rounds.store
        cid = local.put(bytes(4 * 37), codec=Multicodec.TENSORSWAP_MASKED)  # 36 values + weight
        await me.rounds.blocks.push(local, cid)
        assert served.manager.store.has(cid)
        early = MaskedInput(setup.config.round_id, answer.secagg_peer or 0, b"")  # type: ignore[union-attr]
        request = SecAggRequest(
            peer=me.peer, run="fl", round=task.round_id.round, after=1,
            message=encode(early), block=cid.to_bytes(),
        )  # fmt: skip
        with pytest.raises(OutOfPhase):  # the keys are still being advertised
            await me.call(request, long=True)
        assert not served.manager.store.has(cid)
    finally:
        for p in peers:
            await p.aclose()


async def test_replayed_forged_and_malformed_messages_are_refused_typed(
    served: Served,
) -> None:
    peers = [await served.client(f"p{i}") for i in range(3)]
    try:
        spec = RunSpec(per_round=3, min_clients=3, rounds=1, secagg=True)
        await peers[0].create_run("fl", spec, ModelUpdate(_model()))
        me = peers[0]
        me.secure_ahead = False  # this test speaks the phases itself
        task = await _task(me)

        def call(after: int, message: bytes = b"", timeout: float | None = None) -> SecAggRequest:
            return SecAggRequest(
                peer=me.peer, run="fl", round=task.round_id.round, after=after,
                message=message, timeout=timeout,
            )  # fmt: skip

        answer = await me.call(call(0))
        setup = decode(answer.secagg or b"")
        rid, index = setup.config.round_id, answer.secagg_peer  # type: ignore[union-attr]
        client = secagg_client.SecAggClient(index or 0, np.zeros(36, np.float32), 1)
        advert = client.handle(setup)
        assert isinstance(advert, KeysAdvert)
        other = (index or 0) + 1
        forged = KeysAdvert(round_id=rid, sender=other, keys=advert.keys)
        with pytest.raises(UnknownParticipant):  # speaking for another peer
            await me.call(call(1, encode(forged)), long=True)
        foreign = KeysAdvert(round_id=b"x" * 16, sender=index or 0, keys=advert.keys)
        from tensorswap.privacy.secagg import ForeignRound

        with pytest.raises(ForeignRound):
            await me.call(call(1, encode(foreign)), long=True)
        with pytest.raises(MalformedSecAggMessage):
            await me.call(call(1, b"\x93garbage"), long=True)
        first = await me.call(call(1, encode(advert), timeout=0.0), long=True)
        assert first.secagg is None  # the phase waits for the two others
        with pytest.raises(ReplayedMessage):
            await me.call(call(1, encode(advert)), long=True)
        bad_keys = PeerKeys(b"\x01" * 32, b"\x02" * 32, advert.keys.seed_commitment)
        with pytest.raises(ReplayedMessage):  # a second advert, other keys: still a replay
            await me.call(call(1, encode(KeysAdvert(rid, index or 0, bad_keys))), long=True)
        # a plain contribution to a secure run is refused: it would show the update
        with pytest.raises(RunsError, match="securely"):
            await me.rounds.submit(task.round_id, ModelUpdate(_model()), 1)
        # the two others join; the phase closes; this peer's share upload to a stranger fails
        others = asyncio.gather(*(_train(p, i) for i, p in enumerate(peers[1:], 1)))
        keys = decode((await me.call(call(1), long=True)).secagg or b"")
        shares = client.handle(keys)
        assert isinstance(shares, SharesUpload)
        stranger = SharesUpload(rid, index or 0, {**shares.ciphertexts, 99: b"x"})
        with pytest.raises(UnknownParticipant):
            await me.call(call(2, encode(stranger)), long=True)
        # tampered ciphertexts: their recipients accuse this peer (it is dropped) and carry
        # on; two usable inputs miss the quorum (and the floor): nothing is unmasked
        tampered = {d: c[:-1] + bytes([c[-1] ^ 1]) for d, c in shares.ciphertexts.items()}
        upload = encode(SharesUpload(rid, index or 0, tampered))
        await me.call(call(2, upload, timeout=0.0), long=True)
        with pytest.raises(SecureRoundFailed, match=r"p0. dropped: .*could not open its shares"):
            await others
    finally:
        for p in peers:
            await p.aclose()


async def test_a_round_below_threshold_fails_typed_and_a_new_round_follows(
    served: Served,
) -> None:
    peers = [await served.client(f"p{i}") for i in range(3)]
    try:
        spec = RunSpec(
            per_round=3, min_clients=3, rounds=1, secagg=True, round_timeout_s=10.0,
        )  # fmt: skip
        await peers[0].create_run("fl", spec, ModelUpdate(_model()))
        lone = asyncio.ensure_future(_train(peers[0], 0))
        await served.advance_until(lone, {"p1", "p2"}, 10.0)
        with pytest.raises(SecureRoundFailed, match="TooFewSurvivors"):
            await lone
        status = served.manager.coordinator.status(RoundId(1, "fl"))
        assert isinstance(status, Failed) and "secure aggregation" in status.reason
        await asyncio.to_thread(served.manager.drain, TIMEOUT)
        assert (await peers[0].run("fl")).round == 2  # a new round, a new sample
        await asyncio.gather(*(_train(p, i) for i, p in enumerate(peers)))
        info = await asyncio.to_thread(served.manager.wait_version, "fl", 1, TIMEOUT)
        assert info.version == 1
        assert isinstance(served.manager.coordinator.status(RoundId(2, "fl")), Complete)
    finally:
        for p in peers:
            await p.aclose()


def test_secure_specs_are_checked() -> None:
    with pytest.raises(InvalidRunSpec, match="min_clients"):
        RunSpec(secagg=True)
    with pytest.raises(InvalidRunSpec, match="need secagg"):
        RunSpec(secagg_threshold=3)
    with pytest.raises(InvalidRunSpec, match="dp_clipping='client'"):
        RunSpec(min_clients=3, secagg=True, dp_clip=1.0)
    with pytest.raises(InvalidRunSpec, match="auto"):
        RunSpec(min_clients=3, secagg=True, round_timeout_s="auto")
    RunSpec(min_clients=3, secagg=True, dp_clip=1.0, dp_clipping="client", dp_noise=0.5)
    # the survivor floor (3 by default): a 2-peer secure run must say it accepts that each
    # peer learns the other's delta
    with pytest.raises(InvalidRunSpec, match="secagg_min_survivors=3 needs min_clients >= 3"):
        RunSpec(min_clients=2, secagg=True)
    RunSpec(min_clients=2, secagg=True, secagg_min_survivors=2)
    with pytest.raises(InvalidRunSpec, match="secagg_min_survivors must be an int >= 2"):
        RunSpec(min_clients=3, secagg=True, secagg_min_survivors=1)
    with pytest.raises(InvalidRunSpec, match="need secagg"):
        RunSpec(secagg_min_survivors=4)
    from tensorswap.runs.step import check_policies

    with pytest.raises(InvalidRunSpec, match="threshold"):
        check_policies(RunSpec(per_round=8, min_clients=3, secagg=True, secagg_threshold=2))


@pytest.mark.parametrize("noise", [0.0, 0.8])
async def test_secure_and_differentially_private_clip_before_masking(
    served: Served, noise: float
) -> None:
    """Client-side clipping before masking (every peer weighs 1): the unmasked sum is the mean
    of the clipped deltas; with noise the coordinator adds it to that sum, and ε is spent."""
    peers = [await served.client(f"p{i}") for i in range(3)]
    try:
        spec = RunSpec(
            per_round=3, min_clients=3, rounds=1, secagg=True, dp_clip=0.5,
            dp_clipping="client", dp_noise=noise,
        )  # fmt: skip
        await peers[0].create_run("fl", spec, ModelUpdate(_model()))
        await asyncio.gather(*(_train(p, i) for i, p in enumerate(peers)))
        mean = await _aggregate(served.manager, "fl", 1)
        clipped = []
        for i in range(3):
            d = np.concatenate([_delta(i)["w"].ravel(), _delta(i)["b"].ravel()])
            clipped.append(d * min(1.0, 0.5 / float(np.linalg.norm(d))))
        want = np.mean(clipped, axis=0)
        got = np.concatenate([mean["w"].ravel(), mean["b"].ravel()])
        np.testing.assert_allclose(got, want, atol=1e-6)  # weights 1: the plain mean
        row = await peers[0].run("fl")
        steps = served.manager.privacy.steps("fl")
        assert len(steps) == 1 and steps[0].contributors == 3
        final = (await peers[0].rounds.fetch(Cid.parse(row.global_cid))).tensors
        moved = np.concatenate([(final[k] - _model()[k]).ravel() for k in ("w", "b")])
        if noise == 0:
            np.testing.assert_allclose(moved, want, atol=1e-6)
            assert row.epsilon is not None
        else:
            assert not np.allclose(moved, want, atol=1e-3)  # noised
            assert row.epsilon is not None and 0 < row.epsilon < float("inf")
    finally:
        for p in peers:
            await p.aclose()
