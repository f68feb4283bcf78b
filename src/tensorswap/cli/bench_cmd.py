"""`tensorswap bench`: run the benchmark suites (`benchmarks/bench_*.py`), one table of ratios.

The suites live in the source tree, not in the installed package: the command looks for
``benchmarks/`` next to ``src/`` (or where ``--dir`` says) and says so when it is absent. Each
suite runs in its own process (``python -m benchmarks [--quick] NAME``); its ratios are read
from its output:

- a machine-readable line ``RATIO <name> <value> [<op> <goal>]`` (op ``>=`` or ``<=``), see
  ``benchmarks/__main__.py``, wins when a suite prints any;
- otherwise every line that states a ratio (``1.23x``) together with a goal, the word
  "ratio", an ``A / B`` comparison or ``Nx the <baseline>``, e.g.
  ``FedAvg ratio vs naive: 1.18x (goal >= 2.0x)``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

import tensorswap
from tensorswap.cli._util import SECONDS

__all__ = ["Ratio", "bench", "find_benchmarks", "parse_ratios"]

_NUMBER = r"(\d+(?:,\d{3})*(?:\.\d+)?)"
_VALUE = re.compile(_NUMBER + r"x\b")
_GOAL_AFTER = re.compile(r"goal\s*(>=|<=|>|<)\s*" + _NUMBER + r"x?")
_GOAL_BEFORE = re.compile(r"(>=|<=|>|<)\s*" + _NUMBER + r"x?\s+goal")
_OF_BASELINE = re.compile(r"\dx the \w")  # "5.79x the copy time"
_EXPLICIT = re.compile(r"^RATIO\s+(\S+)\s+(\S+)(?:\s+(>=|<=)\s+(\S+))?\s*$")


@dataclass(frozen=True)
class Ratio:
    """One ratio a suite reported, with its goal when it states one."""

    suite: str
    name: str
    value: float
    op: str | None = None
    goal: float | None = None

    @property
    def met(self) -> bool | None:
        if self.op is None or self.goal is None:
            return None
        return self.value >= self.goal if ">" in self.op else self.value <= self.goal


def _num(text: str) -> float:
    return float(text.replace(",", ""))


def _clean(name: str) -> str:
    name = " ".join(name.split())
    name = re.sub(r"[\s:=(\->]+$", "", name)
    return name[:60] or "ratio"


def parse_ratios(suite: str, output: str) -> list[Ratio]:
    """The ratios in one suite's output (see the module docstring for what counts)."""
    explicit = []
    for line in output.splitlines():
        if m := _EXPLICIT.match(line.strip()):
            name, value, op, goal = m.groups()
            try:
                explicit.append(
                    Ratio(suite, name, _num(value), op, None if goal is None else _num(goal))
                )
            except ValueError:
                continue
    if explicit:
        return explicit
    found = []
    for line in output.splitlines():
        goal = _GOAL_AFTER.search(line) or _GOAL_BEFORE.search(line)
        rest = (
            line if goal is None else line[: goal.start()] + " " * len(goal[0]) + line[goal.end() :]
        )
        value = _VALUE.search(rest)
        if value is None:
            continue
        stated = "ratio" in line.lower() or " / " in line or _OF_BASELINE.search(line)
        if goal is None and not stated:
            continue
        name = _clean(line[: value.start()])
        if "baseline)" in name:
            continue  # the baseline itself (1.00x)
        if goal is None and (of := _OF_BASELINE.search(line)):
            name = _clean(re.sub(r"\s[\d.]+ [KMG]?B/s$", "", name))
            name = f"{name} / {_clean(line[of.end() - 1 :])}"
        op, target = (goal.group(1), _num(goal.group(2))) if goal else (None, None)
        found.append(Ratio(suite, name, _num(value.group(1)), op, target))
    return found


def find_benchmarks(directory: Path | None = None) -> Path | None:
    """The ``benchmarks`` folder of the source tree this tensorswap runs from, if any."""
    if directory is not None:
        return directory if (directory / "__main__.py").is_file() else None
    root = Path(tensorswap.__file__).resolve().parents[2]
    candidate = root / "benchmarks"
    return candidate if (candidate / "__main__.py").is_file() else None


def _suites(directory: Path) -> list[str]:
    return sorted(p.stem.removeprefix("bench_") for p in directory.glob("bench_*.py"))


def _benchmarks_folder(directory: Path | None) -> Path:
    """The benchmarks folder to run (``--dir``, else the source tree's); a usage error
    without one."""
    found = find_benchmarks(directory)
    if found is None and directory is not None:
        raise click.ClickException(
            f"{directory} is not a benchmarks folder (it has no __main__.py): `tensorswap "
            "bench` needs the source tree's benchmarks/ folder."
        )
    if found is None:
        raise click.ClickException(
            "no benchmarks folder: `tensorswap bench` needs the source tree (benchmarks/ next "
            "to src/); this tensorswap is installed without it. Clone the repository and run "
            "it there, or pass --dir."
        )
    return found


