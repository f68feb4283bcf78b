"""The driver's side of ``tensorswap demo --topology diloco``: DiLoCo across peer processes.

`demo.driver` starts `tensorswap serve` on 127.0.0.1 (the collective's rendezvous, the star
topology's coordinator) and the peers (`demo.peer_diloco`), then hands over to `run_diloco`:
it tells every peer once to join the collective group of this run and take ``--rounds``
outer steps of ``--inner-steps`` inner steps each, and reads their ``outer`` reports. When
every peer still in the run has reported an outer step, that step is recorded
(`OuterStepReport`: the test accuracy, the bytes each peer sent in the step's all-reduce, the
slowest peer's seconds) and printed. At the end `finish_diloco` writes ``summary.json`` (one
entry per outer step under ``outer_steps``) and the plot of accuracy against the bytes sent
(`plot_diloco`), and prints `diloco_table`.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from tensorswap.demo.config import DEFAULT_INNER_STEPS, DemoConfig, DemoError
from tensorswap.demo.fleet import Fleet
from tensorswap.demo.output import ProgressUi, finish_with, fmt_bytes
from tensorswap.demo.report import DemoReport

__all__ = [
    "OuterStepReport",
    "diloco_table",
    "finish_diloco",
    "label_of",
    "outer_step_report",
    "plot_diloco",
    "run_diloco",
]

STEP_TIMEOUT_S = 180.0
"""How long the driver waits for any peer's next report (the first includes the join)."""


@dataclass
class OuterStepReport:
    """One outer step as the driver saw it (an entry of ``summary.json``'s ``outer_steps``)."""

    outer_step: int
    accuracy: float
    """Test accuracy, the mean over the peers (the same model on each after a sync)."""
    bytes_sent: dict[str, int]
    """Per peer, the bytes it sent in this step's all-reduce."""
    seconds: float
    """The slowest peer's inner steps and sync."""
    elapsed_s: float = 0.0
    """Since the driver told the peers to start."""
    min_accuracy: float = 0.0
    loss: float = 0.0
    """The inner steps' mean training loss, the mean over the peers."""
    bytes_received: dict[str, int] = field(default_factory=dict)
    compression_error: float = 0.0
    """The largest relative L2 error the lossy codec left in a peer's input (0: none)."""
    sync_s: float = 0.0
    """The slowest peer's all-reduce and outer step."""
    members: list[str] = field(default_factory=list)

    @property
    def total_sent(self) -> int:
        return sum(self.bytes_sent.values())


def outer_step_report(
    number: int, events: Sequence[dict[str, Any]], elapsed: float
) -> OuterStepReport:
    """The record of outer step ``number`` from the peers' ``outer`` events."""
    accs = [float(e["accuracy"]) for e in events]
    return OuterStepReport(
        outer_step=number,
        accuracy=sum(accs) / len(accs),
        bytes_sent={str(e["peer"]): int(e["bytes_sent"]) for e in events},
        seconds=max(float(e["seconds"]) for e in events),
        elapsed_s=elapsed,
        min_accuracy=min(accs),
        loss=sum(float(e["loss"]) for e in events) / len(events),
        bytes_received={str(e["peer"]): int(e["bytes_received"]) for e in events},
        compression_error=max(float(e["compression_error"]) for e in events),
        sync_s=max(float(e["sync_s"]) for e in events),
        members=min((list(e["members"]) for e in events), key=len),
    )


async def run_diloco(cfg: DemoConfig, fleet: Fleet, console: Console, report: DemoReport) -> None:
    """Start the DiLoCo run of ``fleet``'s peers (all ready) and record its outer steps in
    ``report``. DemoError when no peer is left, or none reports for `STEP_TIMEOUT_S`."""
    group = f"demo-{secrets.token_hex(3)}"  # the collective group's name, new each run
    command = {"cmd": "diloco", "group": group, "outer_steps": cfg.rounds}
    ui = ProgressUi(console, cfg.rounds, unit="outer steps", dedup=False)
    start = time.perf_counter()
    for peer in fleet.peers:
        await fleet.send(peer, command)
    pending: dict[int, dict[int, dict[str, Any]]] = {}  # outer step -> peer index -> event
    with ui.progress:
        while len(report.outer_steps) < cfg.rounds:
            number = len(report.outer_steps) + 1
            ui.progress.update(ui.task, description=f"outer step {number}")
            index, event = await _next_event(fleet, number)
            kind = event.get("event")
            if kind == "outer":
                pending.setdefault(int(event["outer_step"]), {})[index] = event
            elif kind in ("exit", "error") and fleet.peers[index].alive:
                fleet.peers[index].alive = False
                why = event.get("message") or "exited"
                ui.note(f"[yellow]peer-{index} left during outer step {number}: {why}[/yellow]")
            alive = {p.index for p in fleet.peers if p.alive}
            if not alive:
                raise DemoError(f"outer step {number}: no peer left (see the peers' logs)")
            got = pending.get(number, {})
            ui.update(done=f"{len(alive & set(got))}/{len(alive)}")
            if alive <= set(got):
                events = [got[i] for i in sorted(got)]
                step = outer_step_report(number, events, time.perf_counter() - start)
                report.outer_steps.append(step)
                del pending[number]
                _step_done(ui, step, cfg.rounds)


