"""The bridge in a Flower deployment: the real ``flower-superlink`` and two
``flower-supernode`` processes (insecure, 127.0.0.1, free ports), ``tensorswap serve`` as the
block service, the app in ``deploy_app`` submitted with ``flwr run`` for 2 rounds of FedAvg.
The final arrays equal FedAvg's arithmetic on the ClientApp's deterministic training, and the
messages carried <= 1% of the arrays' bytes."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flwr")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

from apps import initial_model  # noqa: E402
from deployment import FLOWER_BIN, HERE, Processes, environment, free_port  # noqa: E402

from tensorswap.flower import NodeStore  # noqa: E402

NODES, ROUNDS = 2, 2


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    """The processes a test starts, every process group ended afterwards, pass or fail."""
    started = Processes(tmp_path / "logs", environment(tmp_path / "flwr-home"))
    try:
        yield started
    finally:
        started.close()


def start_federation(processes: Processes, home: Path, stores: Path) -> str:
    """A SuperLink and NODES SuperNodes (``partition-id`` 0, 1, ...; node n keeps its blocks in
    ``stores/n``), all registered; the name of the SuperLink connection written to
    ``home/config.toml`` for ``flwr run``."""
    link = free_port()
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "test"\n\n[superlink.test]\n'
        f'address = "127.0.0.1:{link}"\ninsecure = true\n'
    )
    processes.start(
        "superlink",
        [
            str(FLOWER_BIN / "flower-superlink"),
            *("--insecure", "--host", "127.0.0.1", "--port", str(link)),
            "--disable-runtime-dependency-installation",
        ],
    )
    processes.wait_for("superlink", rf"running on http://127\.0\.0\.1:{link}")
    for node in range(NODES):
        processes.start(
            f"supernode{node}",
            [
                str(FLOWER_BIN / "flower-supernode"),
                *("--insecure", "--superlink", f"127.0.0.1:{link}", "--host", "127.0.0.1"),
                *("--port", str(free_port())),
                *("--node-config", f"partition-id={node} blocks-store='{stores / str(node)}'"),
            ],
        )
    for node in range(NODES):
        processes.wait_for(f"supernode{node}", r"SuperNode ID: \d+")
    return "test"


def start_block_service(processes: Processes, data: Path) -> str:
    """``tensorswap serve`` (the worktree's) on a free port; its HOST:PORT."""
    processes.start(
        "tensorswap-serve",
        [
            str(FLOWER_BIN / "python"),
            *("-c", "from tensorswap.cli import main; main()"),
            *("serve", "--listen", "127.0.0.1:0", "--data", str(data)),
        ],
    )
    found = processes.wait_for("tensorswap-serve", r"listening on (127\.0\.0\.1:\d+)")
    return found.group(1)


def expected_fedavg(rounds: int) -> dict[str, np.ndarray]:
    """apps.client_app's training (noise seeded by node, round, tensor) averaged as FedAvg
    does: weighted by num-examples, 10 * (node + 1)."""
    arrays = {key: array.numpy().astype(np.float64) for key, array in initial_model().items()}
    weights = np.array([10.0 * (node + 1) for node in range(NODES)])
    weights /= weights.sum()
    for server_round in range(1, rounds + 1):
        new = {}
        for i, (key, values) in enumerate(arrays.items()):
            trained = []
            for node in range(NODES):
                rng = np.random.default_rng([node, server_round, i])
                start = values.astype(np.float32)
                trained.append(start + 0.1 * rng.standard_normal(start.shape).astype(np.float32))
            new[key] = sum(w * t.astype(np.float64) for w, t in zip(weights, trained, strict=True))
        arrays = new
    return arrays


def test_the_bridge_in_a_flower_deployment(processes: Processes, tmp_path: Path) -> None:
    home, out = tmp_path / "flwr-home", tmp_path / "out"
    out.mkdir()
    connection = start_federation(processes, home, tmp_path / "stores")
    blocks = start_block_service(processes, tmp_path / "blocks")
    config = f"blocks='{blocks}' out='{out}' rounds={ROUNDS} nodes={NODES}"
    run = subprocess.run(
        [
            str(FLOWER_BIN / "flwr"),
            *("run", str(HERE / "deploy_app"), connection, "--stream"),
            *("--run-config", config),
        ],
        env=processes.env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    logs = "\n".join(f"== {name}\n{processes.tail(name)}" for name in processes.started)
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}\n{logs}"
    assert (out / "arrays.npz").exists(), f"{run.stdout[-3000:]}\n{logs}"
    with np.load(out / "arrays.npz", allow_pickle=False) as saved:
        final = {key: saved[key] for key in saved.files}
    expected = expected_fedavg(ROUNDS)
    assert sorted(final) == sorted(expected)
    for key, values in expected.items():
        np.testing.assert_allclose(final[key], values, rtol=1e-5, atol=1e-5)
    counted = json.loads((out / "bytes.json").read_text())
    model_bytes = sum(values.astype(np.float32).nbytes for values in expected.values())
    # each round: the model down to each node twice (train, evaluate), a trained one back
    assert counted["referenced"] >= ROUNDS * 3 * NODES * model_bytes
    assert counted["carried"] <= 0.01 * counted["referenced"], counted
    for node in range(NODES):  # each node's processes shared one store on disk
        kept = NodeStore(tmp_path / "stores" / str(node)).roots()
        assert len(kept) >= ROUNDS, kept  # a global model per round at least
