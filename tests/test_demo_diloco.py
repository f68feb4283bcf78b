"""`tensorswap demo --topology diloco`: DiLoCo across peer processes, its records and checks;
`DiLoCo` over a plain numpy parameter mapping.

Each demo run starts real processes (a rendezvous and peers importing torch): few, small runs,
shared by the tests that read them.
"""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from tensorswap.cli import main
from tensorswap.collective import Collective, DiLoCo, Rendezvous
from tensorswap.demo.config import DemoConfig, DemoError, check_config
from tensorswap.demo.driver import DemoReport, run_demo
from tensorswap.store import MemoryStore
from tensorswap.wire import BlockServer

pytestmark = pytest.mark.timeout(180)

# 2 peers, 20 inner steps: 0.958 test accuracy at the 4th outer step with the default seed.
SMALL = {"peers": 2, "rounds": 4, "inner_steps": 20}


def _run(cfg: DemoConfig) -> tuple[DemoReport, str]:
    buf = io.StringIO()
    report = asyncio.run(run_demo(cfg, Console(file=buf, width=200)))
    return report, buf.getvalue()


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """The small config through the CLI, uncompressed: its output directory and exit code."""
    out = tmp_path_factory.mktemp("diloco-none")
    argv = ["demo", "--topology", "diloco", "--out", str(out)]
    for name, value in SMALL.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    return out, main(argv)


def test_the_cli_run_reaches_090_and_writes_one_entry_per_outer_step(
    cli_run: tuple[Path, int],
) -> None:
    out, code = cli_run
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    steps = summary["outer_steps"]
    assert [s["outer_step"] for s in steps] == [1, 2, 3, 4]
    for step in steps:
        assert {"outer_step", "accuracy", "bytes_sent", "seconds"} <= set(step)
        assert set(step["bytes_sent"]) == {"peer-0", "peer-1"}
        assert all(n > 0 for n in step["bytes_sent"].values())
        # what the peers pushed to the reducers is what the others fetched back, reduced
        assert sum(step["bytes_sent"].values()) == sum(step["bytes_received"].values())
        assert step["seconds"] > 0
        assert step["members"] and len(step["members"]) == 2
        # one model on every peer after a sync: one accuracy
        assert step["min_accuracy"] == step["accuracy"]
    assert summary["final_accuracy"] == steps[-1]["accuracy"] >= 0.90
    assert summary["config"]["topology"] == "diloco"
    assert summary["rounds"] == [] and summary["versions"] == []
    assert (out / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {p.name for p in out.glob("*.log")} == {"coordinator.log", "peer-0.log", "peer-1.log"}


def test_int8_sends_at_least_35x_fewer_bytes_for_the_same_accuracy(
    cli_run: tuple[Path, int], tmp_path: Path
) -> None:
    out, _ = cli_run
    dense = json.loads((out / "summary.json").read_text())["outer_steps"]
    cfg = DemoConfig(topology="diloco", compression="int8", out=tmp_path, **SMALL)
    report, text = _run(cfg)
    assert [s.outer_step for s in report.outer_steps] == [1, 2, 3, 4]
    assert report.final_accuracy >= 0.90
    sent_none = sum(sum(s["bytes_sent"].values()) for s in dense)
    sent_int8 = sum(s.total_sent for s in report.outer_steps)
    assert sent_none >= 3.5 * sent_int8
    assert all(0 < s.compression_error < 0.05 for s in report.outer_steps)
    assert "outer step  4/4" in text and "compression int8" in text


@pytest.mark.slow
def test_the_default_config_reaches_090(tmp_path: Path) -> None:
    cfg = DemoConfig(topology="diloco", out=tmp_path)
    check_config(cfg)
    assert (cfg.peers, cfg.rounds, cfg.diloco_inner_steps) == (4, 10, 20)
    report, _ = _run(cfg)
    assert len(report.outer_steps) == 10
    assert all(len(s.bytes_sent) == 4 for s in report.outer_steps)
    assert report.final_accuracy >= 0.90


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"compression": "topk"}, "topk does not apply to diloco"),
        ({"netlab": True}, "--netlab runs the star topology"),
        ({"swarm": True}, "--swarm applies to the per-round star demo"),
        ({"kill_peer": 1}, "--kill-peer applies to the star and p2p"),
        ({"aggregator": "median"}, "--aggregator applies to the star and p2p"),
        ({"freeze_first_layer": True}, "--freeze-first-layer applies to the star and p2p"),
        ({"mode": "sync"}, "run on the star topology"),
        ({"max_fragment_bytes": 4096}, "--max-fragment-bytes applies to the p2p"),
        ({"inner_steps": 0}, "--inner-steps 0 must be at least 1"),
        ({"local_epochs": 5}, "--local-epochs applies to the star and p2p"),
        ({"deadline_s": 3.0}, "--deadline and --quorum apply to rounds"),
        ({"quorum": 2}, "--deadline and --quorum apply to rounds"),
    ],
)
def test_options_that_do_not_go_with_diloco_are_refused(
    options: dict[str, object], message: str
) -> None:
    with pytest.raises(DemoError, match=message):
        check_config(DemoConfig(topology="diloco", **options))  # type: ignore[arg-type]


