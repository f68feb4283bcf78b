"""The rounds messages: tagged msgspec Structs for requests (``op``) and statuses (``status``).

Requests are a tagged union on ``op`` (StartRequest, SubmitRequest, StatusRequest,
WaitRequest); each checks what it holds when it is built or decoded (names within
MAX_NAME_BYTES, a valid round id, a binary CID, a finite wait timeout), so a decoded request
is a valid one. Statuses are a tagged union on ``status`` mirroring ``rounds.core.model``'s
RoundStatus, field for field (checked at import). ``RoundCall`` is a request's layout on the
wire: every key in a fixed order, as the protocol has always sent it (``docs/rounds.md``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, get_args

import msgspec

from tensorswap.cid import Cid
from tensorswap.errors import InvalidCid
from tensorswap.rounds.core.model import (
    Aggregating,
    Collecting,
    Complete,
    Failed,
    Pending,
    RoundId,
    RoundStatus,
)

__all__ = [
    "MAX_LAYER_DIMS",
    "MAX_LAYER_ELEMENTS",
    "MAX_NAME_BYTES",
    "AggregatingWire",
    "CollectingWire",
    "CompleteWire",
    "ErrorInfo",
    "FailedWire",
    "PendingWire",
    "RoundAnswer",
    "RoundCall",
    "RoundRequest",
    "RoundRow",
    "SpecWire",
    "StartRequest",
    "StatusRequest",
    "StatusWire",
    "SubmitRequest",
    "WaitRequest",
    "layout_of",
    "status_to_wire",
]

MAX_NAME_BYTES = 256
"""The longest initiator, peer, strategy, parameter name or value, layer name or dtype a
server accepts, in UTF-8 bytes. Longer names are refused (see ``round_id_of``, ``peer_of``,
``spec_from_wire``), so no string a client sends can swell the answers other clients read."""

MAX_LAYER_DIMS = 64
"""The most dimensions a layer of a round's ``layout`` may have (numpy's own limit)."""

MAX_LAYER_ELEMENTS = 2**48
"""The most elements a layer of a round's ``layout`` may have (the product of its dims)."""

Param = float | int | str


def utf8_len(value: str) -> int:
    return len(value.encode("utf-8", "surrogatepass"))


class SpecWire(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """A RoundSpec on the wire; ``layout`` is ``[[name, dtype, [dims...]], ...]``."""

    expected_peers: int
    quorum: int | None = None
    timeout_s: float | None = None
    strategy: str = "fedavg"
    params: dict[str, Param] = {}
    layout: list[tuple[str, str, list[int]]] | None = None


# ── requests ─────────────────────────────────────────────────────────────────
class _Request(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False, tag_field="op"
):
    """A rounds request about round ``(round, initiator)``. Keys that are not the op's
    (e.g. ``update`` in a start) are ignored when decoding, as are unknown ones."""

    round: int = 0
    initiator: str = ""

    @property
    def round_id(self) -> RoundId:
        return RoundId(self.round, self.initiator)

    def _check_round_id(self) -> None:
        """ValueError unless ``round`` and ``initiator`` make a valid RoundId."""
        size = utf8_len(self.initiator)
        if size > MAX_NAME_BYTES:
            raise ValueError(
                f"bad round id in a rounds request: the initiator is {size} bytes long; "
                f"at most {MAX_NAME_BYTES} allowed"
            )
        try:
            RoundId(self.round, self.initiator)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"bad round id in a rounds request: {exc}") from None


class StartRequest(_Request, frozen=True, tag="start"):
    """Start the round with ``spec`` (answered ``started``: False if it already existed)."""

    spec: SpecWire

    def __post_init__(self) -> None:
        self._check_round_id()


