"""`tensorswap serve --upstream HOST:PORT`: the options of a regional coordinator."""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import click

from tensorswap.cli._util import SECONDS, client_tls, parse_host_port, read_key
from tensorswap.region import Backoff, RegionalTier, UpstreamLink
from tensorswap.rounds.protocol import MAX_NAME_BYTES
from tensorswap.wire.connection import Timeouts

__all__ = ["RegionArgs", "open_tier", "region_args", "region_options"]

F = TypeVar("F", bound=Callable[..., Any])


def region_options(command: F) -> F:
    """The regional options of ``serve``, applied to ``command``."""
    options = [
        click.option(
            "--upstream",
            metavar="HOST:PORT",
            help="Run as a regional coordinator: peers submit here, and each round's partial "
            "aggregate goes to the coordinator at HOST:PORT as one contribution; peers get the "
            "global result. Runs live on the top coordinator, not here.",
        ),
        click.option(
            "--region",
            metavar="NAME",
            help="This region's peer name upstream (default: the host name); unique per region.",
        ),
        click.option(
            "--upstream-key-file",
            type=click.Path(exists=True, dir_okay=False),
            help="The upstream's shared secret (default: this server's own key).",
        ),
        click.option(
            "--upstream-peer-key-file",
            type=click.Path(exists=True, dir_okay=False),
            help="Where the upstream holds per-peer keys (its --peer-keys): a file in that "
            "format ('<peer> <hex key>' lines) with this region's line; the region proves "
            "its contributions upstream with that key.",
        ),
        click.option(
            "--upstream-tls-ca",
            type=click.Path(exists=True, dir_okay=False),
            help="Connect upstream over TLS, trusting this CA bundle.",
        ),
        click.option(
            "--upstream-patience",
            type=SECONDS,
            default=900.0,
            show_default=True,
            metavar="SECONDS",
            help="How long one upstream step keeps retrying (reconnecting with backoff) "
            "before the regional round fails.",
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


@dataclass(frozen=True, slots=True)
class RegionArgs:
    """Where and as whom a regional coordinator reaches its upstream."""

    host: str
    port: int
    name: str
    key: bytes | None
    tls_ca: str | None
    patience: float
    peer_key: bytes | None = None


def region_args(
    upstream: str | None,
    region: str | None,
    upstream_key_file: str | None,
    upstream_tls_ca: str | None,
    upstream_patience: float,
    own_key: bytes | None,
    upstream_peer_key_file: str | None = None,
) -> RegionArgs | None:
    """The regional options checked (None without ``--upstream``)."""
    if upstream is None:
        if region or upstream_key_file or upstream_tls_ca or upstream_peer_key_file:
            raise click.UsageError("--region and the --upstream-* options need --upstream")
        return None
    try:
        host, port = parse_host_port(upstream)
    except click.BadParameter as exc:
        exc.param_hint = "'--upstream'"
        raise
    if port == 0:
        raise click.BadParameter("the upstream needs a port", param_hint="'--upstream'")
    name = socket.gethostname() if region is None else region.strip()
    if not name or len(name.encode()) > MAX_NAME_BYTES:
        why = "empty" if not name else f"longer than {MAX_NAME_BYTES} bytes"
        raise click.BadParameter(f"the region name is {why}", param_hint="'--region'")
    key = read_key(upstream_key_file) if upstream_key_file else own_key
    peer_key = None if upstream_peer_key_file is None else _peer_key(upstream_peer_key_file, name)
    return RegionArgs(host, port, name, key, upstream_tls_ca, upstream_patience, peer_key)


def _peer_key(path: str, name: str) -> bytes:
    """The region's own line of a per-peer keys file (``PeerKeys`` format)."""
    from tensorswap.rounds.protocol import PeerKeys

    hint = "'--upstream-peer-key-file'"
    try:
        keys = PeerKeys.load(path)
    except (ValueError, OSError) as exc:
        raise click.BadParameter(str(exc), param_hint=hint) from None
    try:
        return keys[name]
    except KeyError:
        raise click.BadParameter(
            f"{path} has no key for region {name!r}", param_hint=hint
        ) from None


def open_tier(
    data: str, args: RegionArgs, timeouts: Timeouts, durable: bool, **kwargs: object
) -> RegionalTier:
    """The regional tier over DATA (kwargs go to ``Coordinator.open``)."""
    link = UpstreamLink(
        args.host,
        args.port,
        region=args.name,
        key=args.key,
        peer_key=args.peer_key,
        ssl=client_tls(args.tls_ca) if args.tls_ca else None,
        timeouts=timeouts,
        backoff=Backoff(first=0.1, give_up_after=args.patience),
    )
    return RegionalTier.open(data, link, durable=durable, **kwargs)
