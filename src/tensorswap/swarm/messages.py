"""The swarm's messages: the coordinator's tracker app and a seeder's have app (msgpack)."""

from __future__ import annotations

from typing import Literal, TypeVar

import msgspec

from tensorswap.cid import Cid
from tensorswap.errors import CidError
from tensorswap.swarm.errors import BadSwarmMessage

__all__ = [
    "HAVE_APP",
    "MAX_LISTED",
    "TRACKER_APP",
    "Announce",
    "HaveAnswer",
    "HaveQuery",
    "Holder",
    "HoldersAnswer",
    "HoldersQuery",
    "Leave",
    "TrackerCall",
    "decode_answer",
    "decode_call",
    "decode_have",
    "decode_have_answer",
    "encode",
    "parse_root",
]

TRACKER_APP = "swarm"
"""The coordinator's application name for the tracker (``BlockServer.handlers`` key)."""
HAVE_APP = "swarm-have"
"""A seeder's application name for "which chunks of this root do you hold"."""
MAX_LISTED = 64
"""Holders one answer lists at most."""
MAX_NAME = 256
"""Longest peer name or host a tracker keeps."""
MAX_WAIT = 5.0
"""Longest a have query waits on a seeder for news (seconds)."""


class _Base(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    pass


class Announce(_Base, frozen=True, tag="announce", tag_field="op"):
    """Peer -> tracker: ``peer`` serves (some of) ``root``'s blocks at ``host:port``; an empty
    ``host`` means "the address this request came from". Answered with the other holders."""

    root: bytes
    peer: str
    host: str
    port: int


class HoldersQuery(_Base, frozen=True, tag="holders", tag_field="op"):
    """Peer -> tracker: who serves ``root`` (``peer``, the asker, is left out)."""

    root: bytes
    peer: str = ""


class Leave(_Base, frozen=True, tag="leave", tag_field="op"):
    """Peer -> tracker: ``peer`` no longer serves ``root``."""

    root: bytes
    peer: str


TrackerCall = Announce | HoldersQuery | Leave


class Holder(_Base, frozen=True):
    peer: str
    host: str
    port: int


class HoldersAnswer(_Base, frozen=True):
    """Tracker -> peer: up to MAX_LISTED holders (announce order), or ``error``."""

    holders: list[Holder] = msgspec.field(default_factory=list)
    error: str | None = None


class HaveQuery(_Base, frozen=True):
    """Fetcher -> seeder: the chunks of ``root`` held beyond the first ``since`` already told,
    and the chunks it is fetching from the coordinator (its claims); when there is no news
    (no chunk beyond ``since``, claims still at version ``claims_seen``), wait up to
    ``wait`` seconds (at most MAX_WAIT) for some."""

    root: bytes
    since: int = 0
    wait: float = 0.0
    claims_seen: int = 0


class HaveAnswer(_Base, frozen=True):
    """Seeder -> fetcher: ``chunks`` held, in the order the seeder got them, from position
    ``since``; ``version`` is the count told so far. ``claimed``: every chunk it is fetching
    from the coordinator now, as of ``claims_version``. ``serving`` False: not this root."""

    version: int
    chunks: list[bytes] = msgspec.field(default_factory=list)
    serving: bool = True
    claimed: list[bytes] = msgspec.field(default_factory=list)
    claims_version: int = 0


_call_decoder = msgspec.msgpack.Decoder(TrackerCall)
_answer_decoder = msgspec.msgpack.Decoder(HoldersAnswer)
_have_decoder = msgspec.msgpack.Decoder(HaveQuery)
_have_answer_decoder = msgspec.msgpack.Decoder(HaveAnswer)
_encoder = msgspec.msgpack.Encoder()
_Kind = Literal["call", "answer", "have", "have answer"]
_T = TypeVar("_T")


def encode(message: _Base) -> bytes:
    return _encoder.encode(message)


def _decode(decoder: msgspec.msgpack.Decoder[_T], body: bytes, what: _Kind, peer: str) -> _T:
    try:
        return decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BadSwarmMessage(f"undecodable swarm {what}: {exc}", peer) from exc


def decode_call(body: bytes, peer: str = "") -> TrackerCall:
    call = _decode(_call_decoder, body, "call", peer)
    if len(call.peer) > MAX_NAME or (isinstance(call, Announce) and len(call.host) > MAX_NAME):
        raise BadSwarmMessage(f"a name longer than {MAX_NAME} characters", peer)
    if isinstance(call, Announce) and not 0 < call.port < 65536:
        raise BadSwarmMessage(f"port {call.port} out of range", peer)
    return call


def decode_answer(body: bytes, peer: str = "") -> HoldersAnswer:
    answer = _decode(_answer_decoder, body, "answer", peer)
    if len(answer.holders) > MAX_LISTED:
        raise BadSwarmMessage(f"{len(answer.holders)} holders listed, over {MAX_LISTED}", peer)
    for holder in answer.holders:
        if not 0 < holder.port < 65536 or not holder.host or len(holder.host) > MAX_NAME:
            raise BadSwarmMessage(f"holder {holder.peer!r} at {holder.host}:{holder.port}", peer)
    return answer


def decode_have(body: bytes, peer: str = "") -> HaveQuery:
    query = _decode(_have_decoder, body, "have", peer)
    if query.since < 0 or query.claims_seen < 0 or not query.wait >= 0:  # NaN fails this
        raise BadSwarmMessage(f"have since={query.since} wait={query.wait}", peer)
    return query


def decode_have_answer(body: bytes, peer: str = "") -> HaveAnswer:
    answer = _decode(_have_answer_decoder, body, "have answer", peer)
    if answer.version < 0 or answer.claims_version < 0:
        raise BadSwarmMessage(f"have versions {answer.version}, {answer.claims_version}", peer)
    return answer


def parse_root(raw: bytes, peer: str = "") -> Cid:
    try:
        return Cid.parse(raw)
    except CidError as exc:
        raise BadSwarmMessage(f"not a CID: {exc}", peer) from exc
