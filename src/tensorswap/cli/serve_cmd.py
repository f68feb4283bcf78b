"""`tensorswap serve`: run the coordinator (rounds) and the block service on one port."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import signal
import ssl as ssl_module
import sys
import threading
from typing import Any

import click

from tensorswap._collector import settle_heap
from tensorswap._eventloop import EventLoop, UvloopMissing
from tensorswap._eventloop import resolve as resolve_loop
from tensorswap._eventloop import run as run_loop
from tensorswap.cli._region import RegionArgs, open_tier, region_args, region_options
from tensorswap.cli._util import (
    BYTES,
    SECONDS,
    FiniteFloatRange,
    parse_host_port,
    read_key,
    server_tls,
)
from tensorswap.region.gate import RegionGate
from tensorswap.region.identity import coordinator_id
from tensorswap.region.runs_proxy import RunsProxy
from tensorswap.rounds.core import DataDirInUse
from tensorswap.rounds.engine import DEFAULT_GC_GRACE, Coordinator
from tensorswap.rounds.protocol import PeerKeys
from tensorswap.rounds.server import RoundServer
from tensorswap.rounds.storage import DataDirLock
from tensorswap.runs.manager import RunManager
from tensorswap.runs.registry import DEFAULT_INACTIVE_AFTER
from tensorswap.runs.service import RunService
from tensorswap.store import DEFAULT_CHUNK_BYTES
from tensorswap.swarm.tracker import SwarmTracker
from tensorswap.transport import DEFAULT_MAX_CONNECTIONS
from tensorswap.wire._budget import DEFAULT_MAX_INFLIGHT_BYTES
from tensorswap.wire.connection import Timeouts

__all__ = ["release_large_frees", "resolve_key", "serve"]

_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter
MIN_RESULT_CHUNK, MAX_RESULT_CHUNK = 4 * 1024, 64 * 1024 * 1024  # serve --result-chunk


def release_large_frees(threshold: int = 1 << 20) -> bool:
    """Make glibc serve allocations >= ``threshold`` bytes by mmap, returned to the OS on free.

    By default glibc raises this threshold as large blocks are freed, after which every
    received multi-MiB frame lands in the heap and the freed memory stays in the process:
    a coordinator receiving many peers' blocks then holds far more than it uses. Fixing the
    threshold keeps its resident memory near what is live. True if it took effect.
    """
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False


def resolve_key(key: str | None, key_file: str | None) -> bytes | None:
    """The shared key: ``--key`` text, else ``--key-file``, else ``$TENSORSWAP_KEY``, else None."""
    if key is not None and key_file is not None:
        raise click.UsageError("give --key or --key-file, not both")
    if key is not None:
        if not key:
            raise click.BadParameter("the key is empty", param_hint="--key")
        return key.encode()
    return read_key(key_file)


async def _run(
    host: str,
    port: int,
    data: str,
    key: bytes | None,
    ssl: ssl_module.SSLContext | None,
    timeouts: Timeouts,
    durable: bool,
    keep_rounds: int | None = None,
    gc_grace: float = DEFAULT_GC_GRACE,
    max_wait: float = 300.0,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    reset: bool = False,
    max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
    inactive_after: float = DEFAULT_INACTIVE_AFTER,
    region: RegionArgs | None = None,
    group_commit: bool = True,
    peer_keys: str | None = None,
    sync_blocks: bool = False,
    result_chunk: int = DEFAULT_CHUNK_BYTES,
    max_samples_per_peer: int | None = None,
) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # asyncio handles signals only in the main thread on POSIX; elsewhere Ctrl-C still stops.
    if sys.platform != "win32" and threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
    opened: dict[str, Any] = dict(
        durable=durable,
        reset=reset,
        keep_rounds=keep_rounds,
        gc_grace=gc_grace,
        group_commit=group_commit,
        sync_blocks=sync_blocks,
    )
    tier = None
    if region is not None:  # a regional coordinator: runs live at the top
        tier = await asyncio.to_thread(open_tier, data, region, timeouts, **opened)
        assert tier.coordinator is not None
        coordinator = tier.coordinator
    else:
        coordinator = await asyncio.to_thread(Coordinator.open, data, **opened)
    coordinator.result_chunk_bytes = result_chunk
    coordinator.samples.limit = max_samples_per_peer
    runs: RunManager | None = None
    try:
        if tier is None:
            runs = await asyncio.to_thread(
                RunManager.open, coordinator, durable=durable, inactive_after=inactive_after
            )
        server = RoundServer(
            coordinator,
            key=key,
            timeouts=timeouts,
            max_wait=max_wait,
            max_connections=max_connections,
            max_inflight_bytes=max_inflight_bytes,
            peer_keys=None if peer_keys is None else PeerKeys.load(peer_keys),
        )
        SwarmTracker(coordinator.store).attach(server.blocks)  # peers that serve results
        if tier is not None:  # regions below say hello: names checked, loops refused
            RegionGate(server, link=tier.link)
        else:
            RegionGate(server, await asyncio.to_thread(coordinator_id, data))
        if runs is not None:
            RunService(runs, server)
        elif tier is not None:
            RunsProxy(tier.link, server, tier.journal)  # runs live at the top; folded here
        async with await server.start(host, port, ssl=ssl):
            settle_heap()  # what start-up made stays: out of the collector's sight
            active = coordinator.tracker.active_count()
            click.echo(f"listening on {host}:{server.port}", err=True)
            restored = "" if runs is None else f" and {len(runs.runs())} run(s)"
            click.echo(f"data in {data}; {active} active round(s){restored} restored", err=True)
            if tier is not None and region is not None:
                await tier.start()
                up = f"{region.host}:{region.port}"
                click.echo(f"region {region.name}: rounds finish upstream at {up}", err=True)
            if keep_rounds is not None:
                click.echo(
                    f"keeping the newest {keep_rounds} round number(s); older rounds and "
                    f"blocks nothing references are collected as rounds end",
                    err=True,
                )
            await stop.wait()
    finally:
        if runs is not None:
            await asyncio.to_thread(runs.close)
        if tier is not None:
            await tier.aclose()
            await asyncio.to_thread(tier.close)
        else:
            await asyncio.to_thread(coordinator.close)


@click.command("serve")
@click.option("--listen", required=True, metavar="HOST:PORT", help="Where to listen (port 0: any).")
@click.option(
    "--data",
    required=True,
    type=click.Path(file_okay=False),
    help="Directory for the round database and the block store (created if absent).",
)
@click.option("--key", help="Shared secret clients must prove (HMAC-SHA256).")
@click.option(
    "--key-file",
    type=click.Path(exists=True, dir_okay=False),
    help="Read the shared secret from a file (default: the key itself in $TENSORSWAP_KEY, if set).",
)
@click.option("--tls-cert", type=click.Path(exists=True, dir_okay=False), help="TLS certificate.")
@click.option("--tls-key", type=click.Path(exists=True, dir_okay=False), help="TLS private key.")
@click.option("--timeout", type=SECONDS, default=60.0, show_default=True, help="Seconds per frame.")
@click.option(
    "--fast-commit",
    is_flag=True,
    help="SQLite synchronous=NORMAL: survives a crash of the server, maybe not of the machine.",
)
@click.option(
    "--keep-rounds",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="After each round ends, forget finished rounds older than the newest N round numbers "
    "and delete the blocks no remaining round references (default: keep everything).",
)
@click.option(
    "--gc-grace",
    type=FiniteFloatRange(min=0),
    default=DEFAULT_GC_GRACE,
    show_default=True,
    metavar="SECONDS",
    help="Spare unreferenced blocks stored or offered this recently (pushes still to be "
    "submitted).",
)
@click.option(
    "--max-wait",
    type=SECONDS,
    default=300.0,
    show_default=True,
    metavar="SECONDS",
    help="Longest a client's wait call is held open; clients ask again, so waits still last "
    "as long as asked.",
)
@click.option(
    "--max-connections",
    type=click.IntRange(min=1),
    default=DEFAULT_MAX_CONNECTIONS,
    show_default=True,
    metavar="N",
    help="Clients served at once (each holds a file descriptor); at the cap a newcomer closes "
    "the connection idle the longest (1 s or more), else it is refused with ERROR busy.",
)
@click.option(
    "--reset",
    is_flag=True,
    help="Start a fresh round journal over the existing block store: the old "
    "DATA/rounds.sqlite3 (if any) is kept as DATA/rounds.sqlite3.reset-<UTC time> and its "
    "rounds are forgotten. Without it, serve refuses to start over a damaged journal, or a "
    "missing or empty one while DATA/blocks holds blocks.",
)
@click.option(
    "--max-inflight-bytes",
    type=BYTES,
    default="1GiB",
    show_default=True,
    metavar="SIZE",
    help="Memory all connections together may hold in received blocks not yet stored "
    "(compressed blocks count at their decompressed size, before decompressing). A client "
    "whose next block does not fit waits (the server stops reading it); a block larger than "
    "the whole budget is refused (error over_budget). Bytes, or with a unit: 512MiB, 2GiB.",
)
@click.option(
    "--inactive-after",
    type=SECONDS,
    default=DEFAULT_INACTIVE_AFTER,
    show_default=True,
    metavar="S",
    help="Seconds without a heartbeat (or any request) after which a peer registered for "
    "runs counts as inactive and is no longer sampled.",
)
@region_options
@click.option(
    "--peer-keys",
    type=click.Path(exists=True, dir_okay=False),
    help="File of '<peer> <hex key>' lines: every contribution must then prove its peer's own "
    "key (submit_batch proofs, see docs/scale.md); plain submits are refused.",
)
@click.option(
    "--sync-blocks",
    is_flag=True,
    help="Flush received blocks to disk (syncfs) before each journal commit that names them, "
    "so an accepted contribution's blocks survive a power loss too (once per group commit).",
)
@click.option(
    "--no-group-commit",
    is_flag=True,
    help="Journal each contribution in a transaction of its own (the behaviour before group "
    "commit; for comparison).",
)
@click.option(
    "--result-chunk",
    type=BYTES,
    default="4MiB",
    show_default=True,
    metavar="SIZE",
    help="Chunk size of the rounds' aggregates (each tensor cut every SIZE bytes): smaller "
    "chunks let more peers trade a result among themselves (swarm); 4 KiB to 64 MiB.",
)
@click.option(
    "--max-samples-per-peer",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="Refuse a contribution that claims more than N samples (its update's num_samples, "
    "its FedAvg weight: the peer's own word) with TooManySamples; a run's "
    "--max-samples-per-peer can be tighter (default: any claim).",
)
@click.option(
    "--event-loop",
    type=click.Choice([c.value for c in EventLoop]),
    default=EventLoop.ASYNCIO.value,
    show_default=True,
    help="The event loop: asyncio's own, uvloop (the tensorswap[fast] extra; it measured "
    "within the noise of asyncio's CPU per request, docs/scale.md), or auto (uvloop when "
    "installed).",
)
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"]),
    default="info",
    show_default=True,
)
def serve(
    listen: str,
    data: str,
    key: str | None,
    key_file: str | None,
    tls_cert: str | None,
    tls_key: str | None,
    timeout: float,
    fast_commit: bool,
    keep_rounds: int | None,
    gc_grace: float,
    max_wait: float,
    max_connections: int,
    reset: bool,
    max_inflight_bytes: int,
    inactive_after: float,
    peer_keys: str | None,
    sync_blocks: bool,
    no_group_commit: bool,
    result_chunk: int,
    max_samples_per_peer: int | None,
    event_loop: str,
    log_level: str,
    upstream: str | None,
    region: str | None,
    upstream_key_file: str | None,
    upstream_tls_ca: str | None,
    upstream_patience: float,
    upstream_peer_key_file: str | None,
) -> None:
    """Run a coordinator: rounds (start, submit, status, wait), federated runs (register,
    tasks, a global model across rounds) and blocks on one port.

    Round state lives in SQLite (WAL) under DATA and blocks in a directory store under
    DATA/blocks: stop or kill the server at any point, start it again on the same DATA, and
    rounds go on with every accepted contribution. Prints "listening on HOST:PORT" to stderr
    once ready; stops cleanly on SIGINT or SIGTERM. One server per DATA: it holds the lock
    DATA/serve.lock while it runs, and a second one on the same DATA refuses to start.
    """
    host, port = parse_host_port(listen)
    secret = resolve_key(key, key_file)
    tier = region_args(
        upstream,
        region,
        upstream_key_file,
        upstream_tls_ca,
        upstream_patience,
        secret,
        upstream_peer_key_file,
    )
    if tls_key and not tls_cert:
        raise click.UsageError("--tls-key needs --tls-cert")
    if not MIN_RESULT_CHUNK <= result_chunk <= MAX_RESULT_CHUNK:
        raise click.BadParameter("must be 4 KiB to 64 MiB", param_hint="--result-chunk")
    ssl = server_tls(tls_cert, tls_key) if tls_cert else None
    try:
        loop = resolve_loop(event_loop)
    except UvloopMissing as exc:
        raise click.BadParameter(str(exc), param_hint="--event-loop") from None
    release_large_frees()
    logging.basicConfig(
        level=getattr(logging, log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger(__name__).info("event loop: %s", loop.value)
    timeouts = Timeouts(read=timeout)
    durable = not fast_commit
    try:  # held until serve returns; the kernel drops it if the process dies
        lock = DataDirLock(data).acquire()
    except DataDirInUse as exc:  # one line, not a traceback: another server holds DATA
        raise click.ClickException(str(exc)) from exc
    try:
        run_loop(
            _run(
                host,
                port,
                data,
                secret,
                ssl,
                timeouts,
                durable,
                keep_rounds,
                gc_grace,
                max_wait,
                max_connections,
                reset,
                max_inflight_bytes,
                inactive_after,
                tier,
                group_commit=not no_group_commit,
                peer_keys=peer_keys,
                sync_blocks=sync_blocks,
                result_chunk=result_chunk,
                max_samples_per_peer=max_samples_per_peer,
            ),
            loop,
        )
    finally:
        lock.release()


if __name__ == "__main__":  # `python -m tensorswap.cli.serve_cmd` before the group lists it
    serve()
