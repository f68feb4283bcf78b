"""The swarm path in a Flower run: with ``swarm=True`` (BlockStrategy's default) the ClientApp
processes fetch chunks of the global model from each other, not only from the block service."""

from __future__ import annotations

import pytest

flwr = pytest.importorskip("flwr")
from apps import SIMULATION_MARKS, simulate  # noqa: E402
from flwr.app import MetricRecord, RecordDict  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402

from tensorswap.flower import BlockService  # noqa: E402
from tensorswap.store import DEFAULT_CHUNK_BYTES  # noqa: E402

pytestmark = SIMULATION_MARKS

NODES, ROUNDS = 4, 3
FLOATS = 4 * 1024 * 1024  # apps.initial_model: 1.5 * FLOATS float32 values, 24 MiB, 6 chunks


def most_from_peers(replies: list[RecordDict], weighted_by_key: str) -> MetricRecord:
    """The largest ``from-peers`` counter the round's train replies report (each is a
    process's running total: the bytes its link has had from other peers so far)."""
    counts = [int(reply["metrics"]["from-peers"]) for reply in replies]  # type: ignore[arg-type]
    return MetricRecord({"from-peers": max(counts)})


def strategy() -> FedAvg:
    return FedAvg(
        min_available_nodes=NODES,
        min_train_nodes=NODES,
        min_evaluate_nodes=NODES,
        train_metrics_aggr_fn=most_from_peers,
    )


@pytest.mark.slow
def test_chunks_of_the_global_model_come_from_peers() -> None:
    with BlockService() as service:
        run = simulate(
            strategy, service.address, nodes=NODES, rounds=ROUNDS, floats=FLOATS, report_link=True
        )
    run["strategy"].close()
    train_metrics = run["result"].train_metrics_clientapp
    assert sorted(train_metrics) == list(range(1, ROUNDS + 1))
    from_peers = int(train_metrics[ROUNDS]["from-peers"])
    # the two Ray workers (one link each) fetched each global model at about the same time:
    # at least one whole chunk came from the other worker's seeder, not from the service
    assert from_peers >= DEFAULT_CHUNK_BYTES, dict(train_metrics[ROUNDS])
