"""A dropped upload inside a Flower run: the ClientApps reach the block service through a proxy
that cuts the first connection mid-upload; that node's mod pushes again on a fresh
connection, sending only the blocks the service still lacks, and the run's arrays are those
of the same run without a cut."""

from __future__ import annotations

import numpy as np
import pytest

flwr = pytest.importorskip("flwr")
from apps import SIMULATION_MARKS, initial_model, simulate  # noqa: E402
from flwr.app import MetricRecord, RecordDict  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402
from proxy import CuttingProxy  # noqa: E402

from tensorswap.flower import BlockService  # noqa: E402
from tensorswap.store import MemoryStore, ModelUpdate, put_update  # noqa: E402

pytestmark = [*SIMULATION_MARKS, pytest.mark.slow]

NODES, ROUNDS = 2, 2
FLOATS = 4 * 1024 * 1024  # apps.initial_model: 1.5 * FLOATS float32 values, 24 MiB


def totals(replies: list[RecordDict], weighted_by_key: str) -> MetricRecord:
    """Per round, the largest retry and sent-block counters the train replies report (each
    is a process's running total)."""

    def most(key: str) -> int:
        return max(int(reply["metrics"][key]) for reply in replies)  # type: ignore[arg-type]

    return MetricRecord({"retries": most("retries"), "sent-blocks": most("sent-blocks")})


def strategy(*, counted: bool = True) -> FedAvg:
    """FedAvg over every node; ``counted``: its train metrics are the links' counters."""
    more = {"train_metrics_aggr_fn": totals} if counted else {}
    return FedAvg(
        min_available_nodes=NODES, min_train_nodes=NODES, min_evaluate_nodes=NODES, **more
    )


def model_blocks() -> int:
    """How many blocks one trained model is (its chunks and manifests)."""
    store = MemoryStore()
    arrays = {key: array.numpy() for key, array in initial_model(FLOATS).items()}
    put_update(store, ModelUpdate(arrays))
    return len(list(store))


def test_a_node_whose_upload_is_cut_resumes_with_only_the_missing_blocks() -> None:
    plain = simulate(
        lambda: strategy(counted=False), None, nodes=NODES, rounds=ROUNDS, floats=FLOATS
    )["result"]
    with BlockService() as service:
        proxy = CuttingProxy(service.port, cut=10_000_000)  # inside a reply's third chunk
        try:
            run = simulate(
                strategy,
                service.address,
                nodes=NODES,
                rounds=ROUNDS,
                floats=FLOATS,
                swarm=False,
                report_link=True,
                client_address=f"127.0.0.1:{proxy.port}",
            )
        finally:
            proxy.close()
    run["strategy"].close()
    assert proxy.connections >= 2  # the cut one, then a fresh one
    metrics = run["result"].train_metrics_clientapp
    assert int(metrics[ROUNDS]["retries"]) >= 1, dict(metrics[ROUNDS])
    # every process pushes each round's model once; the cut push sent again only what the
    # service lacked, so no process sent as many blocks as it pushed models in full
    pushes_per_process = NODES * ROUNDS
    assert int(metrics[ROUNDS]["sent-blocks"]) < pushes_per_process * model_blocks()
    got, want = run["result"].arrays, plain.arrays
    assert sorted(got) == sorted(want)
    for key in want:
        np.testing.assert_allclose(got[key].numpy(), want[key].numpy(), rtol=1e-6, atol=1e-6)
