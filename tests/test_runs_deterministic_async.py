"""A deterministic asynchronous run (FedBuff): each buffer is folded in peer-name order, so
the versions' bits do not depend on the order the buffer's deltas arrived in, staleness
scales included (issue 25)."""

from __future__ import annotations

from itertools import permutations
from pathlib import Path

import numpy as np
import pytest

from tensorswap.rounds import Coordinator, FakeClock
from tensorswap.rounds.journal import DB_FILENAME
from tensorswap.runs import ClientRegistry, RunDatabase, RunManager, RunMode, RunSpec
from tensorswap.store import ModelUpdate, put_update

PEERS = [f"site-{i}" for i in range(6)]
VALUES = {
    "site-0": 5.0,
    "site-1": 1.0,
    "site-2": 1.0,
    "site-3": 1e20,
    "site-4": -1e20,
    "site-5": 2.0,
}
"""Deltas of very different magnitudes (all weighing 10 samples): in buffer 2, site-2's
small delta is lost when added to site-3's before site-4 cancels it, kept otherwise."""


def _versions(root: Path, order: tuple[str, ...], deterministic: bool) -> list[str]:
    """The run's version CIDs when buffer 2's deltas arrive in ``order`` (site-2's trained
    on version 0, so it is scaled for staleness; the others on version 1)."""
    clock = FakeClock()
    coord = Coordinator.open(root, clock=clock, run_timer=False, durable=False)
    journal = RunDatabase(root / DB_FILENAME, durable=False)
    manager = RunManager(coord, journal, ClientRegistry(journal, clock, inactive_after=60))
    try:
        model = {"w": np.zeros((4, 8), np.float32)}
        params = {"deterministic": 1} if deterministic else {}
        spec = RunSpec(mode=RunMode.ASYNC, buffer=3, max_staleness=2, rounds=2, params=params)
        for peer in PEERS:
            manager.registry.register(peer, {"num_samples": 10})
        manager.create_run("a", spec, put_update(coord.store, ModelUpdate(model)))
        manager.drain()

        def submit(peer: str, trained_on: int) -> None:
            task = manager.task("a", peer)
            assert task is not None
            delta = {"w": np.full((4, 8), VALUES[peer], np.float32)}
            update = put_update(coord.store, ModelUpdate(delta, 10))
            manager.submit(task.round_id, peer, update, trained_on=trained_on)

        for peer in ("site-0", "site-1", "site-5"):
            submit(peer, 0)
        manager.wait_version("a", 1, timeout=60)
        manager.drain()
        for peer in order:
            submit(peer, 0 if peer == "site-2" else 1)
        manager.wait_version("a", 2, timeout=60)
        manager.drain()
        return [str(v.global_cid) for v in manager.versions("a")]
    finally:
        manager.close()
        journal.close()
        coord.close()


def test_a_deterministic_async_run_gives_the_same_bits_in_any_arrival_order(
    tmp_path: Path,
) -> None:
    orders = list(permutations(("site-2", "site-3", "site-4")))
    runs = [_versions(tmp_path / f"d{i}", order, True) for i, order in enumerate(orders)]
    assert all(run == runs[0] for run in runs)
    assert len(runs[0]) == 3


def test_without_the_flag_the_arrival_order_shows_in_the_bits(tmp_path: Path) -> None:
    """The control: the same deltas folded as they arrive differ between orders."""
    orders = [("site-2", "site-3", "site-4"), ("site-4", "site-3", "site-2")]
    runs = [_versions(tmp_path / f"p{i}", order, False) for i, order in enumerate(orders)]
    assert runs[0][:2] == runs[1][:2]  # same first buffer
    assert runs[0][2] != runs[1][2]


@pytest.mark.parametrize("flag", [0, 1])
def test_the_flag_is_a_run_param(flag: int) -> None:
    assert RunSpec(mode=RunMode.ASYNC, params={"deterministic": flag}).deterministic is bool(flag)
