"""`tensorswap send`: send a tensor file to a `tensorswap recv` (tensorswap or ipfrs framing)."""

from __future__ import annotations

import asyncio
import sys
import time
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click
import numpy as np

from tensorswap.cli._util import (
    SECONDS,
    client_tls,
    option_group,
    parse_host_port,
    read_key,
    reading,
)
from tensorswap.codec import TensorBlock, decode_block, is_tensorswap_block
from tensorswap.codec.ipfrs import decode_ipfrs_gradient, is_ipfrs_gradient_file
from tensorswap.store import DEFAULT_CHUNK_BYTES, ModelUpdate
from tensorswap.transport import connect_tcp
from tensorswap.wire.client import BlockClient, CompressionChoice
from tensorswap.wire.connection import Timeouts
from tensorswap.wire.frames import Compression
from tensorswap.wire.ipfrs import DEFAULT_CHUNK_SIZE, GradientStreamSession

__all__ = ["load_tensors", "send"]

PROGRESS_MIN_BYTES = 64 * 1024 * 1024
"""Transfers at least this large show a progress bar (on a terminal)."""

_COMPRESSIONS: dict[str, CompressionChoice] = {
    "none": Compression.NONE,
    "zstd": Compression.ZSTD,
    "lz4": Compression.LZ4,
    "auto": "auto",
}


def load_tensors(path: str | Path, name: str | None = None) -> TensorBlock | ModelUpdate:
    """Read a tensor file: .npy, .npz, safetensors, a tensorswap Arrow IPC block or an ipfrs
    gradient Arrow IPC file (recognised by content). Files are memory-mapped where possible.
    """
    path = Path(path)
    label = name if name is not None else path.stem
    try:
        with path.open("rb") as f:
            head = f.read(16)
    except OSError as exc:
        raise click.FileError(str(path), hint=exc.strerror or str(exc)) from exc
    # Every parser failure on a damaged file (numpy's header parser raises TokenError,
    # SyntaxError, ValueError, ...) is one CodecError: reading() is the boundary.
    if head.startswith(b"\x93NUMPY"):
        with reading(".npy", path):
            return TensorBlock(label, np.load(path, mmap_mode="r", allow_pickle=False))
    if head.startswith(b"PK") and zipfile.is_zipfile(path):
        # Our own file object: np.load(path) leaves its file open when the zip is damaged.
        with (
            reading(".npz", path),
            open(path, "rb") as file,
            np.load(file, allow_pickle=False) as npz,
        ):
            return ModelUpdate({k: npz[k] for k in npz.files}, name=label)
    data = np.memmap(path, mode="r") if path.stat().st_size else np.empty(0, np.uint8)
    if is_ipfrs_gradient_file(data):
        with reading("ipfrs gradient", path):
            return TensorBlock(label, decode_ipfrs_gradient(data))
    if is_tensorswap_block(data):
        with reading("tensorswap block", path):
            block = decode_block(data)
        return block if name is None else TensorBlock(name, block.values, block.num_samples)
    if len(head) >= 10 and head[8:9] == b"{":
        from safetensors.numpy import load_file

        with reading("safetensors", path):  # safetensors raises SafetensorError, ValueError
            return ModelUpdate(load_file(str(path)), name=label)
    raise click.BadParameter(
        f"{path}: not a .npy, .npz, safetensors, tensorswap block or ipfrs gradient file",
        param_hint="FILE",
    )


def item_nbytes(update: ModelUpdate) -> int:
    """Bytes of all tensors of ``update``."""
    return sum(int(values.nbytes) for values in update.tensors.values())


@contextmanager
def _progress(total: int, show: bool | None) -> Iterator[Callable[[int, int], None] | None]:
    enabled = show if show is not None else (total >= PROGRESS_MIN_BYTES and sys.stderr.isatty())
    if not enabled:
        yield None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TransferSpeedColumn,
    )

    # On stderr, the stream whose terminal decides the default: stdout keeps the result line.
    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as bar:
        task = bar.add_task("sending", total=total)
        yield lambda done, _total: bar.update(task, completed=done)


async def _send_blocks(
    item: TensorBlock | ModelUpdate,
    host: str,
    port: int,
    *,
    key: bytes | None,
    ssl: Any,
    compression: CompressionChoice,
    chunk_bytes: int,
    timeouts: Timeouts,
    show_progress: bool | None,
    block_crc: bool = False,
) -> str:
    total = item.nbytes if isinstance(item, TensorBlock) else item_nbytes(item)
    start = time.perf_counter()
    with _progress(total, show_progress) as progress:
        async with await BlockClient.connect(
            host, port, key=key, ssl=ssl, timeouts=timeouts, block_crc=block_crc
        ) as client:
            if isinstance(item, TensorBlock):
                result = await client.push_tensor(
                    item, chunk_bytes=chunk_bytes, compression=compression, progress=progress
                )
            else:
                result = await client.push_update(
                    item, chunk_bytes=chunk_bytes, compression=compression, progress=progress
                )
    root = result.roots[0]
    seconds = time.perf_counter() - start
    return (
        f"{root}  {result.wire_bytes} bytes  {seconds:.3f} s  "
        f"{result.wire_bytes / seconds / 1e9:.2f} GB/s  "
        f"({result.sent_blocks} of {result.offered} blocks sent)"
    )


