"""runs.regional: which runs fold per region, and a round's units from the sample."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tensorswap.rounds.core import FakeClock
from tensorswap.runs import ClientRegistry, RunInfo, RunSpec
from tensorswap.runs.regional import REGION_FACT, RunUnits, folds


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (RunSpec(), True),
        (RunSpec(optimizer="fedadam"), True),
        (RunSpec(mode="async"), False),
        (RunSpec(strategy="median"), False),
        (RunSpec(strategy="mean"), False),
        (RunSpec(params={"max_norm": 1.0}), False),
        (RunSpec(dp_clip=1.0), False),
    ],
)
def test_only_plain_sync_fedavg_runs_fold(spec: RunSpec, expected: bool) -> None:
    assert folds(spec) is expected


def info(selected: tuple[str, ...], round: int = 1, spec: RunSpec | None = None) -> RunInfo:
    return RunInfo("fl", spec or RunSpec(), 0, "", None, round, selected, False, 0.0)


def test_a_round_expects_one_unit_per_region_and_per_direct_peer() -> None:
    registry = ClientRegistry(None, FakeClock())
    for peer, region in [("a", "eu"), ("b", "eu"), ("c", "us"), ("d", None), ("e", "eu")]:
        registry.register(peer, {REGION_FACT: region} if region else {})
    units = RunUnits(registry)
    round_1 = info(("a", "b", "c", "d"))  # e (eu) was not sampled
    assert dict(units.of(round_1)) == {"eu": ("a", "b"), "us": ("c",), "d": ("d",)}
    assert [units.unit(round_1, p) for p in "abcd"] == ["eu", "eu", "us", "d"]
    # kept for the round: a peer registering again elsewhere mid-round does not move
    registry.register("a", {REGION_FACT: "us"})
    assert units.unit(round_1, "a") == "eu"
    assert units.unit(info(("a",), round=2), "a") == "us"  # the next round sees it


def test_runs_that_do_not_fold_keep_every_peer_its_own_unit() -> None:
    registry = ClientRegistry(None, FakeClock())
    registry.register("a", {REGION_FACT: "eu"})
    units = RunUnits(registry)
    run = replace(info(("a",)), spec=RunSpec(strategy="median"))
    assert dict(units.of(run)) == {"a": ("a",)}
