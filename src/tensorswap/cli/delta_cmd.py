"""``tensorswap delta``: listen for DWE fragments, or send the delta between two saved states."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import click
import numpy as np

from tensorswap.cli._util import SECONDS
from tensorswap.delta.bincode import MAX_DWE_FRAGMENT_BYTES
from tensorswap.delta.bus import DweBus
from tensorswap.delta.config import DweConfig, SendMode, parse_endpoint
from tensorswap.delta.fragment import extract_delta_fragment
from tensorswap.delta.listener import DweListener, Verdict
from tensorswap.delta.split import split_fragment
from tensorswap.delta.verify import FleetKeys, GapPolicy, sign_fragment
from tensorswap.errors import CodecError, DeltaError


def _keys(key: str | None, previous_key: str | None, config: DweConfig) -> FleetKeys | None:
    if key is None:
        if previous_key is not None:
            raise click.UsageError("--previous-key needs --key")
        return config.keys
    if not key:
        raise click.BadParameter("the fleet key is empty", param_hint="'--key'")
    return FleetKeys(key.encode(), previous_key.encode() if previous_key else None)


def _key_options(func: Any) -> Any:
    func = click.option(
        "--previous-key",
        help="Previous fleet key, still accepted during a rotation.",
    )(func)
    return click.option(
        "--key",
        help="Fleet key (UTF-8) for HMAC-SHA256; default: $TENSORSWAP_DWE_KEY.",
    )(func)


def _max_bytes_option(func: Any) -> Any:
    return click.option(
        "--max-bytes",
        type=click.IntRange(1, 2**32 - 1),
        default=MAX_DWE_FRAGMENT_BYTES,
        show_default=True,
        help="The fragment size cap in bytes (axiom's default): listen refuses a larger frame, "
        "send splits a larger delta into parts.",
    )(func)


@click.group("delta")
def delta() -> None:
    """Weight-delta fragments over TCP, byte-compatible with axiom DWE."""


@delta.command("listen")
@click.argument("address")
@_key_options
@_max_bytes_option
@click.option(
    "--gap-policy",
    type=click.Choice([p.value for p in GapPolicy]),
    default=GapPolicy.ACCEPT.value,
    show_default=True,
    help="What to do when a session's sequence skips ahead.",
)
@click.option(
    "--count",
    type=click.IntRange(min=0),
    default=0,
    help="Exit after this many frames (0: never).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per frame.")
def listen(
    address: str,
    key: str | None,
    previous_key: str | None,
    max_bytes: int,
    gap_policy: str,
    count: int,
    as_json: bool,
) -> None:
    """Listen on HOST:PORT and print each fragment received with its verdict."""
    config = DweConfig.from_env(
        listen=parse_endpoint(address),
        max_fragment_bytes=max_bytes,
        gap_policy=GapPolicy(gap_policy),
    )
    config = replace(config, keys=_keys(key, previous_key, config))
    asyncio.run(_listen(config, count, as_json))


def _verdict_json(verdict: Verdict) -> str:
    return json.dumps(
        {
            "peer": verdict.peer,
            "verdict": "accepted" if verdict.accepted else "rejected",
            "reason": verdict.reason.value if verdict.reason is not None else None,
            "detail": verdict.detail,
            "bytes": verdict.fragment_bytes,
            "session_id": verdict.session_id,
            "sequence": verdict.sequence,
            "layers": verdict.layers,
            "values": verdict.values,
            "key": verdict.key_used.value,
            "skipped": verdict.skipped,
        }
    )


async def _listen(config: DweConfig, count: int, as_json: bool) -> None:
    seen = 0
    done = asyncio.Event()

    def show(verdict: Verdict) -> None:
        nonlocal seen
        click.echo(_verdict_json(verdict) if as_json else verdict.describe())
        sys.stdout.flush()
        seen += 1
        if count and seen >= count:
            done.set()

    async with DweListener(config=config, on_verdict=show) as listener:
        click.echo(f"listening on {listener.endpoint}", err=True)
        sys.stderr.flush()
        await done.wait()


def _load_npz(path: Path) -> dict[str, np.ndarray]:
    # Our own file object: np.load(path) leaves its file open when the zip is damaged.
    with open(path, "rb") as file, np.load(file, allow_pickle=False) as archive:
        return {name: np.array(archive[name]) for name in archive.files}


def _load_safetensors(path: Path) -> dict[str, Any]:
    try:
        from safetensors.numpy import load_file
    except ImportError as exc:
        raise click.ClickException("reading .safetensors needs the safetensors package") from exc
    try:
        return dict(load_file(str(path)))
    except (TypeError, ValueError):  # e.g. bfloat16, which numpy cannot hold: use torch
        from safetensors.torch import load_file as load_torch

        return dict(load_torch(str(path)))


def load_state(path: Path) -> dict[str, Any]:
    """Named arrays from a ``.npz`` or ``.safetensors`` file, in the file's name order."""
    suffix = path.suffix.lower()
    if suffix not in (".npz", ".safetensors"):
        raise click.BadParameter(f"{path}: expected a .npz or .safetensors file")
    try:
        return _load_npz(path) if suffix == ".npz" else _load_safetensors(path)
    except click.ClickException:
        raise
    except OSError as exc:
        raise click.FileError(str(path), hint=str(exc)) from exc
    except Exception as exc:  # a damaged file: BadZipFile, ValueError, SafetensorError, ...
        raise CodecError(f"{path}: not a readable {suffix} file: {exc}") from exc


