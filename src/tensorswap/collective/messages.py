"""The collective's messages: the rendezvous app on a serve port and a peer's slice app."""

from __future__ import annotations

import enum
import math
from typing import TypeVar

import msgspec

from tensorswap.collective.errors import BadCollectiveMessage

__all__ = [
    "APP",
    "MAX_CHUNKS",
    "MAX_MEMBERS",
    "MAX_NAME",
    "MAX_RELAY_BLOCK",
    "MAX_WAIT",
    "PEER_APP",
    "Accuse",
    "Answer",
    "CallView",
    "Commit",
    "CommitInfo",
    "Delivered",
    "Done",
    "Fault",
    "Join",
    "JoinAnswer",
    "Member",
    "Poll",
    "Reduced",
    "ReducedInfo",
    "RelayPut",
    "RendezvousCall",
    "ResultRoot",
    "SliceSent",
    "decode_answer",
    "decode_call",
    "decode_join_answer",
    "decode_slice",
    "decode_view",
    "encode",
]

APP = "collective"
"""The rendezvous's application name on a serve port (``BlockServer.handlers`` key)."""
PEER_APP = "collective-slice"
"""A peer's own application: "the blocks just pushed are my slice j of call c"."""
MAX_NAME = 128
"""Longest group or peer name, or host."""
MAX_MEMBERS = 256
"""Most peers in one group."""
MAX_CHUNKS = 1 << 16
"""Most chunks one peer commits to in one call."""
MAX_RELAY_BLOCK = 4 * (1 << 20) + 4096
"""Largest block a ``RelayPut`` carries (a float32 chunk and its codec's header)."""
MAX_WAIT = 2.0
"""Longest a poll or join waits at the rendezvous for news (seconds)."""
_CID_BYTES = 64


