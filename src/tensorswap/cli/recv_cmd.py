"""`tensorswap recv`: receive tensors into a directory store and print each CID as it lands."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import click

from tensorswap.cid import Cid
from tensorswap.cli._util import BYTES, SECONDS, parse_host_port, read_key, server_tls
from tensorswap.codec import TensorBlock
from tensorswap.errors import TensorSwapError
from tensorswap.store import DirectoryStore, put_tensor, read_manifest
from tensorswap.store.manifest import TensorManifest
from tensorswap.transport import Transport, serve_tcp
from tensorswap.wire import DEFAULT_MAX_INFLIGHT_BYTES
from tensorswap.wire.connection import Timeouts
from tensorswap.wire.errors import StreamEnded
from tensorswap.wire.ipfrs import GradientStreamSession
from tensorswap.wire.server import BlockServer

__all__ = ["describe_root", "recv"]


def describe_root(store: DirectoryStore, root: Cid) -> str:
    """``<cid>  <name> <dtype>[shape]`` for a tensor, ``<cid>  <name> (<n> tensors)`` else."""
    try:
        manifest = read_manifest(store, root)
    except TensorSwapError:
        return str(root)
    if isinstance(manifest, TensorManifest):
        return f"{root}  {manifest.name} {manifest.dtype}{list(manifest.shape)}"
    return f"{root}  {manifest.name or 'update'} ({len(manifest.tensors)} tensors)"


class _Landing:
    """Prints each landed root and stops the receiver after ``count`` of them (0: never)."""

    def __init__(self, store: DirectoryStore, count: int) -> None:
        self.store = store
        self.count = count
        self.landed = 0
        self.done = asyncio.Event()

    def __call__(self, root: Cid) -> None:
        click.echo(describe_root(self.store, root))
        sys.stdout.flush()
        self.landed += 1
        if self.count and self.landed >= self.count:
            self.done.set()


async def _serve_blocks(
    host: str,
    port: int,
    landing: _Landing,
    key: bytes | None,
    ssl: Any,
    timeouts: Timeouts,
    max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
    block_crc: bool = False,
) -> None:
    server = BlockServer(
        landing.store,
        key=key,
        timeouts=timeouts,
        on_root=landing,
        max_inflight_bytes=max_inflight_bytes,
        block_crc=block_crc,
    )
    async with await server.start(host, port, ssl=ssl):
        click.echo(f"listening on {host}:{server.port}", err=True)
        await landing.done.wait()


async def _serve_ipfrs(host: str, port: int, landing: _Landing, ssl: Any, timeout: float) -> None:
    async def handle(transport: Transport) -> None:
        session = GradientStreamSession(transport.peer, read_timeout=timeout)
        while True:
            try:
                values = await session.receive_from(transport)
            except StreamEnded:
                return
            except TensorSwapError as exc:
                click.echo(f"error: {transport.peer}: {exc}", err=True)
                return
            block = TensorBlock(f"ipfrs:{transport.peer}", values)
            root = await asyncio.to_thread(put_tensor, landing.store, block)
            landing(root)

    async with await serve_tcp(handle, host, port, ssl=ssl) as listener:
        click.echo(f"listening on {host}:{listener.port}", err=True)
        await landing.done.wait()


@click.command("recv")
@click.option("--listen", "listen", required=True, metavar="HOST:PORT", help="Where to listen.")
@click.option(
    "--out",
    required=True,
    type=click.Path(file_okay=False),
    help="Directory block store (created if absent).",
)
@click.option("--ipfrs", is_flag=True, help="Accept ipfrs gradient streams instead.")
@click.option(
    "--key-file",
    type=click.Path(exists=True, dir_okay=False),
    help="Require the shared key in this file (HMAC; default: the key itself in "
    "$TENSORSWAP_KEY, if set).",
)
@click.option("--tls-cert", type=click.Path(exists=True, dir_okay=False), help="TLS certificate.")
@click.option("--tls-key", type=click.Path(exists=True, dir_okay=False), help="TLS private key.")
@click.option(
    "--count",
    type=click.IntRange(min=0),
    default=0,
    help="Exit after this many tensors (0: never).",
)
@click.option("--timeout", type=SECONDS, default=60.0, show_default=True, help="Seconds per frame.")
@click.option(
    "--max-inflight-bytes",
    type=BYTES,
    default="1GiB",
    show_default=True,
    metavar="SIZE",
    help="Memory all tensorswap connections together may hold in received blocks not yet stored "
    "(compressed blocks count at their decompressed size, before decompressing). A client "
    "whose next block does not fit waits (the server stops reading it); a block larger than "
    "the whole budget is refused (error over_budget). Bytes, or with a unit: 512MiB, 2GiB.",
)
@click.option(
    "--block-crc",
    is_flag=True,
    help="Insist on a CRC32C on every block frame (by default a sender may leave it out: each "
    "block's CID is checked, which covers its bytes).",
)
def recv(
    listen: str,
    out: str,
    ipfrs: bool,
    key_file: str | None,
    tls_cert: str | None,
    tls_key: str | None,
    count: int,
    timeout: float,
    max_inflight_bytes: int,
    block_crc: bool,
) -> None:
    """Receive tensors into the directory store OUT; print each root CID as it lands.

    Every block's CID is checked before it is stored (and a frame's CRC32C where the sender
    sent one: with --block-crc on either side, every block frame carries one). Prints
    "listening on HOST:PORT" to stderr once ready (port 0 picks a free port).
    """
    host, port = parse_host_port(listen)
    if tls_key and not tls_cert:
        raise click.UsageError("--tls-key needs --tls-cert")
    ssl = server_tls(tls_cert, tls_key) if tls_cert else None
    if ipfrs and key_file is not None:
        raise click.UsageError("--ipfrs streams carry no handshake: use --tls-cert")
    key = None if ipfrs else read_key(key_file)
    store = DirectoryStore(out)
    landing = _Landing(store, count)
    try:
        if ipfrs:
            asyncio.run(_serve_ipfrs(host, port, landing, ssl, timeout))
        else:
            timeouts = Timeouts(read=timeout)
            asyncio.run(
                _serve_blocks(
                    host, port, landing, key, ssl, timeouts, max_inflight_bytes, block_crc
                )
            )
    except KeyboardInterrupt:
        click.echo(f"stopped after {landing.landed} tensor(s)", err=True)
