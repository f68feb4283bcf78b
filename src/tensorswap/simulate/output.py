"""What a simulation shows and writes: a progress bar, the per-round table, summary.json and
simulate.png (the metric and the time per round)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from tensorswap.demo.output import fmt_bytes
from tensorswap.simulate.driver import RoundRow, SimResult

__all__ = ["SimUi", "plot_result", "round_table", "write_outputs"]


class SimUi:
    """A rich progress bar over the rounds, a line per round as it ends."""

    def __init__(self, console: Console, rounds: int, metric: str) -> None:
        self.console, self.rounds, self.metric = console, rounds, metric
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total} rounds"),
            TextColumn(metric + " {task.fields[metric]}"),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        )
        self.task = self.progress.add_task("starting", total=rounds, metric="-")

    def __call__(self, kind: str, data: Any) -> None:
        if kind == "ready":
            clients = sum(int(r.get("clients", 0)) for r in data)
            self.console.print(f"{len(data)} workers ready, {clients:,} clients registered")
            self.progress.update(self.task, description="simulating")
        elif kind == "round":
            row: RoundRow = data
            self.progress.update(self.task, advance=1, metric=f"{row.metric:.4g}")
            self.console.print(
                f"[green]✓[/green] round {row.round:>3}/{self.rounds}  "
                f"{self.metric} {row.metric:.4g}  clients {len(row.participants)}  "
                f"{row.seconds:.2f}s  {fmt_bytes(row.bytes)}"
            )


def round_table(result: SimResult) -> Table:
    table = Table(title="simulation rounds")
    for column in ("round", "clients", result.metric, "train loss", "seconds", "bytes"):
        table.add_column(column, justify="right")
    for r in result.rounds:
        table.add_row(
            str(r.round),
            str(len(r.participants)),
            f"{r.metric:.4g}",
            "-" if r.train_loss is None else f"{r.train_loss:.4g}",
            f"{r.seconds:.2f}",
            fmt_bytes(r.bytes),
        )
    return table


def plot_result(result: SimResult, path: Path) -> None:
    """The metric and the seconds per round as a PNG (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rounds = [r.round for r in result.rounds]
    fig, (ax_metric, ax_time) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    try:
        ax_metric.plot(rounds, [r.metric for r in result.rounds], marker="o")
        ax_metric.set_ylabel(f"global model {result.metric}")
        if result.metric == "loss":
            ax_metric.set_yscale("log")
        cfg = result.config
        ax_metric.set_title(
            f"{cfg['clients']:,} clients, {cfg['per_round']:,} per round, {cfg['task']} task, "
            f"{cfg['backend']} backend x {cfg['workers']}"
        )
        ax_time.bar(rounds, [r.seconds for r in result.rounds])
        ax_time.set_ylabel("seconds per round")
        ax_time.set_xlabel("round")
        ax_time.xaxis.set_major_locator(MaxNLocator(integer=True))
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)


def write_outputs(result: SimResult, out: Path, *, plot: bool = True) -> list[Path]:
    """summary.json and (with matplotlib installed) simulate.png under ``out``."""
    written = [out / "summary.json"]
    written[0].write_text(json.dumps(result.to_json(), indent=2) + "\n")
    if plot and result.rounds:
        try:
            plot_result(result, out / "simulate.png")
        except ImportError:
            pass
        else:
            written.append(out / "simulate.png")
    return written