async def _send_ipfrs(
    item: TensorBlock | ModelUpdate,
    host: str,
    port: int,
    *,
    ssl: Any,
    chunk_size: int,
    timeouts: Timeouts,
) -> str:
    tensors = [item.values] if isinstance(item, TensorBlock) else list(item.tensors.values())
    session = GradientStreamSession("tensorswap-cli", chunk_size)
    start = time.perf_counter()
    transport = await connect_tcp(host, port, ssl=ssl, timeout=timeouts.connect)
    async with transport:
        chunks = 0
        for values in tensors:
            chunks += await session.stream_to(np.ascontiguousarray(values), transport)
        sent = transport.bytes_sent
    seconds = time.perf_counter() - start
    return (
        f"{len(tensors)} gradient(s), {chunks} chunks  {sent} bytes  {seconds:.3f} s  "
        f"{sent / seconds / 1e9:.2f} GB/s"
    )


# Who may read the stream, and how long a frame may take.
_CONNECTION_OPTIONS = option_group(
    click.option(
        "--key-file",
        type=click.Path(exists=True, dir_okay=False),
        help="Read the shared key for HMAC authentication from a file (default: the key "
        "itself in $TENSORSWAP_KEY, if set).",
    ),
    click.option("--tls", is_flag=True, help="Use TLS (system CAs unless --tls-ca)."),
    click.option(
        "--tls-ca", type=click.Path(exists=True, dir_okay=False), help="CA/cert to trust."
    ),
    click.option(
        "--timeout", type=SECONDS, default=60.0, show_default=True, help="Seconds per frame."
    ),
    click.option(
        "--block-crc",
        is_flag=True,
        help="Keep a CRC32C on every block frame. By default blocks go without one where the "
        "receiver agrees: each block's CID (blake3) is checked on receipt, which covers its "
        "bytes.",
    ),
)


@click.command("send")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option("--to", "to", required=True, metavar="HOST:PORT", help="The receiver.")
@click.option("--ipfrs", is_flag=True, help="Use the ipfrs gradient framing (float32 only).")
@click.option("--name", help="Tensor name (default: the file name without suffix).")
@click.option(
    "--compression",
    type=click.Choice(list(_COMPRESSIONS)),
    default="none",
    show_default=True,
    help="Per-block compression; auto uses zstd where a sample shrinks by 15%+.",
)
@click.option(
    "--chunk-bytes",
    type=click.IntRange(min=1),
    default=DEFAULT_CHUNK_BYTES,
    show_default=True,
    help="Block size.",
)
@click.option(
    "--chunk-size",
    type=click.IntRange(min=0),
    default=DEFAULT_CHUNK_SIZE,
    show_default=True,
    help="Values per ipfrs chunk (--ipfrs; 0 means 1, as in ipfrs).",
)
@_CONNECTION_OPTIONS
@click.option(
    "--progress/--no-progress",
    default=None,
    help=f"Progress bar (default: on a terminal, for {PROGRESS_MIN_BYTES >> 20} MiB or more).",
)
def send(
    file: str,
    to: str,
    ipfrs: bool,
    name: str | None,
    compression: str,
    chunk_bytes: int,
    chunk_size: int,
    key_file: str | None,
    tls: bool,
    tls_ca: str | None,
    timeout: float,
    block_crc: bool,
    progress: bool | None,
) -> None:
    """Send FILE (.npy, .npz, safetensors, Arrow IPC) to a `tensorswap recv` at HOST:PORT.

    Prints the root CID, bytes sent, seconds and GB/s. Blocks the receiver already holds are
    not sent again, so re-running after an interruption resumes the transfer.
    """
    host, port = parse_host_port(to)
    key = read_key(key_file)
    if ipfrs and key_file is not None:
        raise click.UsageError("--ipfrs streams carry no handshake: use --tls, not a key")
    ssl = client_tls(tls_ca) if tls or tls_ca else None
    timeouts = Timeouts(read=timeout)
    item = load_tensors(file, name)
    if ipfrs:
        line = asyncio.run(
            _send_ipfrs(item, host, port, ssl=ssl, chunk_size=chunk_size, timeouts=timeouts)
        )
    else:
        line = asyncio.run(
            _send_blocks(
                item,
                host,
                port,
                key=key,
                ssl=ssl,
                compression=_COMPRESSIONS[compression],
                chunk_bytes=chunk_bytes,
                timeouts=timeouts,
                show_progress=progress,
                block_crc=block_crc,
            )
        )
    click.echo(line)
