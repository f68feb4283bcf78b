"""`tensorswap demo`: a real federated run across peer processes (small), p2p, a killed peer.

Each run starts real processes (a coordinator and peers importing torch), so the runs are
few and shared by several tests: 2 peers, 2 rounds, one local epoch.
"""

from __future__ import annotations

import io
import json
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from tensorswap.cli import main
from tensorswap.cli.bench_cmd import find_benchmarks, parse_ratios
from tensorswap.demo.driver import DemoConfig, DemoError, DemoReport, run_demo
from tensorswap.rounds import Complete, RoundDatabase

pytestmark = pytest.mark.timeout(180)


def _run(cfg: DemoConfig) -> tuple[DemoReport, str]:
    import asyncio

    buf = io.StringIO()
    report = asyncio.run(run_demo(cfg, Console(file=buf, width=160)))
    return report, buf.getvalue()


@pytest.fixture(scope="module")
def star_with_kill(tmp_path_factory: pytest.TempPathFactory) -> tuple[DemoConfig, DemoReport, str]:
    """Star topology, 2 peers, 2 rounds; one peer is killed in round 2 (quorum 1, 2 s deadline)."""
    root = tmp_path_factory.mktemp("star")
    cfg = DemoConfig(
        peers=2,
        rounds=2,
        local_epochs=1,
        out=root / "out",
        data=root / "coordinator",
        kill_peer=2,
        deadline_s=2.0,
    )
    report, text = _run(cfg)
    return cfg, report, text


def test_star_demo_learns_and_writes_its_outputs(
    star_with_kill: tuple[DemoConfig, DemoReport, str],
) -> None:
    cfg, report, text = star_with_kill
    assert [r.round for r in report.rounds] == [1, 2]
    assert all(r.ok for r in report.rounds)
    assert report.rounds[0].accuracy > report.initial_accuracy + 0.2
    assert report.final_accuracy > report.initial_accuracy + 0.2
    assert report.rounds[0].sent_bytes > 0 and report.rounds[0].pulled_bytes > 0
    plot = cfg.out / "demo.png"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((cfg.out / "summary.json").read_text())
    assert summary["final_accuracy"] == pytest.approx(report.final_accuracy)
    assert f"plot: {plot}" in text.replace("\n", "")
    assert "round  1/2" in text


def test_coordinator_state_is_complete(
    star_with_kill: tuple[DemoConfig, DemoReport, str],
) -> None:
    cfg, report, _ = star_with_kill
    assert cfg.data is not None
    db = RoundDatabase.in_dir(cfg.data)
    try:
        rounds = db.load()
    finally:
        db.close()
    assert [info.round_id.round for info, _ in rounds] == [1, 2]
    for info, contributions in rounds:
        assert isinstance(info.status, Complete)
        assert info.status.cid == report.rounds[info.round_id.round - 1].aggregate
        assert len(contributions) == (2 if info.round_id.round == 1 else 1)
    assert report.coordinator is not None
    assert [row["status"]["status"] for row in report.coordinator["rounds"]] == ["Complete"] * 2


def test_killed_peer_round_completes_by_quorum_at_the_deadline(
    star_with_kill: tuple[DemoConfig, DemoReport, str],
) -> None:
    _, report, text = star_with_kill
    first, second = report.rounds
    assert first.killed is None and first.outcome == "complete: all 2 peers"
    assert second.killed == "peer-1"
    assert second.outcome == "complete at the deadline by quorum: 1 of 2 peers (quorum 1)"
    assert second.seconds >= 2.0
    assert "killed peer-1" in text


def test_p2p_demo_averages_deltas_over_the_bus(tmp_path: Path) -> None:
    cfg = DemoConfig(peers=2, rounds=2, local_epochs=1, topology="p2p", out=tmp_path)
    report, _ = _run(cfg)
    assert report.coordinator is None
    for r in report.rounds:
        assert r.ok and r.contributors == 2 and r.outcome == "complete: all 2 peers' deltas"
        assert r.sent_bytes > 0
    assert report.final_accuracy > report.initial_accuracy + 0.2
    assert (tmp_path / "demo.png").is_file()