class SubmitRequest(_Request, frozen=True, tag="submit"):
    """Submit the model update ``update`` (a binary CID) for ``peer``; its blocks were sent
    before this request. A byte string that is not a CID is refused when decoding.

    ``timeout`` (seconds, finite, >= 0): once the contribution is durable, hold the answer
    until the round is terminal, that long at most (and the server's ``max_wait``), so the
    submit and the wait for the result are one round trip; the answer is the status then,
    never a RoundTimeout. None (the default, the bytes the protocol has always had): answer
    at once. A server that predates it ignores the key and answers at once."""

    peer: str
    update: bytes
    timeout: float | None = None

    def __post_init__(self) -> None:
        self._check_round_id()
        _check_timeout("a submit's wait", self.timeout)
        size = utf8_len(self.peer)
        if not 0 < size <= MAX_NAME_BYTES:
            raise ValueError(
                f"a submit request's peer name is {size} bytes long; 1 to {MAX_NAME_BYTES} allowed"
            )
        try:
            Cid.parse(self.update)
        except InvalidCid as exc:
            raise ValueError(f"a submit request names an invalid CID: {exc.reason}") from None

    @classmethod
    def of(
        cls, round_id: RoundId, peer: str, update: Cid, timeout: float | None = None
    ) -> SubmitRequest:
        rid, cid = round_id, update.to_bytes()
        return cls(round=rid.round, initiator=rid.initiator, peer=peer, update=cid, timeout=timeout)

    @property
    def cid(self) -> Cid:
        """The update's CID (checked when this request was built or decoded)."""
        return Cid.parse(self.update)


class StatusRequest(_Request, frozen=True, tag="status"):
    """The status of one round, or with ``all`` every round and the server's counters (then
    ``round`` and ``initiator`` are not read)."""

    all: bool = False

    def __post_init__(self) -> None:
        if not self.all:
            self._check_round_id()


class WaitRequest(_Request, frozen=True, tag="wait"):
    """Wait until the round is terminal: ``timeout`` seconds (finite, >= 0) or, when None,
    the server's ``max_wait`` at most."""

    timeout: float | None = None

    def __post_init__(self) -> None:
        self._check_round_id()
        _check_timeout("a wait", self.timeout)


def _check_timeout(what: str, timeout: float | None) -> None:
    if timeout is not None and not (math.isfinite(timeout) and timeout >= 0):
        raise ValueError(f"{what} timeout must be a finite number of seconds >= 0, got {timeout!r}")


RoundRequest = StartRequest | SubmitRequest | StatusRequest | WaitRequest
"""A rounds request, tagged by ``op``."""


