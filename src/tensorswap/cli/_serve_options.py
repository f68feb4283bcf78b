"""The options of `tensorswap serve`, grouped by concern."""

from __future__ import annotations

import click

from tensorswap._eventloop import EventLoop
from tensorswap.cli._util import BYTES, SECONDS, FiniteFloatRange, option_group
from tensorswap.rounds.engine import DEFAULT_GC_GRACE
from tensorswap.runs.registry import DEFAULT_INACTIVE_AFTER
from tensorswap.transport import DEFAULT_MAX_CONNECTIONS

__all__ = [
    "JOURNAL_OPTIONS",
    "LIMIT_OPTIONS",
    "LISTEN_OPTIONS",
    "PEER_OPTIONS",
    "PROCESS_OPTIONS",
]

# Where the server listens, its data, and who may connect.
LISTEN_OPTIONS = option_group(
    click.option(
        "--listen", required=True, metavar="HOST:PORT", help="Where to listen (port 0: any)."
    ),
    click.option(
        "--data",
        required=True,
        type=click.Path(file_okay=False),
        help="Directory for the round database and the block store (created if absent).",
    ),
    click.option("--key", help="Shared secret clients must prove (HMAC-SHA256)."),
    click.option(
        "--key-file",
        type=click.Path(exists=True, dir_okay=False),
        help="Read the shared secret from a file (default: the key itself in "
        "$TENSORSWAP_KEY, if set).",
    ),
    click.option(
        "--tls-cert", type=click.Path(exists=True, dir_okay=False), help="TLS certificate."
    ),
    click.option(
        "--tls-key", type=click.Path(exists=True, dir_okay=False), help="TLS private key."
    ),
    click.option(
        "--timeout", type=SECONDS, default=60.0, show_default=True, help="Seconds per frame."
    ),
)


# How the journal commits, and what it keeps.
JOURNAL_OPTIONS = option_group(
    click.option(
        "--fast-commit",
        is_flag=True,
        help="SQLite synchronous=NORMAL: survives a crash of the server, maybe not of the machine.",
    ),
    click.option(
        "--keep-rounds",
        type=click.IntRange(min=1),
        default=None,
        metavar="N",
        help="After each round ends, forget finished rounds older than the newest N round numbers "
        "and delete the blocks no remaining round references (default: keep everything).",
    ),
    click.option(
        "--gc-grace",
        type=FiniteFloatRange(min=0),
        default=DEFAULT_GC_GRACE,
        show_default=True,
        metavar="SECONDS",
        help="Spare unreferenced blocks stored or offered this recently (pushes still to be "
        "submitted).",
    ),
    click.option(
        "--max-wait",
        type=SECONDS,
        default=300.0,
        show_default=True,
        metavar="SECONDS",
        help="Longest a client's wait call is held open; clients ask again, so waits still last "
        "as long as asked.",
    ),
    click.option(
        "--max-connections",
        type=click.IntRange(min=1),
        default=DEFAULT_MAX_CONNECTIONS,
        show_default=True,
        metavar="N",
        help="Clients served at once (each holds a file descriptor); at the cap a newcomer closes "
        "the connection idle the longest (1 s or more), else it is refused with ERROR busy.",
    ),
    click.option(
        "--reset",
        is_flag=True,
        help="Start a fresh round journal over the existing block store: the old "
        "DATA/rounds.sqlite3 (if any) is kept as DATA/rounds.sqlite3.reset-<UTC time> and its "
        "rounds are forgotten. Without it, serve refuses to start over a damaged journal, or a "
        "missing or empty one while DATA/blocks holds blocks.",
    ),
)


# Memory in flight, and when a registered peer counts as gone.
LIMIT_OPTIONS = option_group(
    click.option(
        "--max-inflight-bytes",
        type=BYTES,
        default="1GiB",
        show_default=True,
        metavar="SIZE",
        help="Memory all connections together may hold in received blocks not yet stored "
        "(compressed blocks count at their decompressed size, before decompressing). A client "
        "whose next block does not fit waits (the server stops reading it); a block larger than "
        "the whole budget is refused (error over_budget). Bytes, or with a unit: 512MiB, 2GiB.",
    ),
    click.option(
        "--inactive-after",
        type=SECONDS,
        default=DEFAULT_INACTIVE_AFTER,
        show_default=True,
        metavar="S",
        help="Seconds without a heartbeat (or any request) after which a peer registered for "
        "runs counts as inactive and is no longer sampled.",
    ),
)


# Peer keys, block durability, group commit, result chunks and sample claims.
PEER_OPTIONS = option_group(
    click.option(
        "--peer-keys",
        type=click.Path(exists=True, dir_okay=False),
        help="File of '<peer> <hex key>' lines: every contribution must then prove its peer's own "
        "key (submit_batch proofs, see docs/scale.md); plain submits are refused.",
    ),
    click.option(
        "--operator-key-file",
        type=click.Path(exists=True, dir_okay=False),
        help="A second secret, for the operator: a client proving it instead of the shared key "
        "is shown what peers are not, such as the names in a DP run's sample (docs/privacy.md).",
    ),
    click.option(
        "--sync-blocks",
        is_flag=True,
        help="Flush received blocks to disk (syncfs) before each journal commit that names them, "
        "so an accepted contribution's blocks survive a power loss too (once per group commit).",
    ),
    click.option(
        "--no-group-commit",
        is_flag=True,
        help="Journal each contribution in a transaction of its own (the behaviour before group "
        "commit; for comparison).",
    ),
    click.option(
        "--result-chunk",
        type=BYTES,
        default="4MiB",
        show_default=True,
        metavar="SIZE",
        help="Chunk size of the rounds' aggregates (each tensor cut every SIZE bytes): smaller "
        "chunks let more peers trade a result among themselves (swarm); 4 KiB to 64 MiB.",
    ),
    click.option(
        "--max-samples-per-peer",
        type=click.IntRange(min=1),
        default=None,
        metavar="N",
        help="Refuse a contribution that claims more than N samples (its update's num_samples, "
        "its FedAvg weight: the peer's own word) with TooManySamples; a run's "
        "--max-samples-per-peer can be tighter (default: any claim).",
    ),
)


# The process: its event loop and its log level.
PROCESS_OPTIONS = option_group(
    click.option(
        "--event-loop",
        type=click.Choice([c.value for c in EventLoop]),
        default=EventLoop.ASYNCIO.value,
        show_default=True,
        help="The event loop: asyncio's own, uvloop (the tensorswap[fast] extra; it measured "
        "within the noise of asyncio's CPU per request, docs/scale.md), or auto (uvloop when "
        "installed).",
    ),
    click.option(
        "--log-level",
        type=click.Choice(["debug", "info", "warning", "error"]),
        default="info",
        show_default=True,
    ),
)