def test_p2p_with_a_small_cap_sends_split_deltas_and_every_peer_averages_them(
    tmp_path: Path,
) -> None:
    cfg = DemoConfig(
        peers=2, rounds=1, local_epochs=1, topology="p2p", out=tmp_path, max_fragment_bytes=4096
    )
    report, _ = _run(cfg)
    (r,) = report.rounds
    assert r.ok and r.contributors == 2 and r.outcome == "complete: all 2 peers' deltas"
    assert r.sent_bytes > 2 * 38_000  # the whole delta of the 64-128-10 MLP, in parts
    # Both peers averaged both whole deltas in one order: they hold the same model.
    assert r.accuracy == r.min_accuracy
    assert r.accuracy > report.initial_accuracy + 0.2


def _template() -> dict[str, np.ndarray]:
    shapes = {"0.weight": (40, 8), "0.bias": (40,), "2.weight": (3, 40), "2.bias": (3,)}
    return {k: np.zeros(shape, np.float32) for k, shape in shapes.items()}


def _peer_delta(seed: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    base = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in _template().items()}
    trained = {k: v + rng.standard_normal(v.shape).astype(np.float32) for k, v in base.items()}
    return base, trained


def test_delta_inbox_waits_for_every_part_of_a_split_delta() -> None:
    from tensorswap.delta import SLICE_SCHEMA, extract_delta_fragment, split_fragment
    from tensorswap.demo.peer import SEQ_STRIDE, DeltaInbox

    inbox = DeltaInbox(_template())
    parts: dict[str, list] = {}
    expected: dict[str, dict[str, np.ndarray]] = {}
    for seed, sender in enumerate(["peer-1", "peer-2"]):
        base, trained = _peer_delta(seed)
        whole = extract_delta_fragment(sender, 3 * SEQ_STRIDE, trained, base)
        parts[sender] = split_fragment(whole, max_bytes=512)
        expected[sender] = {k: trained[k] - base[k] for k in base}
    assert len(parts["peer-1"]) > 3
    assert any(p.schema == SLICE_SCHEMA for p in parts["peer-1"])  # a layer is cut in slices
    early = extract_delta_fragment("peer-1", 4 * SEQ_STRIDE, *_peer_delta(9)[::-1])
    inbox.add(split_fragment(early, max_bytes=512)[0])  # next round's first part, early
    one, two = list(reversed(parts["peer-1"])), parts["peer-2"]
    for part in one[:-1] + two[:-1]:
        inbox.add(part)
    assert not inbox.complete(3, "peer-1") and not inbox.complete(3, "peer-2")
    inbox.add(one[-1])
    inbox.add(one[-1])  # a duplicate changes nothing
    assert inbox.complete(3, "peer-1") and not inbox.complete(3, "peer-2")
    inbox.add(two[-1])
    assert inbox.complete(3, "peer-2")
    got = inbox.take(3)
    assert sorted(got) == ["peer-1", "peer-2"]
    for sender, delta in got.items():
        assert list(delta) == list(_template())
        for name, values in delta.items():
            np.testing.assert_array_equal(values, expected[sender][name])
    assert inbox.take(3) == {}  # the round is forgotten, the next one is kept
    assert not inbox.complete(4, "peer-1")


def test_delta_inbox_leaves_out_a_delta_missing_a_part() -> None:
    from tensorswap.delta import extract_delta_fragment, split_fragment
    from tensorswap.demo.peer import SEQ_STRIDE, DeltaInbox

    base, trained = _peer_delta(0)
    whole = extract_delta_fragment("peer-1", SEQ_STRIDE, trained, base)
    parts = split_fragment(whole, max_bytes=512)
    inbox = DeltaInbox(_template())
    for part in parts[:1] + parts[2:]:  # the second part was lost
        inbox.add(part)
    assert not inbox.complete(1, "peer-1")
    assert inbox.take(1) == {}


