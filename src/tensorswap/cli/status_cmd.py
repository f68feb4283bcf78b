"""`tensorswap status`: a coordinator's rounds, peers, contributions and bytes, as a table."""

from __future__ import annotations

import asyncio
import json
import ssl as ssl_module
import time

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tensorswap.cli._util import SECONDS, client_tls, parse_host_port
from tensorswap.cli.run_cmd import render_runs, run_json
from tensorswap.cli.serve_cmd import resolve_key
from tensorswap.rounds.client import RoundClient, ServerStatus
from tensorswap.rounds.protocol import RoundRow
from tensorswap.rounds.state import Aggregating, Complete, Failed
from tensorswap.runs.client import RunClient
from tensorswap.runs.messages import RunRow
from tensorswap.wire import ProtocolViolation
from tensorswap.wire.connection import Timeouts

__all__ = ["render", "status", "to_json"]

_PEERS_SHOWN = 6


async def _fetch(
    host: str, port: int, key: bytes | None, ssl: ssl_module.SSLContext | None, timeout: float
) -> tuple[ServerStatus, list[RunRow]]:
    timeouts = Timeouts(connect=timeout, handshake=timeout, read=timeout)
    client = await RoundClient.connect(
        host, port, peer="tensorswap-status", key=key, ssl=ssl, timeouts=timeouts
    )
    async with client:
        report = await client.server_status()
        try:
            runs = await RunClient(client).runs()
        except ProtocolViolation:  # a coordinator that runs no federations
            runs = []
        return report, runs


def to_json(report: ServerStatus) -> dict[str, object]:
    """The report as plain JSON data: ``{"rounds": [...], "stats": {...}}``."""
    rounds = [
        {
            "round": row.round,
            "initiator": row.initiator,
            "status": row.status.to_dict(),
            "received": row.received,
            "expected": row.expected,
            "quorum": row.quorum,
            "strategy": row.strategy,
            "bytes": row.nbytes,
            "peers": row.peers,
            "created_at": row.created_at,
            "deadline": row.deadline,
            "dropped": [{"peer": peer, "reason": why} for peer, why in row.dropped],
        }
        for row in report.rounds
    ]
    return {"rounds": rounds, "stats": report.stats, "omitted": report.omitted}


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(nbytes) < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} GiB"  # pragma: no cover - the loop always returns


def _status_text(row: RoundRow) -> str:
    status = row.status.to_status()
    if isinstance(status, Complete):
        return f"[green]Complete[/] …{status.cid[-10:]}"
    if isinstance(status, Failed):
        text = f"[red]Failed[/] {escape(status.reason)}"
    elif isinstance(status, Aggregating) and status.reason:
        text = f"[yellow]Aggregating[/] {escape(status.reason)}"
    else:
        text = status.name
    for peer, why in row.dropped:  # contributions left out of the aggregate, and why
        text += f"\n[yellow]dropped[/] {escape(peer)}: {escape(why)}"
    return text


def _deadline(row: RoundRow, now: float) -> str:
    if row.deadline is None or row.status.to_status().is_terminal:
        return "-"
    left = row.deadline - now
    return f"in {left:.0f} s" if left > 0 else "passed"


def render(report: ServerStatus, console: Console, now: float | None = None) -> None:
    """Print the rounds table and the counters table."""
    now = time.time() if now is None else now
    table = Table(title="rounds", title_justify="left")
    for column in ("round", "status", "peers", "quorum", "strategy", "bytes", "deadline"):
        table.add_column(column, justify="right" if column in ("bytes", "quorum") else "left")
    table.columns[0].no_wrap = True
    for row in report.rounds:
        shown = ", ".join(row.peers[:_PEERS_SHOWN])
        more = f" +{len(row.peers) - _PEERS_SHOWN}" if len(row.peers) > _PEERS_SHOWN else ""
        table.add_row(
            f"{row.round}-{row.initiator}",
            _status_text(row),
            f"{row.received}/{row.expected} {shown}{more}".rstrip(),
            str(row.quorum),
            row.strategy,
            _size(row.nbytes),
            _deadline(row, now),
        )
    if report.omitted:  # the answer had to fit the message limit: live and newest rounds first
        table.caption = f"{report.omitted} older round(s) not shown"
    console.print(table)
    stats = report.stats
    counters = Table(title="coordinator", title_justify="left", show_header=False)
    counters.add_column("counter")
    counters.add_column("value", justify="right")
    for name, value in stats.items():
        if isinstance(value, float):
            text = f"{value:.3f}"
        elif "bytes" in name and isinstance(value, int):
            text = _size(value)
        else:
            text = str(value)
        counters.add_row(name.replace("_", " "), text)
    console.print(counters)


@click.command("status")
@click.argument("address", metavar="HOST:PORT")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead.")
@click.option("--key", help="Shared secret (HMAC-SHA256), if the coordinator requires one.")
@click.option(
    "--key-file",
    type=click.Path(exists=True, dir_okay=False),
    help="Read the shared secret from a file (default: the key itself in $TENSORSWAP_KEY, if set).",
)
@click.option("--tls", is_flag=True, help="Use TLS (system CAs unless --tls-ca).")
@click.option("--tls-ca", type=click.Path(exists=True, dir_okay=False), help="CA/cert to trust.")
@click.option("--timeout", type=SECONDS, default=10.0, show_default=True, help="Seconds to wait.")
def status(
    address: str,
    as_json: bool,
    key: str | None,
    key_file: str | None,
    tls: bool,
    tls_ca: str | None,
    timeout: float,
) -> None:
    """Show the coordinator at HOST:PORT: its runs (version, global model, optimizer,
    participants), its rounds (status, peers, contributions, bytes) and counters."""
    host, port = parse_host_port(address)
    secret = resolve_key(key, key_file)
    ssl = client_tls(tls_ca) if tls or tls_ca else None
    report, runs = asyncio.run(_fetch(host, port, secret, ssl, timeout))
    if as_json:
        data = to_json(report)
        data["runs"] = [run_json(row) for row in runs]
        click.echo(json.dumps(data, indent=2, sort_keys=True))
    else:
        console = Console()
        if runs:
            render_runs(runs, console)
        render(report, console)


if __name__ == "__main__":  # `python -m tensorswap.cli.status_cmd` before the group lists it
    status()
