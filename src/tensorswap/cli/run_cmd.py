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

from tensorswap.cli._util import (
    SECONDS,
    client_tls,
    parse_host_port,
    parse_numbers,
    parse_options,
    policy_options,
)
from tensorswap.cli.send_cmd import load_tensors
from tensorswap.cli.serve_cmd import resolve_key
from tensorswap.codec import TensorBlock
from tensorswap.runs.client import RunClient
from tensorswap.runs.errors import InvalidRunSpec
from tensorswap.runs.finite import check_tensors
from tensorswap.runs.messages import RunRow
from tensorswap.runs.model import AUTO, MAX_PEERS_PER_ROUND, RunMode, RunSpec, Staleness
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


class _Timeout(click.ParamType):
    """``--round-timeout``: seconds > 0, or ``auto``."""

    name = "seconds|auto"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and value.strip().lower() == AUTO:
            return AUTO
        try:
            return SECONDS.convert(value, param, ctx)
        except click.BadParameter:
            self.fail(f"{value!r} is neither seconds > 0 nor 'auto'", param, ctx)


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
@click.option(
    "--initial",
    required=True,
    type=click.Path(exists=True, dir_okay=False),
    help="The initial global model: .npz, safetensors, .npy or a tensorswap block.",
)
@click.option(
    "--mode", type=click.Choice([m.value for m in RunMode]), default="sync", show_default=True
)
@click.option(
    "--per-round",
    type=click.IntRange(1, MAX_PEERS_PER_ROUND),
    help="Peers sampled per round (K).",
)
@click.option(
    "--fraction",
    type=click.FloatRange(0, 1, min_open=True),
    help="Or this fraction of the active peers.",
)
@click.option(
    "--min-clients",
    type=click.IntRange(1, MAX_PEERS_PER_ROUND),
    default=1,
    show_default=True,
    help="A round starts once this many peers are active (and samples at least this many).",
)
@click.option(
    "--quorum",
    type=click.FloatRange(0, 1, min_open=True),
    default=1.0,
    show_default=True,
    help="Fraction of the sampled peers a round needs at its deadline.",
)
@click.option(
    "--round-timeout",
    type=_Timeout(),
    help="Each round's deadline in seconds, or 'auto': from the arrivals of earlier rounds"
    " (default: none).",
)
@click.option(
    "--deadline-floor",
    type=SECONDS,
    default=1.0,
    show_default=True,
    help="Auto deadlines: never below this (seconds).",
)
@click.option(
    "--deadline-cap",
    type=SECONDS,
    default=600.0,
    show_default=True,
    help="Auto deadlines: never above this (seconds); the first round's deadline.",
)
@click.option(
    "--deadline-k",
    type=click.FloatRange(min=0),
    default=3.0,
    show_default=True,
    help="Auto deadlines: median + K x MAD of the quorum-th arrival.",
)
@click.option("--rounds", type=click.IntRange(min=1), help="Stop after this many versions.")
@policy_options
@click.option(
    "--seed",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Seeds the sampling of peers (with the round number).",
)
@click.option(
    "--buffer",
    type=click.IntRange(1, MAX_PEERS_PER_ROUND),
    default=4,
    show_default=True,
    help="Async: contributions per new version.",
)
@click.option(
    "--max-staleness",
    type=click.IntRange(min=0),
    default=8,
    show_default=True,
    help="Async: versions a contribution may lag behind.",
)
@click.option(
    "--staleness",
    type=click.Choice([s.value for s in Staleness]),
    default="sqrt",
    show_default=True,
    help="Async: how a stale delta is scaled.",
)
@click.option(
    "--max-samples-per-peer",
    type=click.IntRange(min=1),
    help="Refuse a contribution claiming more samples than this (its FedAvg weight, the "
    "peer's own word: TooManySamples); a region's fold may claim it once per peer it covers.",
)
@click.option(
    "--dp-clip",
    type=click.FloatRange(min=0, min_open=True),
    help="Differential privacy: clip each peer's update to this L2 norm (C); turns DP on.",
)
@click.option(
    "--dp-noise",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="DP: the noise multiplier z (noise std z x C / peers sampled).",
)
@click.option(
    "--dp-delta",
    type=click.FloatRange(0, 1, min_open=True, max_open=True),
    default=1e-5,
    show_default=True,
    help="DP: the delta epsilon is reported at.",
)
@click.option(
    "--dp-max-epsilon",
    type=click.FloatRange(min=0, min_open=True),
    help="DP: stop the run before a round would spend more than this epsilon.",
)
@click.option(
    "--dp-clipping",
    type=click.Choice(["server", "client"]),
    default="server",
    show_default=True,
    help="DP: who clips (client: the coordinator refuses an update above C).",
)
@click.option(
    "--dp-adaptive",
    is_flag=True,
    help="DP: adapt C to a quantile of the update norms (Andrew et al.).",
)
@click.option(
    "--secagg",
    is_flag=True,
    help="Secure aggregation (SecAgg+): the coordinator learns only the sum of the deltas.",
)
@click.option(
    "--secagg-threshold",
    type=click.IntRange(min=2),
    help="SecAgg+: shares needed to unmask a peer (t; default: SecAgg+'s for the sample).",
)
@click.option(
    "--secagg-clip",
    type=click.FloatRange(min=0, min_open=True),
    help="SecAgg+: clip each delta coordinate to [-r, r] (default: --dp-clip, else 1.0).",
)
@click.option(
    "--secagg-bits",
    type=click.IntRange(1, 31),
    help="SecAgg+: bits per coordinate (default: the most the sample size allows).",
)
@click.option(
    "--secagg-phase-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=30.0,
    show_default=True,
    help="SecAgg+: seconds each phase after the first waits for the peers (the masked-input "
    "phase, where peers train, lasts until --round-timeout at least; without one it waits for "
    "every peer).",
)
@click.option(
    "--secagg-min-survivors",
    type=click.IntRange(min=2),
    default=3,
    show_default=True,
    help="SecAgg+: the fewest peers a round's sum is unmasked over (and never fewer than the "
    "threshold); a round with fewer fails. 2 lets each survivor learn the other's delta.",
)
@_with_common
def create(
    address: str,
    name: str,
    initial: str,
    mode: str,
    per_round: int | None,
    fraction: float | None,
    min_clients: int,
    quorum: float,
    round_timeout: float | str | None,
    deadline_floor: float,
    deadline_cap: float,
    deadline_k: float,
    rounds: int | None,
    strategy: str,
    params: tuple[str, ...],
    optimizer: str,
    opts: tuple[str, ...],
    seed: int,
    buffer: int,
    max_staleness: int,
    staleness: str,
    max_samples_per_peer: int | None,
    dp_clip: float | None,
    dp_noise: float,
    dp_delta: float,
    dp_max_epsilon: float | None,
    dp_clipping: str,
    dp_adaptive: bool,
    secagg: bool,
    secagg_threshold: int | None,
    secagg_clip: float | None,
    secagg_bits: int | None,
    secagg_phase_timeout: float,
    secagg_min_survivors: int,
    key: str | None,
    key_file: str | None,
    tls_ca: str | None,
    timeout: float,
) -> None:
    """Create run NAME on the coordinator at HOST:PORT from the model in --initial.

    Registered peers then ask for tasks (RunClient.next_task), train from the global model and
    submit; the coordinator aggregates each round, applies the server optimizer and starts the
    next. Creating the same run again with the same spec and model is a no-op.
    """
    try:
        spec = RunSpec(
            mode=RunMode(mode),
            per_round=per_round,
            fraction=fraction,
            min_clients=min_clients,
            quorum=quorum,
            round_timeout_s=round_timeout,
            deadline_floor_s=deadline_floor,
            deadline_cap_s=deadline_cap,
            deadline_k=deadline_k,
            strategy=strategy,
            params=parse_options(params),
            optimizer=optimizer,
            optimizer_params=parse_numbers(opts),
            seed=seed,
            rounds=rounds,
            buffer=buffer,
            max_staleness=max_staleness,
            staleness=Staleness(staleness),
            max_samples_per_peer=max_samples_per_peer,
            dp_clip=dp_clip,
            dp_noise=dp_noise,
            dp_delta=dp_delta,
            dp_max_epsilon=dp_max_epsilon,
            dp_clipping=dp_clipping,
            dp_adaptive=dp_adaptive,
            secagg=secagg,
            secagg_threshold=secagg_threshold,
            secagg_clip=secagg_clip,
            secagg_bits=secagg_bits,
            secagg_phase_timeout_s=secagg_phase_timeout,
            secagg_min_survivors=secagg_min_survivors,
        )
    except InvalidRunSpec as exc:
        raise click.UsageError(str(exc)) from exc
    loaded = load_tensors(initial)
    update = (
        ModelUpdate({loaded.name: loaded.values}) if isinstance(loaded, TensorBlock) else loaded
    )
    check_tensors(name, update.tensors.items(), "initial model")  # NonFiniteModel: not sent
    host, port, kwargs = _connection(address, key, key_file, tls_ca, timeout)

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
