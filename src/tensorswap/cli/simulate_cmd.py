"""`tensorswap simulate`: many virtual clients against a real coordinator, local or on Ray."""

from __future__ import annotations

import asyncio
from typing import Any

import click
from rich.console import Console

from tensorswap.cli._simulate_options import (
    BACKEND_OPTIONS,
    SIZE_OPTIONS,
    TRAINING_OPTIONS,
    sim_config,
)
from tensorswap.cli._util import policy_options


@click.command("simulate")
@SIZE_OPTIONS
@BACKEND_OPTIONS
@TRAINING_OPTIONS
@policy_options
@click.option("--no-plot", is_flag=True, help="Skip simulate.png.")
def simulate(**o: Any) -> None:
    """Simulate N clients, K sampled per round, for R rounds, against a real coordinator.

    Starts `tensorswap serve`, hosts the virtual clients (each registered under its own name)
    many per worker, and runs a federated run on the coordinator: every update goes over
    tensorswap's wire. Writes OUT/summary.json (per round: participants, accuracy or loss,
    seconds, bytes; the peak memory of the whole simulation) and OUT/simulate.png.
    """
    from tensorswap.simulate.driver import run_simulation
    from tensorswap.simulate.output import SimUi, round_table, write_outputs

    cfg = sim_config(o)
    clients, per_round, rounds, backend = o["clients"], o["per_round"], o["rounds"], o["backend"]
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
    written = write_outputs(result, o["out"], plot=not o["no_plot"])
    console.print(
        f"{result.mean_round_s:.2f}s per round (setup {result.setup_s:.1f}s), peak memory "
        f"{result.peak_memory_bytes / 2**20:.0f} MiB over {result.peak_processes} processes; "
        + ", ".join(str(p) for p in written)
    )


if __name__ == "__main__":  # pragma: no cover
    simulate()
