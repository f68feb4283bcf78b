"""`tensorswap run`: create a federated run on a coordinator, and show its versions."""

from __future__ import annotations

import asyncio
import json
import ssl as ssl_module
from collections.abc import Sequence
from typing import Any

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tensorswap.cli._run_options import (
    ASYNC_OPTIONS,
    DP_OPTIONS,
    ROUND_OPTIONS,
    SECAGG_OPTIONS,
    run_spec,
)
from tensorswap.cli._util import SECONDS, client_tls, parse_host_port, policy_options
from tensorswap.cli.send_cmd import load_tensors
from tensorswap.cli.serve_cmd import resolve_key
from tensorswap.codec import TensorBlock
from tensorswap.runs.client import RunClient
from tensorswap.runs.finite import check_tensors
from tensorswap.runs.messages import RunRow
from tensorswap.store import ModelUpdate
from tensorswap.wire.connection import Timeouts

__all__ = ["render_runs", "run", "run_json"]


def _connection(
    address: str, key: str | None, key_file: str | None, tls_ca: str | None, timeout: float
) -> tuple[str, int, dict[str, object]]:
    host, port = parse_host_port(address)
    ssl: ssl_module.SSLContext | None = client_tls(tls_ca) if tls_ca else None
    timeouts = Timeouts(connect=timeout, handshake=timeout, read=timeout)
    kwargs: dict[str, object] = {
        "key": resolve_key(key, key_file),
        "ssl": ssl,
        "timeouts": timeouts,
    }
    return host, port, kwargs


def run_json(row: RunRow) -> dict[str, object]:
    return {
        "name": row.name,
        "mode": row.mode,
        "version": row.version,
        "global_cid": row.global_cid,
        "state_cid": row.state_cid,
        "round": row.round,
        "selected": row.selected,
        "finished": row.finished,
        "optimizer": row.optimizer,
        "strategy": row.strategy,
        "participants": row.participants,
        "deadline_s": row.deadline_s,
        "deadline_reason": row.deadline_reason or None,
        "epsilon": row.epsilon,
        "dp_delta": row.dp_delta,
        "stop_reason": row.stop_reason,
        "secagg": row.secagg,
        "selected_count": row.selected_count,
        "participant_count": row.participant_count,
        "hidden": row.hidden,
        "you_selected": row.you_selected,
        "you_took_part": row.you_took_part,
    }


def render_runs(rows: Sequence[RunRow], console: Console) -> None:
    """The runs table: version, global model, optimizer, the last version's participants
    (and a DP run's ε so far, at its δ; why it stopped, if its budget ran out)."""
    table = Table(title="runs", title_justify="left")
    private = any(row.epsilon is not None for row in rows)
    columns = ["run", "mode", "version", "round", "global model", "optimizer", "participants"]
    for column in columns + (["epsilon"] if private else []):
        table.add_column(column, justify="right" if column in ("version", "round") else "left")
    for row in rows:
        shown = ", ".join(row.participants[:6]) + (" …" if len(row.participants) > 6 else "")
        if row.hidden:  # a DP run seen by a peer: counts only (runs.views)
            shown = f"{row.participant_count} (names hidden: DP run)"
        state = " (stopped: privacy budget)" if row.stop_reason else " (finished)"
        extra = []
        if private:
            extra = ["-" if row.epsilon is None else f"{row.epsilon:.3g} (δ={row.dp_delta:g})"]
        table.add_row(
            row.name + (" (secagg)" if row.secagg else "") + (state if row.finished else ""),
            row.mode,
            str(row.version),
            str(row.round),
            f"…{row.global_cid[-12:]}",
            row.optimizer,
            shown or "-",
            *extra,
        )
    for row in rows:
        if row.deadline_s is not None:
            console.print(
                f"run {escape(row.name)} round {row.round}: deadline {row.deadline_s:.3g} s"
                f" ({escape(row.deadline_reason)})",
                highlight=False,
            )
    console.print(table)


_address = click.argument("address", metavar="HOST:PORT")
_common = [
    click.option("--key", help="Shared secret (HMAC-SHA256), if the coordinator requires one."),
    click.option(
        "--key-file",
        type=click.Path(exists=True, dir_okay=False),
        help="Read the shared secret from a file (default: $TENSORSWAP_KEY, if set).",
    ),
    click.option(
        "--tls-ca", type=click.Path(exists=True, dir_okay=False), help="CA to trust (TLS)."
    ),
    click.option(
        "--timeout", type=SECONDS, default=30.0, show_default=True, help="Seconds to wait."
    ),
]


def _with_common(f):  # type: ignore[no-untyped-def]
    for option in reversed(_common):
        f = option(f)
    return f


@click.group("run")
def run() -> None:
    """Federated runs on a coordinator: a global model that evolves round after round."""


@run.command("create")
@_address
@click.argument("name")
@ROUND_OPTIONS
@policy_options
@ASYNC_OPTIONS
@DP_OPTIONS
@SECAGG_OPTIONS
@_with_common
def create(address: str, name: str, initial: str, **options: Any) -> None:
    """Create run NAME on the coordinator at HOST:PORT from the model in --initial.

    Registered peers then ask for tasks (RunClient.next_task), train from the global model and
    submit; the coordinator aggregates each round, applies the server optimizer and starts the
    next. Creating the same run again with the same spec and model is a no-op.
    """
    spec = run_spec(options)
    loaded = load_tensors(initial)
    update = (
        ModelUpdate({loaded.name: loaded.values}) if isinstance(loaded, TensorBlock) else loaded
    )
    check_tensors(name, update.tensors.items(), "initial model")  # NonFiniteModel: not sent
    connection = (options[k] for k in ("key", "key_file", "tls_ca", "timeout"))
    host, port, kwargs = _connection(address, *connection)

    async def go() -> RunRow:
        async with await RunClient.connect(host, port, peer="tensorswap-cli", **kwargs) as client:
            return await client.create_run(name, spec, update)

    row = asyncio.run(go())
    click.echo(f"run {row.name}: version {row.version}, global model {row.global_cid}")


@run.command("show")
@_address
@click.argument("name", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@_with_common
def show(
    address: str,
    name: str | None,
    as_json: bool,
    key: str | None,
    key_file: str | None,
    tls_ca: str | None,
    timeout: float,
) -> None:
    """Show the runs on the coordinator at HOST:PORT (or run NAME).

    A DP run's sample is secret: peers are shown counts and their own part only; the
    coordinator's operator key (`serve --operator-key-file`, given here as --key-file)
    shows the names."""
    host, port, kwargs = _connection(address, key, key_file, tls_ca, timeout)

    async def go() -> list[RunRow]:
        async with await RunClient.connect(host, port, peer="tensorswap-cli", **kwargs) as client:
            return [await client.run(name)] if name else await client.runs()

    rows = asyncio.run(go())
    if as_json:
        click.echo(json.dumps([run_json(r) for r in rows], indent=2, sort_keys=True))
    else:
        render_runs(rows, Console())
