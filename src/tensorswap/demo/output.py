"""What a demo run shows and writes: rich progress, the summary table, summary.json, demo.png."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from tensorswap.demo.config import DemoConfig
from tensorswap.demo.report import DemoReport, RoundReport

__all__ = ["ProgressUi", "finish", "finish_with", "fmt_bytes", "plot_report"]


def fmt_bytes(n: float) -> str:
    """A byte count for people: ``512 B``, ``1.5 KiB``, ``3.2 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def _from_peers(r: RoundReport) -> str:
    """``--swarm``: the part of the aggregates the peers got from each other."""
    return f" (+{fmt_bytes(r.swarm_bytes)} from peers)" if r.swarm_bytes else ""


class ProgressUi:
    """Rich progress: one bar over the rounds, with the current round's figures."""

    def __init__(
        self, console: Console, rounds: int, unit: str = "rounds", *, dedup: bool = True
    ) -> None:
        self.console = console
        saved = (TextColumn("dedup saved {task.fields[saved]}"),) if dedup else ()
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total} " + unit),
            TextColumn("peers {task.fields[done]}"),
            TextColumn("acc {task.fields[acc]}"),
            TextColumn("sent {task.fields[sent]}"),
            *saved,
            TimeElapsedColumn(),
            console=console,
            transient=True,
        )
        self.task = self.progress.add_task(
            "training", total=rounds, done="-", acc="-", sent="-", saved="-"
        )

    def update(self, **fields: Any) -> None:
        self.progress.update(self.task, **fields)

    def round_done(self, r: RoundReport, total_rounds: int) -> None:
        self.progress.advance(self.task)
        mark = "[green]✓[/green]" if r.ok else "[red]✗[/red]"
        self.console.print(
            f"{mark} round {r.round:>2}/{total_rounds}  acc {r.accuracy:.3f}  "
            f"peers {r.contributors}/{r.expected}  sent {fmt_bytes(r.sent_bytes)}  "
            f"fetched {fmt_bytes(r.pulled_bytes)}{_from_peers(r)}  "
            f"dedup saved {fmt_bytes(r.saved_bytes)}  "
            f"{r.seconds:.1f}s  {r.outcome}"
        )

    def version_done(self, v: Any, total: int, *, mode: str) -> None:
        """A federated run's new version (a `demo.run_driver.VersionReport`)."""
        self.progress.advance(self.task)
        self.update(acc=f"{v.accuracy:.3f}")
        who = ", ".join(
            f"{p}(+{s})" if s else p
            for p, s in zip(v.participants, v.staleness or [0] * len(v.participants), strict=False)
        )
        if v.hidden is not None:
            who = f"{v.hidden} peers (names hidden)"
        eps = "" if v.epsilon is None else f"  ε {v.epsilon:.2f}"
        self.console.print(
            f"[green]✓[/green] version {v.version:>2}/{total}  acc {v.accuracy:.3f}  "
            f"{v.elapsed_s:6.1f}s{eps}  {'buffer' if mode == 'async' else 'round'} {v.round}: "
            f"{who}" + (f"  ({v.killed} killed)" if v.killed else "")
        )

    def note(self, text: str) -> None:
        self.console.print(text)


def finish_with(
    cfg: DemoConfig,
    report: DemoReport,
    console: Console,
    plot_with: Callable[[DemoReport, Path], None],
    table_with: Callable[[DemoConfig, DemoReport, Console], None],
) -> DemoReport:
    """Write demo.png (``plot_with``) and summary.json into ``cfg.out``, print the table and
    the totals (``table_with``), then where both went."""
    plot, summary = cfg.out / "demo.png", cfg.out / "summary.json"
    report.plot, report.summary = str(plot), str(summary)
    plot_with(report, plot)
    summary.write_text(json.dumps(report.to_json(), indent=2) + "\n")
    table_with(cfg, report, console)
    console.print(f"plot: {plot}")
    console.print(f"summary: {summary}")
    return report


