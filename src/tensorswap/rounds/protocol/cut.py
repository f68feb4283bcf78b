"""Cut-through rounds on the wire: announce an update, then stream the result as it is folded.

Two applications beside ``"rounds"`` (a coordinator that predates them answers "no handler",
``unsupported``, and the client goes on as a barrier round):

- ``"rounds/announce"``: an ``AnnounceRequest`` carries a peer's update CID and its manifest
  blocks (the update's and each tensor's, at most ``MAX_ANNOUNCE_BYTES`` in all) before any
  chunk is pushed. The answer, an ``AnnounceAnswer``, says whether the update takes part in
  the round's cut-through, why not, and the coordinator's result chunk size (an update cut
  in other chunks cannot take part; the client cuts the next one so). With per-peer keys the
  request carries the peer's ``submit_proof`` for the contribution.
- ``"rounds/stream"``: a ``StreamRequest`` asks for the result's chunks stored after the
  first ``after`` (the client's count so far), waiting up to ``timeout`` seconds for one. Its
  answer, a ``StreamAnswer``, lists them (``chunks``) and the blocks follow the REPLY (as a
  Get with ``closure`` would bring them: ``wire.BlocksReply``); once the round is terminal
  it carries the status instead, and a Complete one is followed by whatever of the result the
  client lacks (all but the chunks it was streamed and its own update's blocks).
  ``own`` lists the chunks that are blocks of the client's own update (a frozen layer's
  pieces), which do not follow. ``abandoned`` says the round went back to the barrier
  (then the client fetches as usual).
"""

from __future__ import annotations

import math
from typing import TypeVar

import msgspec

from tensorswap.cid import Cid
from tensorswap.errors import InvalidCid
from tensorswap.rounds.protocol.batch import PROOF_BYTES
from tensorswap.rounds.protocol.messages import MAX_NAME_BYTES, StatusWire, _Request, utf8_len
from tensorswap.wire import ProtocolViolation

__all__ = [
    "APP_ANNOUNCE",
    "APP_STREAM",
    "MAX_ANNOUNCE_BYTES",
    "MAX_STREAM_CHUNKS",
    "AnnounceAnswer",
    "AnnounceRequest",
    "StreamAnswer",
    "StreamRequest",
    "decode_announce",
    "decode_announce_answer",
    "decode_stream",
    "decode_stream_answer",
    "encode",
]

APP_ANNOUNCE = "rounds/announce"
APP_STREAM = "rounds/stream"

MAX_ANNOUNCE_BYTES = 8 * 1024 * 1024
"""The most manifest bytes (in all) one announcement may carry."""

MAX_STREAM_CHUNKS = 1024
"""The most chunks one stream answer lists (the rest come with the next)."""


class AnnounceRequest(_Request, frozen=True, omit_defaults=True, tag="announce"):
    """``peer`` will push update ``update`` (a binary CID) to the round; ``blocks`` are its
    manifests as ``[cid, bytes]`` pairs."""

    peer: str
    update: bytes
    blocks: list[tuple[bytes, bytes]]
    proof: bytes = b""

    def __post_init__(self) -> None:
        self._check_round_id()
        if not 0 < utf8_len(self.peer) <= MAX_NAME_BYTES:
            raise ValueError("an announcement's peer name is empty or too long")
        if len(self.proof) not in (0, PROOF_BYTES):
            raise ValueError(f"an announcement's proof is {len(self.proof)} bytes")
        total = sum(len(data) for _, data in self.blocks)
        if total > MAX_ANNOUNCE_BYTES:
            raise ValueError(f"an announcement carries {total} bytes of manifests")
        try:
            Cid.parse(self.update)
            for cid, _ in self.blocks:
                Cid.parse(cid)
        except InvalidCid as exc:
            raise ValueError(f"an announcement names an invalid CID: {exc.reason}") from None

    @property
    def cid(self) -> Cid:
        return Cid.parse(self.update)

    def manifests(self) -> dict[Cid, bytes]:
        return {Cid.parse(cid): data for cid, data in self.blocks}


