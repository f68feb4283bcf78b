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
from tensorswap.rounds.core import Aggregating, Complete, Failed, RoundId
from tensorswap.rounds.protocol import MAX_PAGE, PageAnswer, RoundRow, page_peers, page_rounds
from tensorswap.runs.client import RunClient
from tensorswap.runs.messages import RunRow
from tensorswap.wire import ProtocolViolation
from tensorswap.wire.connection import Timeouts

__all__ = ["render", "status", "to_json"]

_PEERS_SHOWN = 6


async def _fetch(
    host: str,
    port: int,
    key: bytes | None,
    ssl: ssl_module.SSLContext | None,
    timeout: float,
    page: tuple[int, int] | None = None,
) -> tuple[ServerStatus, list[RunRow]]:
    timeouts = Timeouts(connect=timeout, handshake=timeout, read=timeout)
    client = await RoundClient.connect(
        host, port, peer="tensorswap-status", key=key, ssl=ssl, timeouts=timeouts
    )
    async with client:
        if page is None:
            report = await client.server_status()
        else:  # one page of rounds, a few peer names each (received counts them all)
            start, limit = page
            got = await page_rounds(client, start, limit, peers=_PEERS_SHOWN, stats=True)
            omitted = got.total - len(got.rounds)
            report = ServerStatus(got.rounds, dict(got.stats), omitted)
        try:
            runs = await RunClient(client).runs()
        except ProtocolViolation:  # a coordinator that runs no federations
            runs = []
        return report, runs


def _round_id(text: str) -> RoundId:
    number, _, initiator = text.partition("-")
    try:
        return RoundId(int(number), initiator)
    except (TypeError, ValueError) as exc:
        raise click.BadParameter(
            f"expected ROUND-INITIATOR (e.g. 3-lead), got {text!r}", param_hint="--peers-of"
        ) from exc


async def _peers(
    host: str,
    port: int,
    key: bytes | None,
    ssl: ssl_module.SSLContext | None,
    timeout: float,
    rid: RoundId,
    start: int,
    limit: int,
) -> PageAnswer:
    timeouts = Timeouts(connect=timeout, handshake=timeout, read=timeout)
    client = await RoundClient.connect(
        host, port, peer="tensorswap-status", key=key, ssl=ssl, timeouts=timeouts
    )
    async with client:
        return await page_peers(client, rid, start, limit)


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
            "hidden": row.hidden,
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
        rest = max(row.received, len(row.peers)) - min(len(row.peers), _PEERS_SHOWN)
        more = f" +{rest}" if rest > 0 else ""
        if row.hidden:  # a DP run's round seen by a peer: counts only
            more = " (names hidden: DP run)"
        table.add_row(
            f"{row.round}-{row.initiator}",
            _status_text(row),
            f"{row.received}/{row.expected} {shown}{more}".rstrip(),
            str(row.quorum),
            row.strategy,
            _size(row.nbytes),
            _deadline(row, now),
        )
    if report.omitted:  # a page, or an answer cut to fit the message limit
        table.caption = f"{report.omitted} other round(s) not shown"
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
@click.option(
    "--limit",
    type=click.IntRange(1, MAX_PAGE),
    default=None,
    help="Page through rounds: show this many (from --start), each with its first few peers.",
)
@click.option("--start", type=click.IntRange(min=0), default=0, help="First round of the page.")
@click.option(
    "--peers-of",
    metavar="ROUND-INITIATOR",
    help="List that round's peers in acceptance order instead (--start, --limit: a page).",
)
def status(
    address: str,
    as_json: bool,
    key: str | None,
    key_file: str | None,
    tls: bool,
    tls_ca: str | None,
    timeout: float,
    limit: int | None,
    start: int,
    peers_of: str | None,
) -> None:
    """Show the coordinator at HOST:PORT: its runs (version, global model, optimizer,
    participants), its rounds (status, peers, contributions, bytes) and counters.

    With --limit, one page of rounds (a large coordinator answers in well under a second);
    with --peers-of, one page of a round's peers. A DP run's rounds list counts, not
    names, except to the operator key (`serve --operator-key-file`, given as --key-file)."""
    host, port = parse_host_port(address)
    secret = resolve_key(key, key_file)
    ssl = client_tls(tls_ca) if tls or tls_ca else None
    if peers_of is not None:
        rid = _round_id(peers_of)
        page = asyncio.run(_peers(host, port, secret, ssl, timeout, rid, start, limit or 1000))
        if as_json:
            data = {"round": peers_of, "peers": page.peers, "total": page.total}
            click.echo(json.dumps({**data, "next": page.next}, indent=2, sort_keys=True))
        else:
            for name in page.peers:
                click.echo(name)
            more = f"; next page: --start {page.next}" if page.next is not None else ""
            click.echo(f"# {len(page.peers)} of {page.total} peer(s) from {start}{more}", err=True)
        return
    paged = None if limit is None else (start, limit)
    report, runs = asyncio.run(_fetch(host, port, secret, ssl, timeout, paged))
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