def finish(cfg: DemoConfig, report: DemoReport, console: Console) -> DemoReport:
    """Write demo.png and summary.json into ``cfg.out``, print the table and the totals."""
    if report.versions:
        from tensorswap.demo.run_output import plot_runs, run_table

        return finish_with(cfg, report, console, lambda r, p: plot_runs([r], p), run_table)
    return finish_with(cfg, report, console, plot_report, _round_table)


def _round_table(cfg: DemoConfig, report: DemoReport, console: Console) -> None:
    table = Table(title=f"tensorswap demo: {cfg.peers} peers, {cfg.topology}, {cfg.aggregator}")
    table.add_column("round", justify="right")
    table.add_column("peers", justify="right")
    table.add_column("accuracy", justify="right")
    table.add_column("sent", justify="right")
    if cfg.compression != "none":
        table.add_column("dense", justify="right")
    table.add_column("fetched", justify="right")
    table.add_column("dedup saved", justify="right")
    table.add_column("s", justify="right")
    table.add_column("outcome")
    for r in report.rounds:
        row = [
            str(r.round),
            f"{r.contributors}/{r.expected}",
            f"{r.accuracy:.3f}",
            fmt_bytes(r.sent_bytes),
        ]
        if cfg.compression != "none":
            row.append(fmt_bytes(r.dense_bytes))
        row += [
            fmt_bytes(r.pulled_bytes),
            fmt_bytes(r.saved_bytes),
            f"{r.seconds:.1f}",
            (f"{r.killed} killed; " if r.killed else "") + r.how,
        ]
        table.add_row(*row)
    console.print(table)
    sent = sum(r.sent_bytes for r in report.rounds)
    saved = sum(r.saved_bytes for r in report.rounds)
    console.print(
        f"test accuracy {report.initial_accuracy:.3f} -> [bold]{report.final_accuracy:.3f}"
        f"[/bold] in {len(report.rounds)} rounds, {report.seconds:.1f}s; "
        f"sent {fmt_bytes(sent)}, dedup saved {fmt_bytes(saved)}"
    )


def plot_report(report: DemoReport, path: Path) -> None:
    """Accuracy and bytes per round as a PNG (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rounds = [r.round for r in report.rounds]
    fig, (ax_acc, ax_bytes) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    try:
        ax_acc.plot(
            [0, *rounds],
            [report.initial_accuracy, *(r.accuracy for r in report.rounds)],
            marker="o",
            label="global model (mean over peers)",
        )
        ax_acc.set_ylabel("test accuracy")
        ax_acc.set_ylim(0, 1)
        ax_acc.grid(alpha=0.3)
        width = 0.4
        kib = 1024.0
        ax_bytes.bar(
            [x - width / 2 for x in rounds],
            [r.sent_bytes / kib for r in report.rounds],
            width,
            label="sent by peers",
        )
        ax_bytes.bar(
            [x + width / 2 for x in rounds],
            [r.saved_bytes / kib for r in report.rounds],
            width,
            label="saved by dedup",
        )
        if any(r.pulled_bytes for r in report.rounds):
            ax_bytes.plot(
                rounds,
                [r.pulled_bytes / kib for r in report.rounds],
                marker="s",
                color="gray",
                label="fetched by peers",
            )
        ax_bytes.set_ylabel("KiB per round")
        ax_bytes.set_xlabel("round")
        ax_bytes.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax_bytes.grid(alpha=0.3)
        for r in report.rounds:
            if r.killed:
                for ax in (ax_acc, ax_bytes):
                    ax.axvline(r.round, color="red", linestyle="--", alpha=0.6)
                ax_acc.annotate(
                    f" {r.killed} killed", (r.round, 0.97), color="red", ha="left", va="top"
                )
        ax_acc.legend(loc="lower right")
        # headroom above the bars, so the legend never covers the last rounds
        low, high = ax_bytes.get_ylim()
        ax_bytes.set_ylim(low, high * 1.3)
        ax_bytes.legend(loc="upper center", ncol=3, frameon=False)
        cfg = report.config
        fig.suptitle(
            f"tensorswap demo: {cfg['peers']} peers, {cfg['topology']}, {cfg['aggregator']}, "
            f"compression {cfg['compression']}"
        )
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
