"""The options of `tensorswap demo`, grouped by concern."""

from __future__ import annotations

from pathlib import Path

import click

from tensorswap.aggregate import AggregatorKind
from tensorswap.cli._util import option_group
from tensorswap.demo.config import DEFAULT_INNER_STEPS

__all__ = ["NETWORK_OPTIONS", "PRIVACY_OPTIONS", "SHAPE_OPTIONS", "TRAINING_OPTIONS"]

COMPRESSIONS = ("none", "f16", "int8", "topk")
SERVER_OPTIMIZERS = ("fedavg", "fedavgm", "fedadam", "fedyogi", "fedadagrad", "nesterov")

# What the demo trains, how many peers and rounds, and where it writes.
TRAINING_OPTIONS = option_group(
    click.option("--peers", default=4, show_default=True, type=click.IntRange(1, 32)),
    click.option(
        "--rounds",
        default=10,
        show_default=True,
        type=click.IntRange(1, 1000),
        help="Rounds (star, p2p), versions (a federated run) or outer steps (diloco).",
    ),
    click.option(
        "--aggregator",
        default="fedavg",
        show_default=True,
        type=click.Choice([k.value for k in AggregatorKind]),
        help="How the coordinator (or, in p2p, each peer) combines the updates.",
    ),
    click.option(
        "--compression",
        default="none",
        show_default=True,
        type=click.Choice(COMPRESSIONS),
        help="Lossy encoding of what peers send (star: they then send weight deltas; diloco: "
        "the all-reduce's chunks, f16 or int8, with error feedback).",
    ),
    click.option(
        "--topology",
        default="star",
        show_default=True,
        type=click.Choice(["star", "p2p", "diloco"]),
        help="star: a coordinator aggregates; p2p: peers broadcast deltas on the delta bus; "
        "diloco: peers take --inner-steps local steps, then all-reduce their pseudo-gradients "
        "among themselves and take DiLoCo's outer Nesterov step, --rounds times.",
    ),
    click.option(
        "--inner-steps",
        "inner_steps",
        type=click.IntRange(1, 100_000),
        default=None,
        metavar="H",
        help=f"diloco: minibatch steps per outer step [default: {DEFAULT_INNER_STEPS}].",
    ),
    click.option(
        "--kill-peer",
        "kill_peer",
        type=click.IntRange(1),
        default=None,
        metavar="ROUND",
        help="Kill one peer process during ROUND; the round completes by quorum at its deadline.",
    ),
    click.option("--local-epochs", default=2, show_default=True, type=click.IntRange(1, 100)),
    click.option("--seed", default=0, show_default=True, type=int),
    click.option(
        "--out",
        default=Path("tensorswap-out"),
        show_default=True,
        type=click.Path(file_okay=False, path_type=Path),
        help="Where the plot, summary.json and the processes' logs go.",
    ),
    click.option(
        "--data",
        type=click.Path(file_okay=False, path_type=Path),
        default=None,
        help="Keep the coordinator's round database and blocks here (default: a temp dir).",
    ),
    click.option(
        "--deadline",
        default=15.0,
        show_default=True,
        type=click.FloatRange(0.1),
        help="Seconds a round waits for missing peers before it aggregates what it has.",
    ),
    click.option(
        "--quorum",
        type=click.IntRange(1),
        default=None,
        help="Contributions a round needs at its deadline [default: all peers, or all but one "
        "with --kill-peer].",
    ),
)


