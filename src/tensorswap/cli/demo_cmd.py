"""`tensorswap demo`: federated training of a real model across peer processes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import click
from rich.console import Console

from tensorswap.aggregate import AggregatorKind

COMPRESSIONS = ("none", "f16", "int8", "topk")


@click.command("demo")
@click.option("--peers", default=4, show_default=True, type=click.IntRange(1, 32))
@click.option("--rounds", default=10, show_default=True, type=click.IntRange(1, 1000))
@click.option(
    "--aggregator",
    default="fedavg",
    show_default=True,
    type=click.Choice([k.value for k in AggregatorKind]),
    help="How the coordinator (or, in p2p, each peer) combines the updates.",
)
@click.option(
    "--compression",
    default="none",
    show_default=True,
    type=click.Choice(COMPRESSIONS),
    help="Lossy encoding of what peers send (star): they then send weight deltas.",
)
@click.option(
    "--topology",
    default="star",
    show_default=True,
    type=click.Choice(["star", "p2p"]),
    help="star: a coordinator aggregates; p2p: peers broadcast deltas on the delta bus.",
)
@click.option(
    "--kill-peer",
    "kill_peer",
    type=click.IntRange(1),
    default=None,
    metavar="ROUND",
    help="Kill one peer process during ROUND; the round completes by quorum at its deadline.",
)
@click.option("--local-epochs", default=2, show_default=True, type=click.IntRange(1, 100))
@click.option("--seed", default=0, show_default=True, type=int)
@click.option(
    "--out",
    default=Path("tensorswap-out"),
    show_default=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Where the plot, summary.json and the processes' logs go.",
)
@click.option(
    "--data",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Keep the coordinator's round database and blocks here (default: a temp dir).",
)
@click.option(
    "--deadline",
    default=15.0,
    show_default=True,
    type=click.FloatRange(0.1),
    help="Seconds a round waits for missing peers before it aggregates what it has.",
)
@click.option(
    "--quorum",
    type=click.IntRange(1),
    default=None,
    help="Contributions a round needs at its deadline [default: all peers, or all but one "
    "with --kill-peer].",
)
@click.option(
    "--freeze-first-layer",
    is_flag=True,
    help="Train only the output layer (fine-tuning): the frozen layer's blocks dedup.",
)
@click.option(
    "--max-fragment-bytes",
    type=click.IntRange(1024, 2**32 - 1),
    default=None,
    help="p2p: the DWE fragment size cap [default: 8 MiB]; a larger delta is sent in parts.",
)
def demo(
    peers: int,
    rounds: int,
    aggregator: str,
    compression: str,
    topology: str,
    kill_peer: int | None,
    local_epochs: int,
    seed: int,
    out: Path,
    data: Path | None,
    deadline: float,
    quorum: int | None,
    freeze_first_layer: bool,
    max_fragment_bytes: int | None,
) -> int:
    """Train an MLP on digits federatedly across peer processes, with progress and a plot.

    Starts a local coordinator (star topology), spawns PEERS peer processes, each with its
    own non-IID shard, and runs ROUNDS rounds: local epochs, submit, aggregate, fetch,
    evaluate. Prints each round, a summary table, and writes demo.png and summary.json to
    OUT.
    """
    from tensorswap.demo.driver import DemoConfig, DemoError, run_demo

    if kill_peer is not None and kill_peer > rounds:
        raise click.BadParameter(f"round {kill_peer} > --rounds {rounds}", param_hint="--kill-peer")
    if kill_peer is not None and peers < 2:
        raise click.BadParameter("needs at least 2 peers", param_hint="--kill-peer")
    cfg = DemoConfig(
        peers=peers,
        rounds=rounds,
        aggregator=aggregator,
        compression=compression,
        topology=topology,
        kill_peer=kill_peer,
        local_epochs=local_epochs,
        seed=seed,
        out=out,
        data=data,
        deadline_s=deadline,
        quorum=quorum,
        freeze_first_layer=freeze_first_layer,
        max_fragment_bytes=max_fragment_bytes,
    )
    console = Console()
    try:
        report = asyncio.run(run_demo(cfg, console))
    except DemoError as exc:
        raise click.ClickException(str(exc)) from exc
    except KeyboardInterrupt:
        # asyncio.run cancelled the run first: its cleanup stopped and reaped every process.
        console.print("interrupted: the coordinator and every peer process were stopped")
        return 130
    return 0 if all(r.ok for r in report.rounds) else 1
