"""`tensorswap demo`: federated training of a real model across peer processes."""

from __future__ import annotations

import asyncio
from typing import Any

import click
from rich.console import Console

from tensorswap.cli._demo_options import (
    NETWORK_OPTIONS,
    PRIVACY_OPTIONS,
    SHAPE_OPTIONS,
    TRAINING_OPTIONS,
)


@click.command("demo")
@TRAINING_OPTIONS
@SHAPE_OPTIONS
@PRIVACY_OPTIONS
@NETWORK_OPTIONS
def demo(**options: Any) -> int:
    """Train an MLP on digits federatedly across peer processes, with progress and a plot.

    Starts a local coordinator (star topology), spawns PEERS peer processes, each with its
    own non-IID shard, and runs ROUNDS rounds: local epochs, submit, aggregate, fetch,
    evaluate. Prints each round, a summary table, and writes demo.png and summary.json to
    OUT.

    With --mode, --server-opt, --sample, --slow-peer, --dp-clip or --secagg the demo is one
    federated run on the coordinator instead: the peers long-poll for tasks, the coordinator
    samples them and steps the global model with the server optimizer (sync), or folds deltas
    as they come and makes a version every --buffer of them (async); the plot shows accuracy
    against wall-clock time.

    With --topology diloco there is no aggregation server: the peers meet at a rendezvous
    (a local `tensorswap serve`), take --inner-steps minibatch steps each, then average their
    pseudo-gradients among themselves (the collective all-reduce, --compression f16 or int8)
    and take DiLoCo's outer Nesterov step, --rounds times; summary.json has one entry per
    outer step and the plot shows accuracy against the bytes sent.
    """
    from tensorswap.demo.driver import DemoConfig, DemoError, check_config, run_demo

    kill_peer, rounds = options["kill_peer"], options["rounds"]
    if kill_peer is not None and kill_peer > rounds:
        raise click.BadParameter(f"round {kill_peer} > --rounds {rounds}", param_hint="--kill-peer")
    if kill_peer is not None and options["peers"] < 2:
        raise click.BadParameter("needs at least 2 peers", param_hint="--kill-peer")
    cfg = DemoConfig(deadline_s=options.pop("deadline"), **options)
    try:
        check_config(cfg)
    except DemoError as exc:
        raise click.UsageError(str(exc)) from exc
    console = Console()
    try:
        if cfg.netlab:
            from tensorswap.demo.netlab import run_in_lab

            report = run_in_lab(cfg, console)
        else:
            report = asyncio.run(run_demo(cfg, console))
    except DemoError as exc:
        raise click.ClickException(str(exc)) from exc
    except KeyboardInterrupt:
        # asyncio.run cancelled the run first: its cleanup stopped and reaped every process.
        console.print("interrupted: the coordinator and every peer process were stopped")
        return 130
    done = report.rounds or report.versions or report.outer_steps
    return 0 if all(r.ok for r in report.rounds) and done else 1
