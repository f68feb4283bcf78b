"""Who a region is upstream: each coordinator's stable id, and the ``region`` hello a region's
link sends first on every connection to its upstream (``RegionGate`` answers it).

The hello names the region (its peer name upstream) and carries the *chain*: the ids of
the coordinators the connection passes through, from the first region a request entered to
the region that dials, its own id last. The answer names the upstream's id and the ids above
it, as far as it knows (``above``). A coordinator that finds its own id on a chain, or one
of its upstreams below it, refuses with ``RegionLoop``; one that finds a region name held by
another live coordinator refuses with ``RegionNameTaken``. A new application (``region``):
no existing message changes, and an upstream that predates it answers ``unsupported``.
"""

from __future__ import annotations

import contextvars
import os
import secrets
from pathlib import Path
from typing import Annotated

import msgspec

from tensorswap.rounds.protocol import MAX_NAME_BYTES, ErrorInfo, raise_remote
from tensorswap.wire import BlockClient, ProtocolViolation, RemoteError

__all__ = [
    "APP_REGION",
    "DOWNSTREAM",
    "ID_FILE",
    "MAX_CHAIN",
    "RegionHello",
    "RegionReply",
    "coordinator_id",
    "decode_hello",
    "encode",
    "new_coordinator_id",
    "say_hello",
]

APP_REGION = "region"
"""The application the hello is addressed to."""

ID_FILE = "coordinator.id"
"""Where a coordinator keeps its id in its data directory (one line of hex)."""

MAX_CHAIN = 16
"""The most coordinators a chain (or an ``above`` list) may name: tiers deeper than this
are refused as malformed rather than carried."""

_ID_CHARS = 64

Id = Annotated[str, msgspec.Meta(min_length=1, max_length=_ID_CHARS)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME_BYTES)]

DOWNSTREAM: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar(
    "tensorswap_region_downstream", default=()
)
"""The chain of the connection the request being served came in on: set by the gate when a
region says hello, and kept for the rest of that connection (its requests are served in one
task, whose context this is); empty for a peer. A link relaying for the request dials with
this chain plus its own id."""


class RegionHello(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """Region -> upstream, first on each link connection."""

    region: Name
    chain: Annotated[list[Id], msgspec.Meta(min_length=1, max_length=MAX_CHAIN)]
    """Coordinator ids from the first region the connection's requests entered to the
    dialling region (last: its own id, the region's identity)."""


class RegionReply(msgspec.Struct, frozen=True, forbid_unknown_fields=False, omit_defaults=True):
    """Upstream -> region: its id and the ids above it, or the refusal."""

    coordinator: str = ""
    above: Annotated[list[Id], msgspec.Meta(max_length=MAX_CHAIN)] = msgspec.field(
        default_factory=list
    )
    error: ErrorInfo | None = None


_encoder = msgspec.msgpack.Encoder()
_hello_decoder = msgspec.msgpack.Decoder(RegionHello)
_reply_decoder = msgspec.msgpack.Decoder(RegionReply)


def encode(message: RegionHello | RegionReply) -> bytes:
    return _encoder.encode(message)


def decode_hello(body: bytes) -> RegionHello:
    """The hello in a REQUEST body; ProtocolViolation when it is none (or too long)."""
    try:
        return _hello_decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise ProtocolViolation(f"bad region hello: {exc}") from exc


def new_coordinator_id() -> str:
    """A fresh random id (128 bits, hex)."""
    return secrets.token_hex(16)


def coordinator_id(data_dir: str | os.PathLike[str]) -> str:
    """The id of the coordinator over ``data_dir``: read from its ``coordinator.id``, made
    (and stored, atomically) the first time. Stable across restarts of that directory."""
    path = Path(data_dir) / ID_FILE
    try:
        text = path.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        text = ""
    if text:
        if len(text) > _ID_CHARS or not text.isalnum():
            raise ValueError(f"{path} does not hold a coordinator id: {text[:80]!r}")
        return text
    path.parent.mkdir(parents=True, exist_ok=True)
    fresh = new_coordinator_id()
    staging = path.with_name(f".{ID_FILE}.{os.getpid()}")
    staging.write_text(fresh + "\n", encoding="ascii")
    try:
        os.link(staging, path)  # fails if another process made it meanwhile: theirs wins
    except FileExistsError:
        return coordinator_id(data_dir)
    finally:
        staging.unlink()
    return fresh


async def say_hello(client: BlockClient, region: str, chain: tuple[str, ...]) -> RegionReply | None:
    """Send the hello on ``client``'s connection; the upstream's answer, or None when the
    upstream predates the hello (it answers ``unsupported``: no checks are made there).
    A refusal is raised as its typed error (RegionLoop, RegionNameTaken)."""
    body = encode(RegionHello(region=region, chain=list(chain)))
    try:
        reply = await client.request(APP_REGION, body)
    except RemoteError as exc:
        if exc.code == "unsupported":
            return None
        raise
    try:
        answer = _reply_decoder.decode(reply)
    except msgspec.DecodeError as exc:
        raise ProtocolViolation(f"bad region hello answer: {exc}") from exc
    if answer.error is not None:
        raise_remote(answer.error, client.conn.peer)
    return answer
