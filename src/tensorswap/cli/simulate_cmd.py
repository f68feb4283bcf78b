"""`tensorswap simulate`: many virtual clients against a real coordinator, local or on Ray."""

from __future__ import annotations

import asyncio
from pathlib import Path

import click
from rich.console import Console

from tensorswap.cli._util import (
    parse_host_port,
    parse_numbers,
    parse_options,
    policy_options,
)


@click.command("simulate")
@click.option("--clients", required=True, type=click.IntRange(1), metavar="N", help="Clients.")
@click.option(
    "--per-round",
    "per_round",
    required=True,
    type=click.IntRange(1),
    metavar="K",
    help="Clients the coordinator samples (of the N registered) each round.",
)
@click.option("--rounds", required=True, type=click.IntRange(1), metavar="R", help="Rounds.")
@click.option(
    "--model-mib",
    "model_mib",
    type=click.FloatRange(min=0, min_open=True, max=4096),
    default=None,
    metavar="M",
    help="The synthetic task's model size in MiB [default: 1; implies --task synthetic].",
)
@click.option(
    "--task",
    type=click.Choice(["auto", "digits", "synthetic"]),
    default="auto",
    show_default=True,
    help="digits: the demo's MLP on scikit-learn's digits (up to 200 clients); synthetic: a "
    "quadratic objective per client, any size; auto: digits for small N, else synthetic.",
)
@click.option(
    "--backend",
    type=click.Choice(["process", "ray"]),
    default="process",
    show_default=True,
    help="process: local worker processes; ray: Ray actors (pip install 'tensorswap[ray]').",
)
@click.option(
    "--workers",
    type=click.IntRange(1),
    default=None,
    metavar="W",
    help="Worker processes or actors, each hosting N/W clients [default: CPU cores, at most 8].",
)
@click.option(
    "--ray-address",
    "ray_address",
    default=None,
    metavar="ADDRESS",
    help="Join this Ray cluster (ray://HOST:10001, HOST:6379 or auto) instead of starting a "
    "local instance; use --listen / --advertise so its nodes reach the coordinator.",
)
@click.option(
    "--listen",
    default="127.0.0.1:0",
    callback=lambda ctx, param, value: parse_host_port(value) and value,
    show_default=True,
    metavar="HOST:PORT",
    help="Where the coordinator listens.",
)
@click.option(
    "--advertise",
    default=None,
    metavar="HOST",
    help="The coordinator's address as workers dial it [default: the listening host].",
)
@click.option("--local-epochs", default=2, show_default=True, type=click.IntRange(1, 100))
@click.option(
    "--lr",
    default=0.5,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True, max=1),
    help="The synthetic task's local step size.",
)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option(
    "--round-timeout",
    "round_timeout",
    default=600.0,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds a round may take before the simulation gives up.",
)
@click.option(
    "--out",
    default=Path("simulate-out"),
    show_default=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Where summary.json, simulate.png and the processes' logs go.",
)
@click.option(
    "--data",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="The coordinator's data directory, emptied first [default: OUT/coordinator].",
)
@click.option(
    "--keep-rounds",
    default=1,
    show_default=True,
    type=click.IntRange(0),
    metavar="N",
    help="Rounds whose blocks the coordinator keeps; older contributions and models are "
    "deleted as rounds end (0: keep everything; a round of K clients stores K updates).",
)
@policy_options
@click.option("--no-plot", is_flag=True, help="Skip simulate.png.")
def simulate(
    clients: int,
    per_round: int,
    rounds: int,
    model_mib: float | None,
    task: str,
    backend: str,
    workers: int | None,
    ray_address: str | None,
    listen: str,
    advertise: str | None,
    local_epochs: int,
    lr: float,
    seed: int,
    round_timeout: float,
    out: Path,
    data: Path | None,
    keep_rounds: int,
    strategy: str,
    params: tuple[str, ...],
    optimizer: str,
    opts: tuple[str, ...],
    no_plot: bool,
) -> None:
    """Simulate N clients, K sampled per round, for R rounds, against a real coordinator.

    Starts `tensorswap serve`, hosts the virtual clients (each registered under its own name)
    many per worker, and runs a federated run on the coordinator: every update goes over
    tensorswap's wire. Writes OUT/summary.json (per round: participants, accuracy or loss,
    seconds, bytes; the peak memory of the whole simulation) and OUT/simulate.png.
    """
    from tensorswap.simulate import InvalidSimulation, SimConfig
    from tensorswap.simulate.driver import run_simulation
    from tensorswap.simulate.output import SimUi, round_table, write_outputs

    if model_mib is not None and task == "auto":
        task = "synthetic"
    try:
        cfg = SimConfig(
            clients=clients,
            per_round=per_round,
            rounds=rounds,
            model_mib=model_mib,
            task=task,
            backend=backend,
            workers=workers,
            out=out,
            data=data,
            seed=seed,
            local_epochs=local_epochs,
            lr=lr,
            round_timeout_s=round_timeout,
            ray_address=ray_address,
            listen=listen,
            advertise=advertise,
            keep_rounds=keep_rounds,
            strategy=strategy,
            params=parse_options(params),
            optimizer=optimizer,
            optimizer_params=parse_numbers(opts),
        )
    except InvalidSimulation as exc:
        raise click.UsageError(str(exc)) from None
    if backend == "ray":
        from tensorswap.simulate.ray_backend import ray_available

        if not ray_available():
            raise click.UsageError("--backend ray needs Ray: pip install 'tensorswap[ray]'")
    console = Console(stderr=True)
    console.print(
        f"simulating {clients:,} clients ({cfg.resolved_task} task), {per_round:,} per round, "
        f"{rounds} rounds, on {cfg.resolved_workers} {backend} workers"
    )
    ui = SimUi(console, rounds, "accuracy" if cfg.resolved_task == "digits" else "loss")
    with ui.progress:
        result = asyncio.run(run_simulation(cfg, ui))
    console.print(round_table(result))
    written = write_outputs(result, out, plot=not no_plot)
    console.print(
        f"{result.mean_round_s:.2f}s per round (setup {result.setup_s:.1f}s), peak memory "
        f"{result.peak_memory_bytes / 2**20:.0f} MiB over {result.peak_processes} processes; "
        + ", ".join(str(p) for p in written)
    )


if __name__ == "__main__":  # pragma: no cover
    simulate()