def test_inner_steps_needs_the_diloco_topology() -> None:
    with pytest.raises(DemoError, match="--inner-steps applies to the diloco topology"):
        check_config(DemoConfig(topology="star", inner_steps=5))


def test_the_cli_refuses_topk_and_documents_diloco(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--topology", "diloco", "--compression", "topk"]) == 2
    assert "topk does not apply to diloco" in capsys.readouterr().err
    assert main(["demo", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--inner-steps" in out and "diloco" in out


# ── DiLoCo over numpy parameters, in process ─────────────────────────────────
def test_numpy_peers_hold_identical_parameters_after_each_sync_and_learn() -> None:
    rng = np.random.default_rng(0)
    target = rng.normal(size=(8, 1)).astype(np.float32)
    xs = [rng.normal(size=(64, 8)).astype(np.float32) for _ in range(2)]
    start = rng.normal(size=(8, 1)).astype(np.float32)
    params = [{"w": start.copy(), "b": np.zeros(1, np.float32)} for _ in range(2)]
    arrays = [p["w"] for p in params]  # what a numpy trainer holds on to

    def loss(i: int) -> float:
        err = xs[i] @ params[i]["w"] + params[i]["b"] - xs[i] @ target
        return float((err**2).mean())

    def sgd_step(i: int) -> None:
        err = xs[i] @ params[i]["w"] + params[i]["b"] - xs[i] @ target
        params[i]["w"] -= 0.05 * 2 * xs[i].T @ err / len(err)
        params[i]["b"] -= 0.05 * 2 * err.mean(axis=0)

    async def main_() -> tuple[list[list[dict[str, np.ndarray]]], float, float]:
        server = BlockServer(MemoryStore())
        rendezvous = Rendezvous().attach(server)
        await server.start("127.0.0.1", 0)
        address = f"127.0.0.1:{server.port}"
        groups = await asyncio.gather(
            *(Collective.join(address, group="g", peer=f"p{i}", size=2) for i in range(2))
        )
        initial = loss(0)
        dilocos = [DiLoCo(p, g, inner_steps=5) for p, g in zip(params, groups, strict=True)]
        synced: list[list[dict[str, np.ndarray]]] = []
        try:
            for _ in range(6):
                for i in range(2):
                    for _ in range(5):
                        sgd_step(i)
                assert not np.array_equal(params[0]["w"], params[1]["w"])  # they drifted apart
                await asyncio.gather(*(d.sync() for d in dilocos))
                synced.append([{k: v.copy() for k, v in p.items()} for p in params])
            return synced, initial, max(loss(0), loss(1))
        finally:
            for group in groups:
                await group.aclose()
            await rendezvous.aclose()
            await server.aclose()

    synced, initial, final = asyncio.run(main_())
    for first, second in synced:
        for name in ("w", "b"):
            np.testing.assert_array_equal(first[name], second[name])
            assert first[name].dtype == np.float32
    assert all(p["w"] is a for p, a in zip(params, arrays, strict=True))  # written in place
    assert final < initial / 4


def test_diloco_refuses_what_is_neither_a_module_nor_a_mapping() -> None:
    with pytest.raises(TypeError, match="torch module or a mutable mapping"):
        DiLoCo([np.zeros(3)], None)  # type: ignore[arg-type]
