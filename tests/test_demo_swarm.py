"""`tensorswap demo --swarm`: peers fetch each round's aggregate through the swarm.

Real processes (a coordinator and two peers importing torch), one short run shared by the
tests: 2 peers, 2 rounds, one local epoch.
"""

from __future__ import annotations

import asyncio
import io
import json

import pytest
from rich.console import Console

from tensorswap.cid import Cid
from tensorswap.demo.config import DemoConfig, DemoError, check_config
from tensorswap.demo.driver import DemoReport, run_demo
from tensorswap.rounds import Complete, RoundDatabase
from tensorswap.store import DirectoryStore, get_update, read_manifest

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def swarm_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[DemoConfig, DemoReport]:
    root = tmp_path_factory.mktemp("swarm")
    cfg = DemoConfig(
        peers=2, rounds=2, local_epochs=1, out=root / "out", data=root / "coord", swarm=True
    )
    report = asyncio.run(run_demo(cfg, Console(file=io.StringIO(), width=160)))
    return cfg, report


def test_the_swarm_demo_learns_with_every_aggregate_fetched_whole(
    swarm_run: tuple[DemoConfig, DemoReport],
) -> None:
    cfg, report = swarm_run
    assert [r.round for r in report.rounds] == [1, 2]
    assert all(r.ok and r.contributors == 2 for r in report.rounds)
    assert report.final_accuracy > report.initial_accuracy + 0.2
    summary = json.loads((cfg.out / "summary.json").read_text())
    assert summary["config"]["swarm"] is True
    for row in summary["rounds"]:
        # every chunk came from the coordinator or the other peer (plus what was held)
        assert row["pulled_bytes"] + row["swarm_bytes"] > 0


def test_peers_served_and_the_aggregates_were_cut_for_trading(
    swarm_run: tuple[DemoConfig, DemoReport],
) -> None:
    cfg, report = swarm_run
    logs = [(cfg.out / f"peer-{i}.log").read_text() for i in range(cfg.peers)]
    assert not any("Traceback" in log for log in logs)
    assert cfg.data is not None
    journal = RoundDatabase.in_dir(cfg.data)
    store = DirectoryStore(cfg.data / "blocks")
    try:
        statuses = [info.status for info, _ in journal.load()]
        assert len(statuses) == 2 and all(isinstance(s, Complete) for s in statuses)
        for status in statuses:
            assert isinstance(status, Complete)
            cid = Cid.parse(status.cid)
            tensors = read_manifest(store, cid).links()
            chunks = [read_manifest(store, t).links() for t in tensors]
            assert sum(len(c) for c in chunks) > len(tensors)  # cut at 4 KiB, not 1 a tensor
            assert all(store.get(c).nbytes <= 4096 + 1024 for row in chunks for c in row)
            assert get_update(store, cid).metadata["contributors"] == "2"
            assert str(cid) in {r.aggregate for r in report.rounds}
    finally:
        journal.close()
        store.close()


def test_swarm_applies_to_the_per_round_star_demo() -> None:
    with pytest.raises(DemoError, match="--swarm"):
        check_config(DemoConfig(swarm=True, topology="p2p"))
    with pytest.raises(DemoError, match="--swarm"):
        check_config(DemoConfig(swarm=True, mode="async"))
    check_config(DemoConfig(swarm=True, netlab=True))
