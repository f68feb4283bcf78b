"""What a federated demo run shows: its table of versions and accuracy against wall-clock time.

`plot_runs` takes several reports, so sync and async runs of the same task (the benchmark
`benchmarks/bench_async.py` runs both) can be compared on one picture.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tensorswap.demo.config import DemoConfig
from tensorswap.demo.report import DemoReport

__all__ = ["label_of", "plot_runs", "run_table", "time_to_accuracy"]


def label_of(report: DemoReport) -> str:
    """``sync fedadam, 4 of 8 per round`` / ``async fedavg, buffer 2`` (+ the slow peer)."""
    cfg = report.config
    mode = cfg.get("mode") or "sync"
    text = f"{mode} {cfg.get('server_opt') or 'fedavg'}"
    if mode == "async":
        text += f", buffer {cfg.get('buffer') or max(1, int(cfg['peers']) // 2)}"
    else:
        text += f", {cfg.get('sample') or cfg['peers']} of {cfg['peers']} per round"
    if cfg.get("slow_peer") is not None:
        text += f", peer-{cfg['slow_peer']} {cfg.get('slow_factor', 5):g}x slower"
    if cfg.get("dp_clip") is not None:
        text += f", DP z={cfg.get('dp_noise')}"
    if cfg.get("secagg"):
        text += ", SecAgg+"
    return text


def time_to_accuracy(report: DemoReport, target: float) -> float | None:
    """Seconds from the run's start to its first version at ``target`` accuracy or above."""
    for v in report.versions:
        if v.accuracy >= target:
            return float(v.elapsed_s)
    return None


def run_table(cfg: DemoConfig, report: DemoReport, console: Console) -> None:
    """The versions as a table, then the totals."""
    table = Table(title=f"tensorswap demo: {label_of(report)}")
    table.add_column("version", justify="right")
    table.add_column("round", justify="right")
    table.add_column("accuracy", justify="right")
    table.add_column("s", justify="right")
    table.add_column("participants (staleness)")
    private = any(v.epsilon is not None for v in report.versions)
    if private:
        table.add_column("ε", justify="right")
    for v in report.versions:
        stale = v.staleness or [0] * len(v.participants)
        who = ", ".join(f"{p} ({s})" for p, s in zip(v.participants, stale, strict=False))
        if v.hidden is not None:
            who = f"{v.hidden} peers (names hidden: DP run)"
        row = [str(v.version), str(v.round), f"{v.accuracy:.3f}", f"{v.elapsed_s:.1f}", who]
        if v.killed:
            row[-1] += f"; {v.killed} killed"
        if private:
            row.append("-" if v.epsilon is None else f"{v.epsilon:.3f}")
        table.add_row(*row)
    console.print(table)
    run = report.run or {}
    console.print(
        f"test accuracy {report.initial_accuracy:.3f} -> [bold]{report.final_accuracy:.3f}"
        f"[/bold] in {len(report.versions)} versions, {report.seconds:.1f}s; "
        f"{run.get('contributed', 0)} contributions, {run.get('refused', 0)} refused"
    )
    hit = time_to_accuracy(report, 0.9)
    if hit is not None:
        console.print(f"0.90 test accuracy after {hit:.1f}s")


def plot_runs(reports: Sequence[DemoReport], path: Path) -> None:
    """Accuracy against wall-clock seconds for each run (and against ε for DP runs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    private = [r for r in reports if any(v.epsilon is not None for v in r.versions)]
    panels = 2 if private else 1
    fig, axes = plt.subplots(1, panels, figsize=(8 * panels, 5), squeeze=False)
    ax = axes[0][0]
    try:
        for report in reports:
            xs = [0.0, *(v.elapsed_s for v in report.versions)]
            ys = [report.initial_accuracy, *(v.accuracy for v in report.versions)]
            (line,) = ax.plot(xs, ys, marker="o", markersize=3, label=label_of(report))
            for v in report.versions:
                if v.killed:
                    ax.axvline(v.elapsed_s, color=line.get_color(), linestyle="--", alpha=0.5)
        ax.axhline(0.9, color="gray", linestyle=":", alpha=0.7)
        ax.set_xlabel("wall-clock seconds since the run started")
        ax.set_ylabel("test accuracy of the global model")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
        if private:
            ax_eps = axes[0][1]
            for report in private:
                pts = [(v.epsilon, v.accuracy) for v in report.versions if v.epsilon is not None]
                ax_eps.plot(*zip(*pts, strict=True), marker="o", label=label_of(report))
            ax_eps.set_xlabel("ε spent (at the run's δ)")
            ax_eps.set_ylabel("test accuracy")
            ax_eps.set_ylim(0, 1)
            ax_eps.grid(alpha=0.3)
            ax_eps.legend(loc="lower right")
        fig.suptitle("tensorswap demo: federated run")
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