# Fine-tuning, fragment sizes, and the demo as a federated run (sync or async).
SHAPE_OPTIONS = option_group(
    click.option(
        "--freeze-first-layer",
        is_flag=True,
        help="Train only the output layer (fine-tuning): the frozen layer's blocks dedup.",
    ),
    click.option(
        "--max-fragment-bytes",
        type=click.IntRange(1024, 2**32 - 1),
        default=None,
        help="p2p: the DWE fragment size cap [default: 8 MiB]; a larger delta is sent in parts.",
    ),
    click.option(
        "--mode",
        type=click.Choice(["sync", "async"]),
        default=None,
        help="Run the demo as a federated run (`tensorswap run`): sync rounds with a barrier, or "
        "async buffered aggregation (FedBuff) [default: independent rounds; sync when another "
        "run option is given].",
    ),
    click.option(
        "--server-opt",
        "server_opt",
        type=click.Choice(SERVER_OPTIMIZERS),
        default=None,
        help="The run's server optimizer (Flower's defaults) [default: fedavg].",
    ),
    click.option(
        "--sample",
        type=click.IntRange(1),
        default=None,
        metavar="K",
        help="Sync run: K of the --peers peers trained per round, sampled by the coordinator.",
    ),
    click.option(
        "--slow-peer",
        "slow_peer",
        type=click.IntRange(0),
        default=None,
        metavar="N",
        help="Peer N trains 5x slower (--slow-factor): see how sync and async cope.",
    ),
    click.option("--slow-factor", default=5.0, show_default=True, type=click.FloatRange(1, 1000)),
    click.option(
        "--buffer",
        type=click.IntRange(1),
        default=None,
        help="Async run: contributions per version [default: half the peers].",
    ),
    click.option(
        "--max-staleness",
        default=8,
        show_default=True,
        type=click.IntRange(0),
        help="Async run: a delta trained on a version older than this many is refused.",
    ),
)


# Differential privacy and secure aggregation.
PRIVACY_OPTIONS = option_group(
    click.option(
        "--dp-clip",
        "dp_clip",
        type=click.FloatRange(min=0, min_open=True),
        default=None,
        metavar="C",
        help="Differential privacy (a sync run, DP-FedAvg): clip each update's delta to L2 norm "
        "C; prints epsilon per round and plots accuracy against it.",
    ),
    click.option(
        "--dp-noise",
        "dp_noise",
        type=click.FloatRange(min=0),
        default=1.0,
        show_default=True,
        metavar="Z",
        help="DP noise multiplier: Gaussian noise of std Z*C/sampled on the mean delta.",
    ),
    click.option("--dp-delta", "dp_delta", type=float, default=1e-5, show_default=True),
    click.option(
        "--dp-max-epsilon",
        "dp_max_epsilon",
        type=click.FloatRange(min=0, min_open=True),
        default=None,
        metavar="E",
        help="Stop the run before a round would take epsilon past E.",
    ),
    click.option(
        "--secagg",
        is_flag=True,
        help="Secure aggregation (SecAgg+, a sync run): the coordinator learns only the sum of "
        "each round's updates, never one peer's.",
    ),
    click.option(
        "--secagg-threshold",
        "secagg_threshold",
        type=click.IntRange(2),
        default=None,
        metavar="T",
        help="SecAgg+: survivors needed to unmask a round [default: SecAgg+'s for its size].",
    ),
)


# The network the demo runs over, and how peers fetch aggregates.
NETWORK_OPTIONS = option_group(
    click.option(
        "--netlab",
        is_flag=True,
        help="Run the coordinator and each peer on a host of its own (Linux network namespaces, "
        "root only) over shaped links: watch the system on a slow network.",
    ),
    click.option(
        "--link-mbit",
        default=20.0,
        show_default=True,
        type=click.FloatRange(min=0, min_open=True),
        help="--netlab: each host's link rate, both ways.",
    ),
    click.option(
        "--rtt-ms",
        default=40.0,
        show_default=True,
        type=click.FloatRange(min=0),
        help="--netlab: round-trip time the peers see to the coordinator (0: none).",
    ),
    click.option(
        "--swarm",
        is_flag=True,
        help="Star rounds: peers fetch each round's aggregate (the next global model) from the "
        "coordinator and from each other at once (tensorswap.swarm), every block CID-checked.",
    ),
)
