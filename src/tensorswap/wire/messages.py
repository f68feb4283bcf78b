"""Control messages: msgspec Structs as msgpack maps, one FrameKind each; CIDs in binary form."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import msgspec

from tensorswap.cid import Cid
from tensorswap.errors import InvalidCid
from tensorswap.wire.errors import FrameTooLarge, ProtocolViolation
from tensorswap.wire.frames import FrameKind

__all__ = [
    "MAX_CIDS_PER_MESSAGE",
    "MESSAGE_KINDS",
    "MESSAGE_TYPES",
    "Commit",
    "Committed",
    "Error",
    "Get",
    "Got",
    "Hello",
    "Message",
    "Offer",
    "Ready",
    "Reply",
    "Request",
    "Want",
    "Welcome",
    "decode_message",
    "encode_message",
    "parse_cids",
    "wire_cids",
]


class _Base(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """Unknown fields from newer peers are ignored; missing required fields are refused."""


class Welcome(_Base, frozen=True):
    """First frame of a connection, server -> client."""

    protocol: int
    nonce: bytes
    auth: bool
    max_block_bytes: int
    server: str = ""
    lean_blocks: bool = False
    """The server accepts BLOCK frames without a payload CRC32C (it checks their CIDs)."""
    chunk_bytes: int = 0
    """The chunk size the server cuts the tensors it makes in (a rounds coordinator's
    results): a client that cuts its own the same way shares blocks with them (0: not said)."""


class Hello(_Base, frozen=True):
    """Client -> server answer to Welcome; ``mac`` present exactly when the client has a key."""

    protocol: int
    nonce: bytes
    mac: bytes | None = None
    client: str = ""
    lean_blocks: bool = False
    """The client accepts BLOCK frames without a payload CRC32C (it checks their CIDs)."""


class Ready(_Base, frozen=True):
    """Server -> client: the handshake succeeded; ``mac`` proves the server knows the key."""

    mac: bytes | None = None


class Error(_Base, frozen=True):
    """A typed refusal; the side that sends it closes the connection afterwards."""

    code: str
    message: str


class Offer(_Base, frozen=True):
    """Client -> server: blocks the client can send (the server answers which it lacks)."""

    cids: list[bytes]


class Want(_Base, frozen=True):
    """Server -> client: the offered CIDs the server does not hold, in offer order."""

    cids: list[bytes]


class Commit(_Base, frozen=True):
    """Client -> server after its BLOCK frames: these roots should now be complete."""

    roots: list[bytes]
    blocks: int
    nbytes: int


class Committed(_Base, frozen=True):
    """Server -> client: every block of this connection is stored and the roots are complete.

    ``blocks``/``nbytes`` count what the server stored on this connection so far.
    """

    roots: list[bytes]
    blocks: int
    nbytes: int


class Get(_Base, frozen=True):
    """Client -> server: send these blocks (BLOCK frames, in this order, then Got).

    ``manifests``: after them, also every manifest they link to, recursively, that the
    server holds (not chunks; parents before children; not listed in Got), so that a pull
    learns a whole update's chunk list in one round trip. ``closure``: every block they
    link to, chunks too, except those named in ``have`` (blocks the client holds): a pull
    in one round trip. A server that predates the fields ignores them and sends only what
    was asked; the pull then goes on level by level.
    """

    cids: list[bytes]
    manifests: bool = False
    closure: bool = False
    have: list[bytes] = msgspec.field(default_factory=list)


class Got(_Base, frozen=True):
    """Server -> client: the end of a Get answer; ``missing`` lists the CIDs not held."""

    missing: list[bytes]


class Request(_Base, frozen=True):
    """Client -> server: a request for the application ``app`` (see ``BlockServer.handlers``).

    ``body`` is opaque to the wire layer; the application defines it. Every block the client
    sent before this frame is stored before the handler sees the request.
    """

    app: str
    body: bytes


class Reply(_Base, frozen=True):
    """Server -> client: the answer to a Request, same stream id.

    ``handled`` is False (and ``body`` empty) when the server has no handler for ``app``;
    the connection stays usable.
    """

    app: str
    body: bytes
    handled: bool = True


Message = (Welcome | Hello | Ready | Error | Offer | Want | Commit | Committed | Get | Got) | (
    Request | Reply
)

MESSAGE_TYPES: dict[FrameKind, type[_Base]] = {
    FrameKind.WELCOME: Welcome,
    FrameKind.HELLO: Hello,
    FrameKind.READY: Ready,
    FrameKind.ERROR: Error,
    FrameKind.OFFER: Offer,
    FrameKind.WANT: Want,
    FrameKind.COMMIT: Commit,
    FrameKind.COMMITTED: Committed,
    FrameKind.GET: Get,
    FrameKind.GOT: Got,
    FrameKind.REQUEST: Request,
    FrameKind.REPLY: Reply,
}
"""The registry: each control FrameKind and the Struct its payload decodes to."""

MESSAGE_KINDS: dict[type[_Base], FrameKind] = {t: k for k, t in MESSAGE_TYPES.items()}

_missing = set(FrameKind) - set(MESSAGE_TYPES) - {FrameKind.BLOCK}
if _missing or len(MESSAGE_KINDS) != len(MESSAGE_TYPES):  # checked at import
    raise RuntimeError(f"message registry incomplete: {sorted(k.name for k in _missing)}")


MAX_CIDS_PER_MESSAGE = 65_536
"""Most CIDs one Offer, Want, Commit, Committed, Get or Got may carry (~2.6 MB of CIDs)."""

_encoder = msgspec.msgpack.Encoder()
_decoders = {kind: msgspec.msgpack.Decoder(typ) for kind, typ in MESSAGE_TYPES.items()}


def wire_cids(cids: Iterable[Cid]) -> list[bytes]:
    """CIDs in their binary form, as messages carry them."""
    return [cid.to_bytes() for cid in cids]


def parse_cids(raw: list[bytes], what: str = "message") -> list[Cid]:
    """Binary CIDs from a peer's message; ProtocolViolation naming the first invalid one.

    At most ``MAX_CIDS_PER_MESSAGE`` of them (FrameTooLarge, before any is parsed).
    """
    if len(raw) > MAX_CIDS_PER_MESSAGE:
        raise FrameTooLarge(f"{what} CID count", len(raw), MAX_CIDS_PER_MESSAGE)
    try:
        return [Cid.parse(item) for item in raw]
    except InvalidCid as exc:
        raise ProtocolViolation(f"{what} carries an invalid CID: {exc.reason}") from exc


def encode_message(message: Message) -> tuple[FrameKind, bytes]:
    """The frame kind and msgpack payload of a control message."""
    return MESSAGE_KINDS[type(message)], _encoder.encode(message)


def decode_message(kind: FrameKind, payload: Any) -> Message:
    """Decode a control payload of frame ``kind``; ProtocolViolation when it does not fit."""
    decoder = _decoders.get(kind)
    if decoder is None:
        raise ProtocolViolation(f"{kind.name} frame is not a control message")
    try:
        return cast(Message, decoder.decode(payload))
    except (msgspec.DecodeError, RecursionError) as exc:
        # RecursionError: msgpack nested too deeply (even inside a field that is ignored)
        raise ProtocolViolation(f"bad {kind.name} message: {exc}") from exc
