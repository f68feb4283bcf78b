"""The options of `tensorswap simulate`, grouped by concern, and the SimConfig they make."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from tensorswap.cli._util import option_group, parse_host_port, parse_numbers, policy_params

if TYPE_CHECKING:
    from tensorswap.simulate import SimConfig

__all__ = ["BACKEND_OPTIONS", "SIZE_OPTIONS", "TRAINING_OPTIONS", "sim_config"]

# How many clients, rounds and what they train.
SIZE_OPTIONS = option_group(
    click.option("--clients", required=True, type=click.IntRange(1), metavar="N", help="Clients."),
    click.option(
        "--per-round",
        "per_round",
        required=True,
        type=click.IntRange(1),
        metavar="K",
        help="Clients the coordinator samples (of the N registered) each round.",
    ),
    click.option("--rounds", required=True, type=click.IntRange(1), metavar="R", help="Rounds."),
    click.option(
        "--model-mib",
        "model_mib",
        type=click.FloatRange(min=0, min_open=True, max=4096),
        default=None,
        metavar="M",
        help="The synthetic task's model size in MiB [default: 1; implies --task synthetic].",
    ),
    click.option(
        "--task",
        type=click.Choice(["auto", "digits", "synthetic"]),
        default="auto",
        show_default=True,
        help="digits: the demo's MLP on scikit-learn's digits (up to 200 clients); synthetic: a "
        "quadratic objective per client, any size; auto: digits for small N, else synthetic.",
    ),
)


# Where the virtual clients run, and where the coordinator listens.
BACKEND_OPTIONS = option_group(
    click.option(
        "--backend",
        type=click.Choice(["process", "ray"]),
        default="process",
        show_default=True,
        help="process: local worker processes; ray: Ray actors (pip install 'tensorswap[ray]').",
    ),
    click.option(
        "--workers",
        type=click.IntRange(1),
        default=None,
        metavar="W",
        help="Worker processes or actors, each hosting N/W clients "
        "[default: CPU cores, at most 8].",
    ),
    click.option(
        "--ray-address",
        "ray_address",
        default=None,
        metavar="ADDRESS",
        help="Join this Ray cluster (ray://HOST:10001, HOST:6379 or auto) instead of starting a "
        "local instance; use --listen / --advertise so its nodes reach the coordinator.",
    ),
    click.option(
        "--listen",
        default="127.0.0.1:0",
        callback=lambda ctx, param, value: parse_host_port(value) and value,
        show_default=True,
        metavar="HOST:PORT",
        help="Where the coordinator listens.",
    ),
    click.option(
        "--advertise",
        default=None,
        metavar="HOST",
        help="The coordinator's address as workers dial it [default: the listening host].",
    ),
)


# Local training, deadlines, outputs and retention.
TRAINING_OPTIONS = option_group(
    click.option("--local-epochs", default=2, show_default=True, type=click.IntRange(1, 100)),
    click.option(
        "--lr",
        default=0.5,
        show_default=True,
        type=click.FloatRange(min=0, min_open=True, max=1),
        help="The synthetic task's local step size.",
    ),
    click.option("--seed", default=0, show_default=True, type=int),
    click.option(
        "--round-timeout",
        "round_timeout",
        default=600.0,
        show_default=True,
        type=click.FloatRange(min=0, min_open=True),
        help="Seconds a round may take before the simulation gives up.",
    ),
    click.option(
        "--out",
        default=Path("simulate-out"),
        show_default=True,
        type=click.Path(file_okay=False, path_type=Path),
        help="Where summary.json, simulate.png and the processes' logs go.",
    ),
    click.option(
        "--data",
        type=click.Path(file_okay=False, path_type=Path),
        default=None,
        help="The coordinator's data directory, emptied first [default: OUT/coordinator].",
    ),
    click.option(
        "--keep-rounds",
        default=1,
        show_default=True,
        type=click.IntRange(0),
        metavar="N",
        help="Rounds whose blocks the coordinator keeps; older contributions and models are "
        "deleted as rounds end (0: keep everything; a round of K clients stores K updates).",
    ),
)


def sim_config(o: dict[str, Any]) -> SimConfig:
    """The SimConfig the options of ``simulate`` describe (``--model-mib`` makes an ``auto``
    task synthetic); an invalid one is a usage error."""
    from tensorswap.simulate import InvalidSimulation, SimConfig

    task = "synthetic" if o["model_mib"] is not None and o["task"] == "auto" else o["task"]
    try:
        return SimConfig(
            clients=o["clients"],
            per_round=o["per_round"],
            rounds=o["rounds"],
            model_mib=o["model_mib"],
            task=task,
            backend=o["backend"],
            workers=o["workers"],
            out=o["out"],
            data=o["data"],
            seed=o["seed"],
            local_epochs=o["local_epochs"],
            lr=o["lr"],
            round_timeout_s=o["round_timeout"],
            ray_address=o["ray_address"],
            listen=o["listen"],
            advertise=o["advertise"],
            keep_rounds=o["keep_rounds"],
            strategy=o["strategy"],
            params=policy_params(o),
            optimizer=o["optimizer"],
            optimizer_params=parse_numbers(o["opts"]),
        )
    except InvalidSimulation as exc:
        raise click.UsageError(str(exc)) from None
