"""`tensorswap demo` as a federated run: sampling and a server optimizer (sync), FedBuff with a
slow peer (async), a peer killed mid-round, the options' checks, summary.json and the plot.

Each run starts real processes (a coordinator and peers importing torch): few, small runs.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from tensorswap.cli import main
from tensorswap.demo.config import DemoConfig, DemoError, check_config
from tensorswap.demo.driver import DemoReport, run_demo
from tensorswap.demo.run_driver import run_spec
from tensorswap.demo.run_output import time_to_accuracy
from tensorswap.runs import RunMode, RunSpec

pytestmark = pytest.mark.timeout(180)


def _run(cfg: DemoConfig) -> tuple[DemoReport, str]:
    import asyncio

    buf = io.StringIO()
    report = asyncio.run(run_demo(cfg, Console(file=buf, width=200)))
    return report, buf.getvalue()


@pytest.mark.slow
def test_a_sync_run_samples_peers_and_steps_the_server_optimizer(tmp_path: Path) -> None:
    cfg = DemoConfig(
        peers=3, rounds=3, local_epochs=1, sample=2, server_opt="fedavgm", out=tmp_path
    )
    report, text = _run(cfg)
    assert [v.version for v in report.versions] == [1, 2, 3]
    for v in report.versions:
        assert len(v.participants) == 2 and set(v.participants) <= {"peer-0", "peer-1", "peer-2"}
        assert 0.0 <= v.accuracy <= 1.0
    elapsed = [v.elapsed_s for v in report.versions]
    assert elapsed == sorted(elapsed) and elapsed[0] > 0
    assert report.final_accuracy > report.initial_accuracy + 0.2
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [v["participants"] for v in summary["versions"]] == [
        v.participants for v in report.versions
    ]
    assert all({"staleness", "accuracy", "elapsed_s"} <= set(v) for v in summary["versions"])
    spec = RunSpec.from_json(summary["run"]["spec"])
    assert spec.optimizer == "fedavgm" and spec.per_round == 2
    assert (tmp_path / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "version  3/3" in text and "sync fedavgm, 2 of 3 per round" in text
    # the coordinator's rounds of the run, as the demo recorded them
    assert report.coordinator is not None
    assert [len(r["peers"]) for r in report.coordinator["rounds"]] == [2, 2, 2]


@pytest.mark.slow
def test_an_async_run_with_a_slow_peer_makes_versions_without_waiting_for_it(
    tmp_path: Path,
) -> None:
    cfg = DemoConfig(
        peers=3, rounds=4, local_epochs=1, mode="async", slow_peer=2, buffer=1, out=tmp_path
    )
    report, text = _run(cfg)
    assert [v.version for v in report.versions] == [1, 2, 3, 4]
    for v in report.versions:
        assert len(v.participants) == 1 and len(v.staleness) == 1 and v.staleness[0] >= 0
    assert report.run is not None and report.run["contributed"] >= 4
    assert RunSpec.from_json(report.run["spec"]).mode is RunMode.ASYNC
    assert "async fedavg, buffer 1, peer-2 5x slower" in text
    target = report.versions[-1].accuracy
    assert time_to_accuracy(report, target) is not None
    assert time_to_accuracy(report, 1.01) is None


@pytest.mark.slow
def test_a_peer_killed_in_a_sync_run_leaves_its_round_to_the_quorum(tmp_path: Path) -> None:
    cfg = DemoConfig(
        peers=3, rounds=2, local_epochs=1, mode="sync", kill_peer=1, deadline_s=2.0, out=tmp_path
    )
    report, text = _run(cfg)
    first = report.versions[0]
    assert first.killed is not None and first.killed not in first.participants
    assert len(first.participants) == 2
    assert "killed peer-" in text
    assert len(report.versions) == 2


@pytest.mark.slow
def test_a_dp_run_reports_epsilon_per_version_and_stops_at_its_budget(tmp_path: Path) -> None:
    cfg = DemoConfig(
        peers=3,
        rounds=6,
        local_epochs=1,
        dp_clip=2.0,
        dp_noise=0.5,
        dp_max_epsilon=25.0,
        out=tmp_path,
    )
    report, text = _run(cfg)
    eps = [v.epsilon for v in report.versions]
    assert eps and all(e is not None for e in eps)
    assert eps == sorted(eps) and eps[-1] <= 25.0  # type: ignore[type-var]
    assert len(report.versions) < 6 and "privacy budget exhausted" in text
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [v["epsilon"] for v in summary["versions"]] == eps
    spec = RunSpec.from_json(summary["run"]["spec"])
    assert (spec.dp_clip, spec.dp_noise, spec.dp_max_epsilon) == (2.0, 0.5, 25.0)
    assert "ε" in text


@pytest.mark.slow
def test_secure_aggregation_learns_and_composes_with_dp(tmp_path: Path) -> None:
    cfg = DemoConfig(peers=3, rounds=3, local_epochs=1, secagg=True, out=tmp_path / "sa")
    report, text = _run(cfg)
    assert len(report.versions) == 3 and "SecAgg+" in text
    assert all(len(v.participants) == 3 for v in report.versions)
    assert report.final_accuracy > report.initial_accuracy + 0.3
    assert RunSpec.from_json((report.run or {})["spec"]).secagg
    both = DemoConfig(
        peers=3,
        rounds=2,
        local_epochs=1,
        secagg=True,
        dp_clip=2.0,
        dp_noise=0.3,
        out=tmp_path / "both",
    )
    report, text = _run(both)
    spec = RunSpec.from_json((report.run or {})["spec"])
    assert spec.secagg and spec.dp_clipping == "client"
    assert len(report.versions) == 2 and all(v.epsilon is not None for v in report.versions)


def test_run_options_become_the_runs_spec() -> None:
    spec = run_spec(DemoConfig(peers=8, sample=4, server_opt="fedadam", rounds=5, seed=3))
    assert (spec.mode, spec.per_round, spec.min_clients, spec.optimizer) == (
        RunMode.SYNC,
        4,
        4,
        "fedadam",
    )
    assert spec.quorum == 1.0 and spec.rounds == 5 and spec.seed == 3
    killed = run_spec(DemoConfig(peers=4, mode="sync", kill_peer=2))
    assert killed.quorum == pytest.approx(0.75) and killed.min_clients == 3
    fedbuff = run_spec(DemoConfig(peers=6, mode="async", max_staleness=3))
    assert fedbuff.mode is RunMode.ASYNC and fedbuff.buffer == 3 and fedbuff.max_staleness == 3


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"sample": 5}, "--sample 5"),
        ({"slow_peer": 4}, "--slow-peer 4"),
        ({"mode": "async", "sample": 2}, "--mode sync"),
        ({"mode": "sync", "topology": "p2p"}, "star topology"),
        ({"server_opt": "fedadam", "compression": "int8"}, "--compression"),
        ({"mode": "async", "kill_peer": 1}, "--kill-peer"),
        ({"mode": "async", "aggregator": "median"}, "fedavg or mean"),
        ({"mode": "async", "dp_clip": 1.0}, "--dp-clip applies to --mode sync"),
        ({"mode": "async", "secagg": True}, "--secagg applies to --mode sync"),
        ({"secagg_threshold": 3}, "needs --secagg"),
        ({"secagg": True, "secagg_threshold": 5}, "--secagg-threshold 5"),
        ({"secagg": True, "sample": 2}, "at least 3 peers"),
        ({"secagg": True, "sample": 3, "kill_peer": 0}, "at least 4 peers"),
    ],
)
def test_run_options_that_do_not_go_together_are_refused(
    options: dict[str, object], message: str
) -> None:
    with pytest.raises(DemoError, match=message):
        check_config(DemoConfig(peers=4, **options))  # type: ignore[arg-type]


def test_the_cli_refuses_bad_run_options_before_starting_anything(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["demo", "--peers", "2", "--sample", "3"]) == 2
    assert "--sample 3" in capsys.readouterr().err
    assert main(["demo", "--help"]) == 0
    out = capsys.readouterr().out
    for option in ("--mode", "--server-opt", "--sample", "--slow-peer", "--buffer"):
        assert option in out
