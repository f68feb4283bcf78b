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
from tensorswap._eventloop import UvloopMissing
from tensorswap._eventloop import resolve as resolve_loop
from tensorswap._eventloop import run as run_loop
from tensorswap.cli._region import RegionArgs, open_tier, region_args, region_options
from tensorswap.cli._serve_options import (
    JOURNAL_OPTIONS,
    LIMIT_OPTIONS,
    LISTEN_OPTIONS,
    PEER_OPTIONS,
    PROCESS_OPTIONS,
)
from tensorswap.cli._util import (
    parse_host_port,
    read_key,
    server_tls,
)
from tensorswap.collective.rendezvous import Rendezvous
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
from tensorswap.wire import DEFAULT_MAX_INFLIGHT_BYTES
from tensorswap.wire.connection import Timeouts

__all__ = ["release_large_frees", "resolve_key", "run_server", "serve"]

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


async def _announce(
    host: str,
    port: int,
    data: str,
    coordinator: Coordinator,
    runs: RunManager | None,
    tier: Any,
    region: RegionArgs | None,
    keep_rounds: int | None,
) -> None:
    """Say on stderr where the server listens and what it restored (and start a region's
    link upstream, once the server is up)."""
    active = coordinator.tracker.active_count()
    click.echo(f"listening on {host}:{port}", err=True)
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


async def _round_server(
    coordinator: Coordinator,
    runs: RunManager | None,
    tier: Any,
    data: str,
    key: bytes | None,
    timeouts: Timeouts,
    max_wait: float,
    max_connections: int,
    max_inflight_bytes: int,
    peer_keys: str | None,
    operator_key: bytes | None = None,
) -> RoundServer:
    """The round server over ``coordinator``, with the swarm tracker, the region gate and
    the runs (served here, or proxied to the top of a region's tier) attached."""
    server = RoundServer(
        coordinator,
        key=key,
        timeouts=timeouts,
        max_wait=max_wait,
        max_connections=max_connections,
        max_inflight_bytes=max_inflight_bytes,
        peer_keys=None if peer_keys is None else PeerKeys.load(peer_keys),
        operator_key=operator_key,
    )
    SwarmTracker(coordinator.store).attach(server.blocks)  # peers that serve results
    Rendezvous().attach(server.blocks)  # collective groups meet here (and relay NATed peers)
    if tier is not None:  # regions below say hello: names checked, loops refused
        RegionGate(server, link=tier.link)
    else:
        RegionGate(server, await asyncio.to_thread(coordinator_id, data))
    if runs is not None:
        RunService(runs, server)
    elif tier is not None:
        RunsProxy(tier.link, server, tier.journal)  # runs live at the top; folded here
    return server


async def run_server(
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
    operator_key: bytes | None = None,
) -> None:
    """Serve rounds with these settings until SIGINT/SIGTERM: what ``serve`` runs once its
    options are parsed (tests replace it to check what the options become)."""
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
        server = await _round_server(
            coordinator,
            runs,
            tier,
            data,
            key,
            timeouts,
            max_wait,
            max_connections,
            max_inflight_bytes,
            peer_keys,
            operator_key,
        )
        async with await server.start(host, port, ssl=ssl):
            settle_heap()  # what start-up made stays: out of the collector's sight
            await _announce(host, server.port, data, coordinator, runs, tier, region, keep_rounds)
            await stop.wait()
    finally:
        if runs is not None:
            await asyncio.to_thread(runs.close)
        if tier is not None:
            await tier.aclose()
            await asyncio.to_thread(tier.close)
        else:
            await asyncio.to_thread(coordinator.close)


def _operator_key(path: str | None, secret: bytes | None) -> bytes | None:
    """``--operator-key-file``'s key: it needs a shared key and must differ from it."""
    operator_key = None if path is None else read_key(path)
    if operator_key is not None and (secret is None or operator_key == secret):
        raise click.BadParameter(
            "needs a shared key (--key, --key-file, $TENSORSWAP_KEY) and must differ from it",
            param_hint="--operator-key-file",
        )
    return operator_key


@click.command("serve")
@LISTEN_OPTIONS
@JOURNAL_OPTIONS
@LIMIT_OPTIONS
@region_options
@PEER_OPTIONS
@PROCESS_OPTIONS
def serve(**o: Any) -> None:
    """Run a coordinator: rounds (start, submit, status, wait), federated runs (register,
    tasks, a global model across rounds) and blocks on one port.

    Round state lives in SQLite (WAL) under DATA and blocks in a directory store under
    DATA/blocks: stop or kill the server at any point, start it again on the same DATA, and
    rounds go on with every accepted contribution. Prints "listening on HOST:PORT" to stderr
    once ready; stops cleanly on SIGINT or SIGTERM. One server per DATA: it holds the lock
    DATA/serve.lock while it runs, and a second one on the same DATA refuses to start.
    """
    host, port = parse_host_port(o["listen"])
    secret = resolve_key(o["key"], o["key_file"])
    upstream = (o["upstream"], o["region"], o["upstream_key_file"], o["upstream_tls_ca"])
    tier = region_args(*upstream, o["upstream_patience"], secret, o["upstream_peer_key_file"])
    if o["tls_key"] and not o["tls_cert"]:
        raise click.UsageError("--tls-key needs --tls-cert")
    operator_key = _operator_key(o["operator_key_file"], secret)
    if not MIN_RESULT_CHUNK <= o["result_chunk"] <= MAX_RESULT_CHUNK:
        raise click.BadParameter("must be 4 KiB to 64 MiB", param_hint="--result-chunk")
    ssl = server_tls(o["tls_cert"], o["tls_key"]) if o["tls_cert"] else None
    try:
        loop = resolve_loop(o["event_loop"])
    except UvloopMissing as exc:
        raise click.BadParameter(str(exc), param_hint="--event-loop") from None
    release_large_frees()
    logging.basicConfig(
        level=getattr(logging, o["log_level"].upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger(__name__).info("event loop: %s", loop.value)
    timeouts = Timeouts(read=o["timeout"])
    durable = not o["fast_commit"]
    try:  # held until serve returns; the kernel drops it if the process dies
        lock = DataDirLock(o["data"]).acquire()
    except DataDirInUse as exc:  # one line, not a traceback: another server holds DATA
        raise click.ClickException(str(exc)) from exc
    try:
        run_loop(
            run_server(
                host,
                port,
                o["data"],
                secret,
                ssl,
                timeouts,
                durable,
                o["keep_rounds"],
                o["gc_grace"],
                o["max_wait"],
                o["max_connections"],
                o["reset"],
                o["max_inflight_bytes"],
                o["inactive_after"],
                tier,
                group_commit=not o["no_group_commit"],
                peer_keys=o["peer_keys"],
                sync_blocks=o["sync_blocks"],
                result_chunk=o["result_chunk"],
                max_samples_per_peer=o["max_samples_per_peer"],
                operator_key=operator_key,
            ),
            loop,
        )
    finally:
        lock.release()


if __name__ == "__main__":  # `python -m tensorswap.cli.serve_cmd` before the group lists it
    serve()
