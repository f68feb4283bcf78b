"""Fold order (issue 25, fault 1): a round's aggregate has the bits of its contributions
folded in the order their places were reserved, whatever happens between two submits.

float32 sums depend on the order of the adds; these updates span six orders of magnitude so
that any other order changes the last bits (each test checks that it would).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from tensorswap.cid import Cid
from tensorswap.errors import RoundsError
from tensorswap.rounds import (
    Collecting,
    Contribution,
    Coordinator,
    RoundDatabase,
    RoundId,
    RoundSpec,
    RoundTracker,
)
from tensorswap.store import DirectoryStore, MemoryStore, ModelUpdate, get_update, put_update

RID = RoundId(1, "r")
PEERS = ("p0", "p1", "p2", "p3", "p4")
SPECS = {
    "fedavg": RoundSpec(5),
    "mean": RoundSpec(5, strategy="mean"),
    "fedavg-clipped": RoundSpec(5, params={"max_norm": 50.0}),
    "trimmed_mean": RoundSpec(5, strategy="trimmed_mean", params={"trim_count": 1}),
    "multi_krum": RoundSpec(5, strategy="multi_krum", params={"byzantine": 1, "select": 3}),
}


def _updates() -> dict[str, ModelUpdate]:
    rng = np.random.default_rng(7)
    out = {}
    for i, peer in enumerate(PEERS):
        values = rng.standard_normal(50_000) * 10.0 ** (i - 2)
        out[peer] = ModelUpdate({"w": values.astype(np.float32)}, num_samples=3 + i)
    return out


def _aggregate(
    data: Path, spec: RoundSpec, order: Sequence[str], *, restart_after: int | None = None
) -> np.ndarray:
    """The round's aggregate with the peers submitting in ``order`` (the async scale 0.5 for
    the last one), the coordinator closed and reopened after ``restart_after`` submits."""
    updates = _updates()
    coord = Coordinator.open(data, run_timer=False)
    try:
        coord.start_round(RID, spec)
        cids = {peer: put_update(coord.store, u) for peer, u in updates.items()}
        for i, peer in enumerate(order):
            if i == restart_after:
                coord.close()
                coord = Coordinator.open(data, run_timer=False)
            coord.submit(RID, peer, cids[peer], scale=0.5 if peer == PEERS[-1] else 1.0)
        status = coord.tracker.wait(RID, timeout=60)
        assert status.name == "Complete", status
        update = get_update(coord.store, Cid.parse(status.cid))  # type: ignore[union-attr]
        return np.array(update.tensors["w"])
    finally:
        coord.close()


@pytest.mark.parametrize("name", sorted(SPECS))
def test_a_restart_between_any_two_submits_gives_the_same_bits(name: str, tmp_path: Path) -> None:
    spec = SPECS[name]
    straight = _aggregate(tmp_path / "straight", spec, PEERS)
    for k in range(len(PEERS) + 1):
        again = _aggregate(tmp_path / f"restart-{k}", spec, PEERS, restart_after=k)
        assert again.tobytes() == straight.tobytes(), f"{name}: restart after {k} submits"


def test_the_updates_tell_fold_orders_apart(tmp_path: Path) -> None:
    """Without this, the tests above could not fail: another order gives other bits."""
    forward = _aggregate(tmp_path / "a", SPECS["fedavg"], PEERS)
    backward = _aggregate(tmp_path / "b", SPECS["fedavg"], PEERS[::-1])
    assert forward.tobytes() != backward.tobytes()
    np.testing.assert_allclose(forward, backward, rtol=1e-5, atol=1e-6)


class _FailOnce(RoundDatabase):
    """A journal whose contribution write fails once for ``peer`` (a full disk, then space)."""

    peer = ""

    def add_contributions(self, items: Sequence[tuple]) -> list[BaseException | None]:  # type: ignore[type-arg, override]
        if any(row[0].peer == self.peer for row in items):
            self.peer = ""
            return [RoundsError("disk full") for _ in items]
        return super().add_contributions(items)


def test_a_failed_journal_write_after_its_fold_keeps_the_order(tmp_path: Path) -> None:
    """p1's write fails after its fold: the sums are rebuilt, and p2's submit refolds p0
    first, so the aggregate is that of p0, p2, p1, p3, p4 submitted without a failure."""
    store = MemoryStore()
    cids = {peer: put_update(store, u) for peer, u in _updates().items()}
    journal = _FailOnce.in_dir(tmp_path)
    journal.peer = "p1"
    with Coordinator(store, journal=journal, run_timer=False, owns=True) as coord:
        coord.start_round(RID, SPECS["fedavg"])
        coord.submit(RID, "p0", cids["p0"])
        with pytest.raises(RoundsError, match="disk full"):
            coord.submit(RID, "p1", cids["p1"])
        for peer in ("p2", "p1", "p3", "p4"):
            coord.submit(RID, peer, cids[peer], scale=0.5 if peer == "p4" else 1.0)
        status = coord.tracker.wait(RID, timeout=60)
        got = np.array(get_update(coord.store, Cid.parse(status.cid)).tensors["w"])  # type: ignore[union-attr]
    want = _aggregate(tmp_path / "plain", SPECS["fedavg"], ("p0", "p2", "p1", "p3", "p4"))
    assert got.tobytes() == want.tobytes()


def test_contributions_journaled_out_of_order_are_listed_in_fold_order(tmp_path: Path) -> None:
    """Two threads reserve a then b and journal b first: the tracker lists a, b, and so does
    a tracker rebuilt from the journal (the order a restarted coordinator refolds them in)."""
    with RoundDatabase.in_dir(tmp_path) as journal:
        tracker = RoundTracker(journal=journal)
        tracker.start(RID, RoundSpec(3))
        made = [Contribution(RID, p, f"bafk{p}", 1, 4, 0.0) for p in ("a", "b", "c")]
        ta, tb = tracker.reserve(made[0]), tracker.reserve(made[1])
        assert [c.peer for c in tracker.in_fold_order(RID)] == ["a", "b"]
        assert tracker.record([tb]) == [Collecting(1, 3)]
        assert tracker.record([ta]) == [Collecting(2, 3)]
        assert [c.peer for c in tracker.contributions(RID)] == ["a", "b"]
    with RoundDatabase.in_dir(tmp_path) as journal:
        again = RoundTracker(journal=journal)
        assert [c.peer for c in again.contributions(RID)] == ["a", "b"]
        (tc,) = [again.reserve(made[2])]
        again.record([tc])
        assert [c.peer for c in again.in_fold_order(RID)] == ["a", "b", "c"]


def _blocks(data: Path) -> DirectoryStore:
    return DirectoryStore(data / "blocks")


def _reopen(data: Path) -> Coordinator:
    journal = RoundDatabase.in_dir(data)
    return Coordinator(_blocks(data), journal=journal, run_timer=False, owns=True)


def _with_gaps(data: Path, restart_again: bool) -> bytes:
    """p1's and p2's writes fail (two places given back: a gap in the journal's numbers);
    after a restart p1 submits again, then (with ``restart_again``) another restart, then p2
    and p4: the aggregate's bytes."""
    journal = _FailOnce.in_dir(data)
    with Coordinator(_blocks(data), journal=journal, run_timer=False, owns=True) as coord:
        coord.start_round(RID, SPECS["fedavg"])
        cids = {peer: put_update(coord.store, u) for peer, u in _updates().items()}
        coord.submit(RID, "p0", cids["p0"])
        for peer in ("p1", "p2"):
            journal.peer = peer
            with pytest.raises(RoundsError, match="disk full"):
                coord.submit(RID, peer, cids[peer])
        coord.submit(RID, "p3", cids["p3"])
    coord = _reopen(data)
    try:
        coord.submit(RID, "p1", cids["p1"])
        if restart_again:
            coord.close()
            coord = _reopen(data)
        coord.submit(RID, "p2", cids["p2"])
        coord.submit(RID, "p4", cids["p4"], scale=0.5)
        status = coord.tracker.wait(RID, timeout=60)
        return get_update(coord.store, Cid.parse(status.cid)).tensors["w"].tobytes()  # type: ignore[union-attr]
    finally:
        coord.close()


def test_places_given_back_by_failed_writes_never_reorder_a_later_restart(tmp_path: Path) -> None:
    """A restart renumbers the journal's places by rank: a place taken after it always
    comes after the older ones, so one more restart refolds in the same order."""
    once = _with_gaps(tmp_path / "once", restart_again=False)
    twice = _with_gaps(tmp_path / "twice", restart_again=True)
    assert once == twice