async def test_split_deltas_cross_a_bus_and_listener_with_a_small_cap() -> None:
    import asyncio

    from tensorswap.delta import (
        DweBus,
        DweConfig,
        DweFragment,
        DweListener,
        extract_delta_fragment,
        split_fragment,
    )
    from tensorswap.demo.peer import SEQ_STRIDE, DeltaInbox

    config = DweConfig(max_fragment_bytes=1024)
    queue: asyncio.Queue[DweFragment] = asyncio.Queue()
    inbox = DeltaInbox(_template())
    base, trained = _peer_delta(5)
    parts = split_fragment(
        extract_delta_fragment("peer-1", 2 * SEQ_STRIDE, trained, base), max_bytes=1024
    )
    assert len(parts) > 1
    async with (
        DweListener(queue, config=config) as listener,
        DweBus([listener.endpoint], config=config) as bus,
    ):
        for part in parts:
            await bus.put(part)
        async with asyncio.timeout(10):
            while not inbox.complete(2, "peer-1"):
                inbox.add(await queue.get())
    delta = inbox.take(2)["peer-1"]
    for name, values in delta.items():
        np.testing.assert_array_equal(values, trained[name] - base[name])


def test_p2p_refuses_compression(tmp_path: Path) -> None:
    cfg = DemoConfig(peers=2, rounds=1, topology="p2p", compression="int8", out=tmp_path)
    with pytest.raises(DemoError, match="star topology"):
        _run(cfg)


def test_demo_options_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--rounds", "2", "--kill-peer", "3"]) == 2
    assert "--kill-peer" in capsys.readouterr().err
    assert main(["demo", "--help"]) == 0
    out = capsys.readouterr().out
    for option in ("--peers", "--rounds", "--aggregator", "--compression", "--topology"):
        assert option in out


def test_peer_that_cannot_reach_the_coordinator_says_so() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again below: nothing listens there
    proc = subprocess.run(
        [
            sys.executable,
            *("-m", "tensorswap.demo.peer", "--index", "0", "--peers", "2"),
            *("--coordinator", f"127.0.0.1:{port}"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert proc.returncode == 2
    assert f"cannot reach the coordinator at 127.0.0.1:{port}" in proc.stderr
    event = json.loads(proc.stdout.splitlines()[-1])
    assert event["event"] == "error" and "cannot reach" in event["message"]


# ── tensorswap bench ─────────────────────────────────────────────────────────
def test_bench_parses_ratio_lines() -> None:
    output = "\n".join(
        [
            "  naive loop:      8.2 ms   (1.00x)",
            "FedAvg ratio vs naive: 1.18x (goal >= 2.0x); list input 0.93x",
            "round:       8 x 4 MiB in 0.639 s -> 4.14x raw (goal <= 1.5x); all accepted",
            "  ratio                        0.09x  (misses the >= 0.5x goal)",
            "  small: persistent / per-fragment = 25.37x",
            "  size 0.500x dense",
        ]
    )
    got = [(r.name, r.value, r.op, r.goal, r.met) for r in parse_ratios("s", output)]
    assert got == [
        ("FedAvg ratio vs naive", 1.18, ">=", 2.0, False),
        ("round: 8 x 4 MiB in 0.639 s", 4.14, "<=", 1.5, False),
        ("ratio", 0.09, ">=", 0.5, False),
        ("small: persistent / per-fragment", 25.37, None, None, None),
    ]
    explicit = parse_ratios("s", output + "\nRATIO fedavg 2.5 >= 2\n")
    assert [(r.name, r.value, r.met) for r in explicit] == [("fedavg", 2.5, True)]


def test_bench_finds_the_source_tree_or_says_it_is_absent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    found = find_benchmarks()
    assert found is not None and (found / "__main__.py").is_file()
    assert find_benchmarks(tmp_path) is None
    assert main(["bench", "--dir", str(tmp_path)]) == 1
    assert "needs the source tree" in capsys.readouterr().err
