"""The benchmark's ServerApp: FedAvg over every node, no evaluation, wrapped in BlockStrategy
when the run config names a block service (``stream``: the service aggregates the replies;
MarkedFedAvg overrides ``aggregate_train`` around FedAvg's, so the bridge is told so). Each
round's start and end (time and the byte counters of this host's link, ``/proc/net/dev``) are
appended to ``out/marks.jsonl``."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg, Strategy

from tensorswap.flower import BlockStrategy

app = ServerApp()
MiB = 1024 * 1024


def link_bytes(device: str) -> tuple[int, int]:
    """(received, sent) bytes of ``device`` as this process's network namespace counts them."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, fields = line.partition(":")
        if name.strip() == device:
            values = fields.split()
            return int(values[0]), int(values[8])
    raise LookupError(f"no interface {device!r} in /proc/net/dev")


class MarkedFedAvg(FedAvg):  # type: ignore[misc]
    """FedAvg that marks when each round's training starts (before the messages are made),
    when its aggregation begins (every reply in) and ends: inside BlockStrategy, the global
    model's push and the replies' fetches (streamed: the service's aggregation and the
    aggregate's fetch) fall between the first two marks."""

    def __init__(self, marks: Path, device: str, **options: object) -> None:
        super().__init__(**options)
        self.marks, self.device = marks, device

    def mark(self, event: str, server_round: int) -> None:
        rx, tx = link_bytes(self.device)
        line = {"event": event, "round": server_round, "t": time.time(), "rx": rx, "tx": tx}
        with self.marks.open("a") as out:
            out.write(json.dumps(line) + "\n")

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self.mark("start", server_round)
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        self.mark("aggregating", server_round)
        aggregated = super().aggregate_train(server_round, replies)
        self.mark("end", server_round)
        return aggregated


class MarkedBlockStrategy(BlockStrategy):
    """BlockStrategy marking when Flower hands it the replies (``handed``), before it takes
    the service's aggregate (fetched then, or before by its prefetch)."""

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        self.strategy.mark("handed", server_round)
        return super().aggregate_train(server_round, replies)


def initial_model(nbytes: int, tensors: int, seed: int) -> ArrayRecord:
    """``tensors`` float32 tensors of ``nbytes`` in all, random (no two chunks alike)."""
    rng = np.random.default_rng(seed)
    floats = nbytes // 4 // tensors
    return ArrayRecord(
        {f"layer{i}": Array(rng.standard_normal(floats, np.float32)) for i in range(tensors)}
    )


@app.main()
def main(grid: Grid, context: Context) -> None:
    config = context.run_config
    nodes, out = int(config["nodes"]), Path(str(config["out"]))
    strategy: Strategy = MarkedFedAvg(
        out / "marks.jsonl",
        str(config["device"]),
        fraction_evaluate=0.0,
        min_available_nodes=nodes,
        min_train_nodes=nodes,
    )
    address = str(config["blocks"])
    if address:
        strategy = MarkedBlockStrategy(
            strategy, address, swarm=bool(config["swarm"]), stream=bool(config["stream"])
        )
    kib = int(config["kib"])  # a model of a few KiB: the round's floor (0: ``mib`` MiB)
    nbytes = kib * 1024 if kib > 0 else int(config["mib"]) * MiB
    model = initial_model(nbytes, int(config["tensors"]), int(config["seed"]))
    strategy.start(grid, model, num_rounds=int(config["rounds"]))
    if isinstance(strategy, BlockStrategy):
        counted = {
            "carried": strategy.bytes.carried,
            "referenced": strategy.bytes.referenced,
            "streamed_rounds": strategy.streamed_rounds,
            "arrival_rounds": strategy.arrival_rounds,
            "prefetched_rounds": getattr(strategy, "prefetched_rounds", 0),
            "fetched": strategy.link.counters.fetched_bytes,
            "sent": strategy.link.counters.sent_bytes,
        }
        (out / "bytes.json").write_text(json.dumps(counted))
        strategy.close()