async def _next_event(fleet: Fleet, number: int) -> tuple[int, dict[str, Any]]:
    try:
        return await asyncio.wait_for(fleet.events.get(), STEP_TIMEOUT_S)
    except TimeoutError:
        raise DemoError(
            f"outer step {number}: no report from any peer in {STEP_TIMEOUT_S:.0f}s"
        ) from None


def _step_done(ui: ProgressUi, step: OuterStepReport, total: int) -> None:
    ui.progress.advance(ui.task)
    ui.update(acc=f"{step.accuracy:.3f}", sent=fmt_bytes(step.total_sent))
    each = fmt_bytes(step.total_sent / max(len(step.bytes_sent), 1))
    ui.note(
        f"[green]✓[/green] outer step {step.outer_step:>2}/{total}  acc {step.accuracy:.3f}  "
        f"loss {step.loss:.3f}  sent {fmt_bytes(step.total_sent)} ({each} a peer)  "
        f"{step.seconds:.1f}s (sync {step.sync_s:.2f}s)  {len(step.members)} members"
    )


# ── what it shows and writes ─────────────────────────────────────────────────
def finish_diloco(cfg: DemoConfig, report: DemoReport, console: Console) -> DemoReport:
    """Write the plot (`plot_diloco`) and summary.json into ``cfg.out``, print the table."""
    return finish_with(cfg, report, console, lambda r, p: plot_diloco([r], p), diloco_table)


def label_of(report: DemoReport) -> str:
    """``DiLoCo, 4 peers, H=20, compression int8``."""
    cfg = report.config
    inner = cfg.get("inner_steps") or DEFAULT_INNER_STEPS
    return f"DiLoCo, {cfg['peers']} peers, H={inner}, compression {cfg['compression']}"


def diloco_table(cfg: DemoConfig, report: DemoReport, console: Console) -> None:
    """The outer steps as a table, then the totals."""
    table = Table(title=f"tensorswap demo: {label_of(report)}")
    table.add_column("step", justify="right")
    table.add_column("accuracy", justify="right")
    table.add_column("loss", justify="right")
    table.add_column("sent", justify="right")
    table.add_column("total", justify="right")
    if cfg.compression != "none":
        table.add_column("error", justify="right")
    table.add_column("s", justify="right")
    table.add_column("members", justify="right")
    so_far = 0
    for step in report.outer_steps:
        so_far += step.total_sent
        row = [
            str(step.outer_step),
            f"{step.accuracy:.3f}",
            f"{step.loss:.3f}",
            fmt_bytes(step.total_sent),
            fmt_bytes(so_far),
        ]
        if cfg.compression != "none":
            row.append(f"{step.compression_error:.2%}")
        row += [f"{step.seconds:.2f}", str(len(step.members))]
        table.add_row(*row)
    console.print(table)
    console.print(
        f"test accuracy {report.initial_accuracy:.3f} -> [bold]{report.final_accuracy:.3f}"
        f"[/bold] in {len(report.outer_steps)} outer steps of {cfg.diloco_inner_steps} inner "
        f"steps, {report.seconds:.1f}s; sent {fmt_bytes(so_far)} "
        f"({fmt_bytes(so_far / max(cfg.peers, 1))} a peer), compression {cfg.compression}"
    )


def plot_diloco(reports: Sequence[DemoReport], path: Path) -> None:
    """Test accuracy against the bytes the peers have sent so far, one line per report (e.g.
    the same run without and with int8), as a PNG (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    try:
        for report in reports:
            xs, total = [0.0], 0
            for step in report.outer_steps:
                total += step.total_sent
                xs.append(total / 1024.0)
            ys = [report.initial_accuracy, *(s.accuracy for s in report.outer_steps)]
            ax.plot(xs, ys, marker="o", label=label_of(report))
        ax.set_xlabel("KiB sent by all peers so far (one point per outer step)")
        ax.set_ylabel("test accuracy")
        ax.set_ylim(0, 1)
        ax.axhline(0.9, color="gray", linestyle=":", alpha=0.6)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
        ax.set_title("tensorswap demo: DiLoCo over the collective all-reduce")
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