@delta.command("send")
@click.option("--to", "to", required=True, help="Peer HOST:PORT.")
@click.argument("base", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("new", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--session-id", default="tensorswap", show_default=True)
@click.option("--sequence", type=int, default=None, help="First sequence [default: now in ns].")
@_key_options
@_max_bytes_option
@click.option(
    "--mode",
    type=click.Choice([m.value for m in SendMode]),
    default=SendMode.PERSISTENT.value,
    show_default=True,
    help="per-fragment for axiom 0.1.5 listeners (one frame per connection).",
)
@click.option("--timeout", type=SECONDS, default=30.0, show_default=True, help="Seconds in all.")
def send(
    to: str,
    base: Path,
    new: Path,
    session_id: str,
    sequence: int | None,
    key: str | None,
    previous_key: str | None,
    max_bytes: int,
    mode: str,
    timeout: float,
) -> None:
    """Send the delta NEW - BASE (named arrays, layer i = i-th name of NEW) to one peer."""
    config = DweConfig.from_env(
        peers=(parse_endpoint(to),), max_fragment_bytes=max_bytes, mode=SendMode(mode)
    )
    keys = _keys(key, previous_key, config)
    optimized, baseline = load_state(new), load_state(base)
    first = time.time_ns() if sequence is None else sequence
    fragment = extract_delta_fragment(session_id, first, optimized, baseline)
    parts = split_fragment(fragment, max_bytes=max_bytes, reserve_hmac=keys is not None)
    if keys is not None:
        parts = [sign_fragment(part, keys.current) for part in parts]
    config = replace(config, keys=keys, queue_size=max(config.queue_size, len(parts)))
    for index, name in enumerate(optimized):
        click.echo(f"layer {index}: {name} {list(np.shape(optimized[name]))}", err=True)
    sent = asyncio.run(_send(config, parts, timeout))
    last = parts[-1].sequence
    click.echo(f"sent {len(parts)} fragment(s), {sent} bytes, sequences {first}..{last} to {to}")


async def _send(config: DweConfig, parts: list[Any], timeout: float) -> int:
    async with DweBus(config=config, drain_timeout=timeout) as bus:
        for part in parts:
            bus.broadcast(part)
        try:
            async with asyncio.timeout(timeout):
                await bus.flush()
        except TimeoutError:
            pass
        stats = bus.telemetry()
    if stats.sent != len(parts):
        raise DeltaError(
            f"sent {stats.sent} of {len(parts)} fragments to {config.peers[0]}: {stats.last_error}"
        )
    return stats.sent_bytes