def _run_suite(
    found: Path, name: str, quick: bool, timeout: float, env: dict[str, str], console: Console
) -> tuple[str, int]:
    """Run suite ``name`` in a process of its own: its output and exit status (-1: timed
    out)."""
    cmd = [sys.executable, "-m", found.name, *(["--quick"] if quick else []), name]
    with console.status(f"running {name}..."):
        try:
            proc = subprocess.run(
                cmd,
                cwd=found.parent,
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
            output, rc = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout or ""
            output = out.decode(errors="replace") if isinstance(out, bytes) else out
            rc = -1
            output += f"\n(timed out after {timeout:g}s)"
    return output, rc


def _print_table(
    console: Console,
    ratios: list[Ratio],
    suites: int,
    timings: dict[str, float],
    bad: list[str],
    quick: bool,
) -> None:
    """The table of ratios and the line under it: goals met, and the suites in ``bad``
    (failed, or reporting a missed goal)."""
    table = Table(title="tensorswap benchmarks" + (" (--quick)" if quick else ""))
    table.add_column("suite")
    table.add_column("ratio")
    table.add_column("value", justify="right")
    table.add_column("goal", justify="right")
    table.add_column("", justify="center")
    for r in ratios:
        verdict = {True: "[green]met[/green]", False: "[red]missed[/red]", None: ""}[r.met]
        goal = f"{r.op} {r.goal:g}x" if r.op is not None and r.goal is not None else ""
        table.add_row(r.suite, r.name, f"{r.value:.2f}x", goal, verdict)
    console.print(table)
    total = sum(timings.values())
    judged = [r for r in ratios if r.met is not None]
    met = sum(1 for r in judged if r.met)
    console.print(
        f"{suites} suite(s) in {total:.0f}s; goals met: {met} of {len(judged)}; "
        f"suites that failed or report a missed goal: {', '.join(bad) or 'none'}"
    )
    if quick:
        console.print("(--quick: small sizes; several goals are judged at full size only)")


@click.command("bench")
@click.argument("names", nargs=-1)
@click.option("--quick", is_flag=True, help="Small sizes: a smoke run (goals mean little).")
@click.option(
    "--dir",
    "directory",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    default=None,
    help="The benchmarks folder [default: <source tree>/benchmarks].",
)
@click.option(
    "--timeout", type=SECONDS, default=1800.0, show_default=True, help="Seconds per suite."
)
@click.option("--show-output", is_flag=True, help="Also print each suite's own output.")
@click.option("--json", "as_json", is_flag=True, help="Print the ratios as JSON instead.")
def bench(
    names: tuple[str, ...],
    quick: bool,
    directory: Path | None,
    timeout: float,
    show_output: bool,
    as_json: bool,
) -> int:
    """Run the benchmark suites (all, or NAMES) and print one table of their ratios.

    Each ratio compares tensorswap with a baseline measured in the same run; a goal is met
    or missed as the suite states it. Exit status 1 when a suite failed or missed a goal.
    """
    found = _benchmarks_folder(directory)
    available = _suites(found)
    chosen = list(names) or available
    unknown = sorted(set(chosen) - set(available))
    if unknown:
        raise click.BadParameter(f"unknown suite(s) {unknown}; available: {available}")
    console = Console(stderr=as_json)
    env = dict(os.environ)
    src = str(Path(tensorswap.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(found.parent), src, env.get("PYTHONPATH", "")) if p
    )
    ratios: list[Ratio] = []
    failed: list[str] = []
    timings: dict[str, float] = {}
    for name in chosen:
        start = time.perf_counter()
        output, rc = _run_suite(found, name, quick, timeout, env, console)
        timings[name] = time.perf_counter() - start
        if show_output:
            console.print(f"[bold]=== {name}[/bold]")
            console.print(output, markup=False, highlight=False)
        got = parse_ratios(name, output)
        ratios.extend(got)
        if rc != 0:
            failed.append(name)
        if rc != 0 and not got:
            tail = " | ".join(output.strip().splitlines()[-3:])
            console.print(f"[red]{name} failed (exit {rc})[/red]: {tail}")
    # a suite that ran but reports a goal it missed counts as much as one that failed
    missed = sorted({r.suite for r in ratios if r.met is False} - set(failed))
    if as_json:
        payload = {
            "quick": quick,
            "ratios": [{**asdict(r), "met": r.met} for r in ratios],
            "failed": failed,
            "missed": missed,
            "seconds": timings,
        }
        click.echo(json.dumps(payload, indent=2))
    else:
        _print_table(console, ratios, len(chosen), timings, failed + missed, quick)
    return 1 if failed or missed else 0