class _Base(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    pass


class Member(_Base, frozen=True):
    peer: str
    host: str
    port: int
    relayed: bool = False
    """It accepts no connections (port 0): pushes to it and fetches of its reduced slices
    go through the rendezvous (``RelayPut``)."""


class Join(_Base, frozen=True, tag="join", tag_field="op"):
    """Peer -> rendezvous: ``peer`` joins ``group`` (of ``size`` peers), serving slices at
    ``host:port`` (empty host: the address the request came from). Waits up to ``wait``."""

    group: str
    peer: str
    size: int
    host: str
    port: int
    wait: float = 0.0
    relayed: bool = False


class Commit(_Base, frozen=True, tag="commit", tag_field="op"):
    """Peer -> rendezvous: my input to ``call``: its ``weight``, the digest of its tensor
    names/shapes (``layout``) and the CID of each chunk, before any chunk is sent."""

    group: str
    call: int
    peer: str
    weight: float
    layout: bytes
    chunks: list[bytes]


class Poll(_Base, frozen=True, tag="poll", tag_field="op"):
    """Peer -> rendezvous: the state of ``call`` once its version passes ``version`` (or
    after ``wait`` seconds). A poll is also the peer's sign of life."""

    group: str
    call: int
    peer: str
    version: int = -1
    wait: float = 0.0


class Reduced(_Base, frozen=True, tag="reduced", tag_field="op"):
    """Reducer -> rendezvous: slice ``slice`` of ``call`` reduced over ``contributors``,
    stored as these chunks (CIDs), served by the reducer."""

    group: str
    call: int
    peer: str
    slice: int
    contributors: list[str]
    chunks: list[bytes]


class Fault(enum.StrEnum):
    """What an accusation says of its suspect."""

    DEAD = "dead"
    """It looks dead (a push to it failed): the rendezvous probes its port."""
    MISMATCH = "mismatch"
    """It sent bytes it did not commit to, or a block that does not hash to its CID: it is
    excluded and named in ``liars``."""
    STALLED = "stalled"
    """It committed, but its push has not arrived long after the throughput this reducer
    measured explains: it is dropped."""


class Accuse(_Base, frozen=True, tag="accuse", tag_field="op"):
    """Peer -> rendezvous: ``suspect`` is at fault in ``call``, as ``kind`` says."""

    group: str
    call: int
    peer: str
    suspect: str
    reason: str
    kind: Fault = Fault.DEAD


class Delivered(_Base, frozen=True, tag="delivered", tag_field="op"):
    """Peer -> rendezvous: ``reducer`` answered my notice of slice ``slice`` (it stores
    every chunk of it I pushed): what the rule for a reducer that never publishes counts."""

    group: str
    call: int
    peer: str
    slice: int
    reducer: str


class Done(_Base, frozen=True, tag="done", tag_field="op"):
    """Peer -> rendezvous: my result root for ``call``; answered with a mismatch if any."""

    group: str
    call: int
    peer: str
    root: bytes


class RelayPut(_Base, frozen=True, tag="relay", tag_field="op"):
    """Peer -> rendezvous: one block for a relayed member in ``call``: ``peer``'s committed
    chunk of slice ``slice`` for its relayed reducer, or (``reduced``) the relayed reducer's
    own reduced chunk of that slice. ``data`` must hash to ``cid``."""

    group: str
    call: int
    peer: str
    slice: int
    cid: bytes
    data: bytes
    reduced: bool = False


RendezvousCall = Join | Commit | Poll | Reduced | Accuse | Done | RelayPut | Delivered


class JoinAnswer(_Base, frozen=True):
    """Rendezvous -> peer: ``formed`` once the group has its size; ``members`` then, and the
    first ``call`` this peer takes part in."""

    formed: bool = False
    members: list[Member] = msgspec.field(default_factory=list)
    call: int = 0
    have: int = 0
    error: str | None = None


class ReducedInfo(_Base, frozen=True):
    reducer: str
    contributors: list[str]
    chunks: list[bytes]


class CommitInfo(_Base, frozen=True):
    weight: float
    layout: bytes
    chunks: list[bytes]


class CallView(_Base, frozen=True):
    """The rendezvous's view of one call: who takes part, their commitments, who was dropped
    (and why), which participant reduces each slice, the reduced slices, and ``final`` (the
    contributors of every reduced slice) once the call is sealed."""

    call: int
    version: int
    participants: list[Member]
    size: int
    commits: dict[str, CommitInfo] = msgspec.field(default_factory=dict)
    dropped: dict[str, str] = msgspec.field(default_factory=dict)
    liars: list[str] = msgspec.field(default_factory=list)
    assign: list[str] = msgspec.field(default_factory=list)
    reduced: dict[int, ReducedInfo] = msgspec.field(default_factory=dict)
    final: list[str] | None = None
    roots: dict[str, bytes] = msgspec.field(default_factory=dict)
    error: str | None = None
    relayed: dict[str, list[int]] = msgspec.field(default_factory=dict)
    """Per participant, the slices whose committed chunks the relay holds for their
    relayed reducer."""


class Answer(_Base, frozen=True):
    """Rendezvous -> peer, for commit / reduced / accuse / done: ``error`` when refused."""

    error: str | None = None
    view: CallView | None = None


class SliceSent(_Base, frozen=True):
    """Peer -> reducer (the reducer's own port): the blocks just pushed on this connection
    are ``peer``'s chunks of slice ``slice`` in ``call``; or (``reduced``) reducer -> member:
    they are ``peer``'s reduced chunks of its slice ``slice``, pushed as they were folded
    (what the member still lacks once the call is sealed, it fetches)."""

    group: str
    call: int
    peer: str
    slice: int
    chunks: list[bytes]
    reduced: bool = False


class ResultRoot(_Base, frozen=True):
    """What a call's result root CID names: the layout digest, the contributors in order
    and every reduced chunk's CID in order."""

    layout: bytes
    final: list[str]
    chunks: list[bytes]


_T = TypeVar("_T")
_call_decoder = msgspec.msgpack.Decoder(RendezvousCall)
_join_decoder = msgspec.msgpack.Decoder(JoinAnswer)
_answer_decoder = msgspec.msgpack.Decoder(Answer)
_view_decoder = msgspec.msgpack.Decoder(CallView)
_slice_decoder = msgspec.msgpack.Decoder(SliceSent)
_encoder = msgspec.msgpack.Encoder()


def encode(message: _Base) -> bytes:
    return _encoder.encode(message)


def _decode(decoder: msgspec.msgpack.Decoder[_T], body: bytes, what: str, peer: str) -> _T:
    try:
        return decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BadCollectiveMessage(f"undecodable {what}: {exc}", peer) from exc


def _name(value: str, what: str, peer: str) -> None:
    if not value or len(value) > MAX_NAME:
        raise BadCollectiveMessage(f"{what} {value[:MAX_NAME]!r}: 1 to {MAX_NAME} chars", peer)


def _cids(values: list[bytes], peer: str) -> None:
    if len(values) > MAX_CHUNKS:
        raise BadCollectiveMessage(f"{len(values)} chunks, over {MAX_CHUNKS}", peer)
    for raw in values:
        if not 0 < len(raw) <= _CID_BYTES:
            raise BadCollectiveMessage(f"a CID of {len(raw)} bytes", peer)


def _bounded_wait(wait: float, peer: str) -> None:
    if not (0.0 <= wait <= MAX_WAIT):  # NaN fails this
        raise BadCollectiveMessage(f"wait {wait} outside 0..{MAX_WAIT}", peer)


def decode_call(body: bytes, peer: str = "") -> RendezvousCall:
    """A rendezvous request, every name, count and number in it bounded."""
    call = _decode(_call_decoder, body, "rendezvous call", peer)
    _name(call.group, "group", peer)
    _name(call.peer, "peer", peer)
    if isinstance(call, Join):
        if not 1 <= call.size <= MAX_MEMBERS:
            raise BadCollectiveMessage(f"size {call.size} outside 1..{MAX_MEMBERS}", peer)
        if len(call.host) > MAX_NAME or not (call.relayed or 0 < call.port < 65536):
            raise BadCollectiveMessage(f"address {call.host[:MAX_NAME]}:{call.port}", peer)
        _bounded_wait(call.wait, peer)
        return call
    if call.call < 0:
        raise BadCollectiveMessage(f"call {call.call}", peer)
    if isinstance(call, Commit):
        if not (math.isfinite(call.weight) and call.weight > 0):
            raise BadCollectiveMessage(f"weight {call.weight}: finite and positive", peer)
        if len(call.layout) != 32:
            raise BadCollectiveMessage(f"a layout digest of {len(call.layout)} bytes", peer)
        _cids(call.chunks, peer)
    elif isinstance(call, Poll):
        _bounded_wait(call.wait, peer)
    elif isinstance(call, Reduced):
        if len(call.contributors) > MAX_MEMBERS or not 0 <= call.slice < MAX_MEMBERS:
            raise BadCollectiveMessage(f"slice {call.slice} / contributors", peer)
        _cids(call.chunks, peer)
    elif isinstance(call, Accuse):
        _name(call.suspect, "suspect", peer)
        if len(call.reason) > 1024:
            raise BadCollectiveMessage("an accusation's reason over 1024 chars", peer)
    elif isinstance(call, RelayPut):
        if not 0 < len(call.cid) <= _CID_BYTES or len(call.data) > MAX_RELAY_BLOCK:
            raise BadCollectiveMessage(f"a relayed block of {len(call.data)} bytes", peer)
        if not 0 <= call.slice < MAX_MEMBERS:
            raise BadCollectiveMessage(f"slice {call.slice}", peer)
    elif isinstance(call, Delivered):
        _name(call.reducer, "reducer", peer)
        if not 0 <= call.slice < MAX_MEMBERS:
            raise BadCollectiveMessage(f"slice {call.slice}", peer)
    elif isinstance(call, Done) and not 0 < len(call.root) <= _CID_BYTES:
        raise BadCollectiveMessage(f"a root of {len(call.root)} bytes", peer)
    return call


def decode_join_answer(body: bytes, peer: str = "") -> JoinAnswer:
    answer = _decode(_join_decoder, body, "join answer", peer)
    if len(answer.members) > MAX_MEMBERS:
        raise BadCollectiveMessage(f"{len(answer.members)} members, over {MAX_MEMBERS}", peer)
    for member in answer.members:
        _name(member.peer, "member", peer)
        if not member.host or not (member.relayed or 0 < member.port < 65536):
            raise BadCollectiveMessage(f"member at {member.host}:{member.port}", peer)
    return answer


def _check_view(view: CallView, peer: str) -> CallView:
    if len(view.participants) > MAX_MEMBERS or len(view.assign) > MAX_MEMBERS:
        raise BadCollectiveMessage("a call view over the member limit", peer)
    for info in view.commits.values():
        _cids(info.chunks, peer)
    if len(view.relayed) > MAX_MEMBERS or any(len(s) > MAX_MEMBERS for s in view.relayed.values()):
        raise BadCollectiveMessage("a call view's relay notes over the member limit", peer)
    return view


def decode_answer(body: bytes, peer: str = "") -> Answer:
    answer = _decode(_answer_decoder, body, "answer", peer)
    if answer.view is not None:
        _check_view(answer.view, peer)
    return answer


def decode_view(body: bytes, peer: str = "") -> CallView:
    return _check_view(_decode(_view_decoder, body, "call view", peer), peer)


def decode_slice(body: bytes, peer: str = "") -> SliceSent:
    sent = _decode(_slice_decoder, body, "slice", peer)
    _name(sent.peer, "peer", peer)
    _cids(sent.chunks, peer)
    if not 0 <= sent.slice < MAX_MEMBERS or sent.call < 0:
        raise BadCollectiveMessage(f"slice {sent.slice} of call {sent.call}", peer)
    return sent