class AnnounceAnswer(msgspec.Struct, frozen=True, omit_defaults=True):
    """Whether the announced update takes part (``ok``), why not, and the coordinator's
    result chunk size in bytes."""

    ok: bool
    reason: str = ""
    chunk_bytes: int = 0


class StreamRequest(_Request, frozen=True, tag="stream"):
    """The result chunks after the first ``after``, for ``peer`` (whose own update's blocks
    need not be sent), waiting up to ``timeout`` seconds for one."""

    peer: str
    after: int = 0
    timeout: float = 30.0
    ready: bool | None = None
    """Whether the client was told every expected peer has announced (True: no answer only
    to say so); None: a client that predates ``StreamAnswer.ready``, never told (it would ask
    again at once, and again)."""

    def __post_init__(self) -> None:
        self._check_round_id()
        if not 0 < utf8_len(self.peer) <= MAX_NAME_BYTES:
            raise ValueError("a stream request's peer name is empty or too long")
        if isinstance(self.after, bool) or self.after < 0:
            raise ValueError(f"a stream request's 'after' must be >= 0, got {self.after}")
        if not (math.isfinite(self.timeout) and self.timeout >= 0):
            raise ValueError(f"a stream request's timeout must be >= 0, got {self.timeout}")


class StreamAnswer(msgspec.Struct, frozen=True, omit_defaults=True):
    """New result chunks (binary CIDs, their blocks behind the reply), or the terminal
    status, or why the round went back to the barrier."""

    chunks: list[bytes] = []
    status: StatusWire | None = None
    abandoned: str = ""
    own: list[int] = []
    """Indexes in ``chunks`` of blocks of the client's own announced update (a frozen
    layer's pieces): listed, not sent behind the reply."""
    ready: bool = False
    """Every expected peer has announced: pieces fold from now on (the client paces its
    upload by them, ``rounds.client._cut_gate``). Sent once, without chunks, to a client that
    did not know; any answer with chunks implies it."""

    def chunk_cids(self) -> list[Cid]:
        return [Cid.parse(c) for c in self.chunks]

    def sent_cids(self) -> list[Cid]:
        """The chunks whose blocks follow the reply (all but ``own``)."""
        own = set(self.own)
        return [Cid.parse(c) for i, c in enumerate(self.chunks) if i not in own]


T = TypeVar("T")

_encoder = msgspec.msgpack.Encoder()
_announce = msgspec.msgpack.Decoder(AnnounceRequest)
_stream = msgspec.msgpack.Decoder(StreamRequest)


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decode_announce(body: bytes) -> AnnounceRequest:
    """The announcement in a REQUEST body; ProtocolViolation for anything else."""
    return _decode(_announce, body, "announcement")


def decode_stream(body: bytes) -> StreamRequest:
    """The stream request in a REQUEST body; ProtocolViolation for anything else."""
    return _decode(_stream, body, "stream request")


def _decode(decoder: msgspec.msgpack.Decoder[T], body: bytes, what: str) -> T:
    try:
        return decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise ProtocolViolation(f"bad {what}: {exc}") from exc
    except RecursionError:
        raise ProtocolViolation(f"bad {what}: nested too deeply") from None


_announce_answer = msgspec.msgpack.Decoder(AnnounceAnswer)
_stream_answer = msgspec.msgpack.Decoder(StreamAnswer)


def decode_announce_answer(body: bytes) -> AnnounceAnswer:
    """The coordinator's answer to an announcement; ProtocolViolation for anything else."""
    return _decode(_announce_answer, body, "announce answer")


def decode_stream_answer(body: bytes) -> StreamAnswer:
    """The coordinator's answer to a stream request; ProtocolViolation for anything else."""
    return _decode(_stream_answer, body, "stream answer")
