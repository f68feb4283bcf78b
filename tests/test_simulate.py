"""tensorswap simulate: options, the synthetic task, the process backend end to end,
summary.json, and every process stopped even when the simulation fails."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tensorswap.cli import main
from tensorswap.errors import TensorSwapError
from tensorswap.simulate import InvalidSimulation, SimConfig, SimulationError
from tensorswap.simulate.driver import partition, run_simulation
from tensorswap.simulate.memory import descendants, tree_rss
from tensorswap.simulate.task import SyntheticTask, make_task
from tensorswap.simulate.worker import SimWorker

SMALL = ["--clients", "40", "--per-round", "8", "--rounds", "2", "--model-mib", "0.01"]


_BEFORE: set[int] = set()


@pytest.fixture(autouse=True)
def _children_before() -> None:
    """The processes below this one before the test (another test's are not this one's)."""
    _BEFORE.clear()
    _BEFORE.update(descendants(os.getpid()))


def _no_children_left() -> None:
    """No process this test started is left (workers, coordinator)."""
    left = sorted(set(descendants(os.getpid())) - _BEFORE)
    assert left == [], f"processes left behind: {left}"


# ── options ──────────────────────────────────────────────────────────────────
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"clients": 10, "per_round": 11, "rounds": 1}, "cannot sample 11"),
        ({"clients": 10, "per_round": 2, "rounds": 0}, "rounds must be"),
        ({"clients": 10, "per_round": 2, "rounds": 1, "backend": "mpi"}, "backend must be"),
        ({"clients": 500, "per_round": 2, "rounds": 1, "task": "digits"}, "at most 200"),
        ({"clients": 10, "per_round": 2, "rounds": 1, "model_mib": 0.0}, "model_mib"),
        ({"clients": 10, "per_round": 2, "rounds": 1, "model_mib": float("nan")}, "model_mib"),
        ({"clients": 10, "per_round": 2, "rounds": 1, "ray_address": "auto"}, "--backend ray"),
        ({"clients": 10, "per_round": 2, "rounds": 1, "workers": 0}, "workers"),
        ({"clients": 10, "per_round": 2, "rounds": 1, "keep_rounds": -1}, "keep_rounds"),
        ({"clients": 10, "per_round": 2, "rounds": 1, "strategy": "nope"}, "unknown strategy"),
        (
            {
                "clients": 10,
                "per_round": 2,
                "rounds": 1,
                "optimizer": "fedadam",
                "optimizer_params": {"beta": 1},
            },
            "fedadam",
        ),
        ({"clients": 10, "per_round": 2, "rounds": 1, "optimizer": "sgd"}, "server optimizer"),
    ],
)
def test_bad_configs_are_typed_errors(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidSimulation, match=message) as info:
        SimConfig(**kwargs)
    assert isinstance(info.value, TensorSwapError) and isinstance(info.value, ValueError)


def test_task_choice_and_workers() -> None:
    assert SimConfig(clients=50, per_round=5, rounds=1).resolved_task == "digits"
    assert SimConfig(clients=5000, per_round=5, rounds=1).resolved_task == "synthetic"
    assert SimConfig(clients=50, per_round=5, rounds=1, model_mib=2).resolved_task == "synthetic"
    assert SimConfig(clients=3, per_round=1, rounds=1, workers=8).resolved_workers == 3


def test_partition_covers_every_client_once() -> None:
    shares = partition(10, 3)
    assert [len(s) for s in shares] == [4, 3, 3]
    assert sorted(i for s in shares for i in s) == list(range(10))


def test_cli_help_lists_the_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--help"]) == 0
    text = capsys.readouterr().out
    options = ("--clients", "--per-round", "--rounds", "--model-mib", "--backend", "--out")
    for option in (*options, "--keep-rounds", "--strategy", "--optimizer", "--opt"):
        assert option in text
    assert main(["--help"]) == 0
    assert "simulate" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--clients", "5", "--per-round", "6", "--rounds", "1"], "cannot sample 6"),
        ([*SMALL, "--backend", "mpi"], "mpi"),
        ([*SMALL[:6], "--model-mib", "0"], "model-mib"),
        (["--per-round", "6", "--rounds", "1"], "--clients"),
        (["--clients", "500", "--per-round", "6", "--rounds", "1", "--task", "digits"], "200"),
        ([*SMALL, "--ray-address", "auto"], "--backend ray"),
        ([*SMALL, "--listen", "nowhere"], "listen"),
        ([*SMALL, "--opt", "eta=fast"], "a number is expected"),
        ([*SMALL, "--param", "trim_fraction"], "NAME=VALUE"),
        ([*SMALL, "--optimizer", "sgd"], "server optimizer"),
    ],
)
def test_cli_bad_options_exit_2(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", *argv, "--out", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # refused before anything started


# ── the synthetic task ───────────────────────────────────────────────────────
def test_synthetic_task_is_deterministic_and_learns() -> None:
    task = SyntheticTask(20, 0.01, seed=3)
    again = make_task({"task": "synthetic", "clients": 20, "model_mib": 0.01, "seed": 3, "lr": 0.5})
    w0 = task.initial()
    assert w0["weight"].nbytes == round(0.01 * 2**20 / 1024) * 1024
    a, loss_a = task.train(4, 1, w0)
    b, loss_b = again.train(4, 1, w0)
    np.testing.assert_array_equal(a["weight"], b["weight"])
    assert loss_a == loss_b
    other, _ = task.train(5, 1, w0)
    assert not np.array_equal(a["weight"], other["weight"])  # each client its own update
    # FedAvg over every client moves the global model towards the optimum
    w = w0
    losses = [task.evaluate(w)]
    for r in range(3):
        models = [task.train(i, r, w)[0]["weight"] for i in range(20)]
        weights = np.array([task.num_samples(i) for i in range(20)], dtype=np.float64)
        w = {"weight": np.average(np.stack(models), axis=0, weights=weights).astype(np.float32)}
        losses.append(task.evaluate(w))
    assert losses[1] < losses[0] / 4 and losses[-1] < losses[0] / 4


def test_bad_task_and_worker_specs_are_typed_errors() -> None:
    with pytest.raises(InvalidSimulation, match="shape"):
        SyntheticTask(2, 0.01, 0).train(0, 1, {"weight": np.zeros((3, 3), np.float32)})
    with pytest.raises(InvalidSimulation, match="unknown task"):
        make_task({"task": "imagenet", "clients": 1, "seed": 0})
    with pytest.raises(InvalidSimulation, match="bad task spec"):
        make_task({"task": "synthetic", "clients": "many", "seed": 0})
    with pytest.raises(InvalidSimulation, match="worker spec"):
        SimWorker({"host": "127.0.0.1"})


def test_tree_rss_counts_children() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; b = bytearray(64 << 20); sys.stdin.read()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
    )
    try:
        assert child.pid in descendants(os.getpid())
        alone = tree_rss(child.pid)[0]
        total, count = tree_rss(os.getpid())
        assert count >= 2 and total > alone > 0
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(30)


# ── end to end (process backend) ─────────────────────────────────────────────
def test_process_backend_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sim"
    assert main(["simulate", *SMALL, "--workers", "2", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "2 workers ready, 40 clients registered" in err and "peak memory" in err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["clients"] == 40 and summary["config"]["backend"] == "process"
    assert summary["metric"] == "loss"
    rounds = summary["rounds"]
    assert [r["round"] for r in rounds] == [1, 2]
    model_bytes = round(0.01 * 2**20 / 1024) * 1024
    for r in rounds:
        assert r["participants_count"] == 8 == len(set(r["participants"]))
        assert all(p.startswith("sim-") for p in r["participants"])
        assert r["seconds"] > 0 and r["bytes"] == r["sent_bytes"] + r["received_bytes"]
        assert r["sent_bytes"] > 8 * model_bytes  # every client's update went over the wire
    assert rounds[0]["participants"] != rounds[1]["participants"]  # sampled afresh
    assert rounds[1]["loss"] < rounds[0]["loss"] < 0.5  # 0.5: the initial model's loss
    assert summary["peak_memory_bytes"] > 0 and summary["peak_processes"] >= 4
    assert (out / "simulate.png").stat().st_size > 0
    assert (out / "coordinator.log").exists() and (out / "worker-1.log").exists()
    # old rounds' blocks are collected as rounds end (--keep-rounds 1 by default)
    assert "keeping the newest 1 round number(s)" in (out / "coordinator.log").read_text()
    _no_children_left()


def test_a_server_optimizer_and_a_robust_strategy_run_the_simulation(tmp_path: Path) -> None:
    out = tmp_path / "sim"
    more = ["--optimizer", "fedadam", "--opt", "eta=0.05", "--strategy", "trimmed_mean"]
    argv = ["simulate", *SMALL, "--rounds", "3", *more, "--param", "trim_fraction=0.25"]
    assert main([*argv, "--out", str(out), "--no-plot"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    config = summary["config"]
    assert (config["optimizer"], config["optimizer_params"]) == ("fedadam", {"eta": 0.05})
    assert (config["strategy"], config["params"]) == ("trimmed_mean", {"trim_fraction": 0.25})
    losses = [r["loss"] for r in summary["rounds"]]
    assert losses[2] < losses[1] < losses[0] < 0.5  # 0.5: the initial model's loss
    _no_children_left()


def _kill_first_worker(kind: str, data: Any) -> None:
    if kind == "ready":
        os.kill(int(data[0]["pid"]), signal.SIGKILL)


def _fail_after_first_round(kind: str, data: Any) -> None:
    if kind == "round":
        raise RuntimeError("the caller gave up")


@pytest.mark.parametrize(
    ("on_event", "error", "message"),
    [
        (_kill_first_worker, SimulationError, "worker 0 exited"),
        (_fail_after_first_round, RuntimeError, "gave up"),
    ],
)
def test_every_process_is_stopped_on_failure(
    tmp_path: Path, on_event: Any, error: type[Exception], message: str
) -> None:
    cfg = SimConfig(clients=20, per_round=20, rounds=3, model_mib=0.01, workers=2, out=tmp_path)
    with pytest.raises(error, match=message):
        asyncio.run(run_simulation(cfg, on_event))
    _no_children_left()


def test_a_foreign_data_directory_is_not_emptied(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "precious.txt").write_text("keep me")
    argv = ["simulate", *SMALL, "--out", str(tmp_path / "out"), "--data", str(data)]
    assert main(argv) == 2
    assert "not emptying it" in capsys.readouterr().err
    assert (data / "precious.txt").read_text() == "keep me"
    _no_children_left()