class RoundCall(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """A request's layout on the wire: ``op`` and every other key, nil or empty where the op
    does not use it, in this order. ``encode_call`` writes typed requests in it (the bytes
    the protocol has always had); tools and tests build one to send any request at all."""

    op: str
    round: int = 0
    initiator: str = ""
    peer: str = ""
    spec: SpecWire | None = None
    timeout: float | None = None
    all: bool = False
    update: bytes | None = None


def layout_of(request: RoundRequest) -> RoundCall:
    """``request`` as the wire lays it out (every RoundCall key)."""
    return RoundCall(str(request.__struct_config__.tag), **msgspec.structs.asdict(request))


# ── statuses ─────────────────────────────────────────────────────────────────
class _StatusWire(
    msgspec.Struct,
    frozen=True,
    omit_defaults=True,
    forbid_unknown_fields=False,
    tag_field="status",
):
    """A RoundStatus on the wire: ``{"status": name, **fields}``.

    Fields with a default are left out while they hold it, so an optional field added
    later changes no bytes until it is set. Reads like the dict it used to be:
    ``row.status["status"]``, ``row.status.get("cid")``.
    """

    model: ClassVar[type]

    def to_status(self) -> RoundStatus:
        """The RoundStatus this is."""
        return self.model(**msgspec.structs.asdict(self))

    def to_dict(self) -> dict[str, object]:
        """``RoundStatus.to_dict()``: the name under ``"status"``, then every field."""
        return self.to_status().to_dict()

    def __getitem__(self, key: str) -> object:
        if key == "status":
            return self.__struct_config__.tag
        if key in self.__struct_fields__:
            return getattr(self, key)
        raise KeyError(key)

    def get(self, key: str, default: object = None) -> object:
        try:
            return self[key]
        except KeyError:
            return default


class PendingWire(_StatusWire, frozen=True, tag="Pending"):
    model = Pending


class CollectingWire(_StatusWire, frozen=True, tag="Collecting"):
    model = Collecting
    received: int
    expected: int


class AggregatingWire(_StatusWire, frozen=True, tag="Aggregating"):
    """``reason`` names a transient failure being retried (left out when empty)."""

    model = Aggregating
    reason: str = ""


class CompleteWire(_StatusWire, frozen=True, tag="Complete"):
    """``cid`` is the aggregate's CID in string form, checked when built or decoded."""

    model = Complete
    cid: str

    def __post_init__(self) -> None:
        try:
            Cid.parse(self.cid)
        except InvalidCid as exc:
            raise ValueError(f"a Complete status names an invalid CID: {exc.reason}") from None


class FailedWire(_StatusWire, frozen=True, tag="Failed"):
    model = Failed
    reason: str


StatusWire = PendingWire | CollectingWire | AggregatingWire | CompleteWire | FailedWire
"""A round status on the wire, tagged by ``status``."""

_WIRE_OF: dict[type, type[_StatusWire]] = {cls.model: cls for cls in get_args(StatusWire)}


def status_to_wire(status: RoundStatus) -> StatusWire:
    """``status`` on the wire (the same fields)."""
    cls = _WIRE_OF[type(status)]
    return cls(**{name: getattr(status, name) for name in cls.__struct_fields__})  # type: ignore[return-value]


def _check_statuses() -> None:
    """Every RoundStatus has a wire struct with its name as tag and its fields in order."""
    for model in get_args(RoundStatus):
        wire = _WIRE_OF.get(model)
        if wire is None:
            raise TypeError(f"rounds.protocol has no wire struct for status {model.__name__}")
        fields = tuple(f.name for f in dataclasses.fields(model))
        if wire.__struct_config__.tag != model.name or wire.__struct_fields__ != fields:
            raise TypeError(
                f"{wire.__name__} must be tagged {model.name!r} with fields {fields}, "
                f"has {wire.__struct_config__.tag!r} with {wire.__struct_fields__}"
            )


def _check_requests() -> None:
    """Every request's fields are RoundCall keys (so ``layout_of`` can lay it out)."""
    for cls in get_args(RoundRequest):
        extra = set(cls.__struct_fields__) - set(RoundCall.__struct_fields__)
        if extra or not isinstance(cls.__struct_config__.tag, str):
            raise TypeError(f"{cls.__name__} does not fit RoundCall: {sorted(extra)}")


_check_statuses()
_check_requests()


# ── answers ──────────────────────────────────────────────────────────────────
class ErrorInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """A refused request: the RoundsError leaf's name, its message and its facts."""

    code: str
    message: str
    facts: dict[str, Param | None] = {}


class RoundRow(msgspec.Struct, frozen=True, forbid_unknown_fields=False, omit_defaults=True):
    """One round as ``status`` reports it; ``dropped`` (left out while empty) lists the
    accepted contributions left out of its aggregate, as ``[peer, reason]``. ``hidden``: a
    DP run's round shown to a peer, its ``peers`` and ``dropped`` left empty (``received``
    still counts them). ``deterministic`` (left out while false): the round folds its
    contributions in peer-name order when it closes (``RoundSpec.deterministic``)."""

    round: int
    initiator: str
    status: StatusWire
    received: int
    expected: int
    quorum: int
    strategy: str
    nbytes: int
    peers: list[str]
    created_at: float
    deadline: float | None
    dropped: list[tuple[str, str]] = []
    hidden: bool = False
    deterministic: bool = False


class RoundAnswer(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """The answer to any request: ``error`` set when refused; otherwise what the op returns.

    Not a tagged union: the answer carries no tag on the wire (the client knows what it
    asked). ``omitted`` counts the rounds a ``status`` answer leaves out to stay within the
    server's message limit (None or 0: every round is listed).
    """

    error: ErrorInfo | None = None
    started: bool | None = None
    status: StatusWire | None = None
    rounds: list[RoundRow] | None = None
    stats: dict[str, Param] | None = None
    omitted: int | None = None
