"""``RoundSpec(deterministic=True)``: the same contributions give the same bits, whatever order
they arrive in (issue 25). Folded at the close in canonical order (by peer name), for every
aggregator, with an asynchronous run's staleness scale; the flag travels on the wire and in the
journal as the parameter ``"deterministic": 1``."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensorswap.cid import Cid
from tensorswap.errors import InvalidRoundSpec
from tensorswap.rounds import Coordinator, RoundDatabase, RoundId, RoundSpec
from tensorswap.rounds.protocol.codec import spec_from_wire, spec_to_wire
from tensorswap.store import MemoryStore, ModelUpdate, get_update, put_update

RID = RoundId(1, "r")
PEERS = ("ann", "bob", "cy", "dee", "eve")
SPECS = {
    "fedavg": RoundSpec(5, deterministic=True),
    "mean": RoundSpec(5, strategy="mean", deterministic=True),
    "fedavg-clipped": RoundSpec(5, params={"max_norm": 50.0}, deterministic=True),
    "trimmed_mean": RoundSpec(
        5, strategy="trimmed_mean", params={"trim_count": 1}, deterministic=True
    ),
    "multi_krum": RoundSpec(
        5, strategy="multi_krum", params={"byzantine": 1, "select": 3}, deterministic=True
    ),
}
STORE = MemoryStore()
UPDATES: dict[str, Cid] = {}


def _cids() -> dict[str, Cid]:
    """Five updates spanning six orders of magnitude (float32 sums show any reordering)."""
    if not UPDATES:
        rng = np.random.default_rng(5)
        for i, peer in enumerate(PEERS):
            values = (rng.standard_normal(20_000) * 10.0 ** (i - 2)).astype(np.float32)
            UPDATES[peer] = put_update(STORE, ModelUpdate({"w": values}, num_samples=2 + i))
    return UPDATES


def _aggregate(spec: RoundSpec, order: tuple[str, ...]) -> bytes:
    cids = _cids()
    with Coordinator(STORE, run_timer=False) as coord:
        coord.start_round(RID, spec)
        for peer in order:
            coord.submit(RID, peer, cids[peer], scale=0.5 if peer == "eve" else 1.0)
        status = coord.tracker.wait(RID, timeout=60)
        assert status.name == "Complete", status
        cid = Cid.parse(status.cid)  # type: ignore[union-attr]
        return np.array(get_update(STORE, cid).tensors["w"]).tobytes()


@pytest.mark.parametrize("name", sorted(SPECS))
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(order=st.permutations(PEERS))
def test_any_arrival_order_gives_the_same_bits(name: str, order: list[str]) -> None:
    spec = SPECS[name]
    assert _aggregate(spec, tuple(order)) == _aggregate(spec, PEERS)


def test_without_the_flag_arrival_order_shows_in_the_bits() -> None:
    """What the flag buys (and why the test above can fail): folding as they arrive, some
    orders give other bits, within float32 rounding."""
    plain = RoundSpec(5)
    results = {_aggregate(plain, order) for order in itertools.permutations(PEERS)}
    assert len(results) > 1


def test_the_flag_travels_on_the_wire_and_in_the_journal(tmp_path: Path) -> None:
    spec = RoundSpec(3, strategy="mean", params={"max_norm": 2.0}, deterministic=True)
    wire = spec_to_wire(spec)
    assert wire.params == {"max_norm": 2.0, "deterministic": 1}
    assert spec_from_wire(wire) == spec
    assert spec_to_wire(RoundSpec(3)).params == {}  # the default adds nothing to the bytes
    assert RoundSpec(3, params={"deterministic": 1}) == RoundSpec(3, deterministic=True)
    with Coordinator(MemoryStore(), journal=RoundDatabase.in_dir(tmp_path), owns=True) as coord:
        coord.start_round(RID, spec)
    with RoundDatabase.in_dir(tmp_path) as journal:
        ((info, _),) = journal.load()
    assert info.spec == spec and info.spec.deterministic


def test_a_bad_flag_is_refused() -> None:
    with pytest.raises(InvalidRoundSpec, match="0 or 1"):
        RoundSpec(3, params={"deterministic": 7})
