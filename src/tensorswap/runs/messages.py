"""The runs application on the wire: tagged requests (``op``) and one answer struct.

Runs requests are the bodies of REQUEST frames for the app ``"runs"`` on the coordinator's
port (beside ``"rounds"``), msgpack maps tagged by ``op``; each checks what it holds when
decoded (names within MAX_NAME_BYTES, CIDs, finite timeouts, a spec of at most
MAX_SPEC_BYTES), so a decoded request is a valid one. Answers leave out what they do not
carry. Layout in ``docs/runs.md``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import msgspec

from tensorswap.cid import Cid
from tensorswap.errors import InvalidCid
from tensorswap.rounds.protocol import MAX_NAME_BYTES, ErrorInfo, Param, StatusWire, utf8_len

if TYPE_CHECKING:
    from tensorswap.runs.model import Task

__all__ = [
    "APP",
    "MAX_SPEC_BYTES",
    "MAX_VERSIONS",
    "ContributeRequest",
    "CreateRunRequest",
    "HeartbeatRequest",
    "PartRequest",
    "PartWire",
    "RegisterRequest",
    "RunAnswer",
    "RunRequest",
    "RunRow",
    "RunsRequest",
    "SecAggRequest",
    "TaskRequest",
    "TaskWire",
    "VersionRow",
    "VersionsRequest",
    "task_wire",
]

APP = "runs"
"""The application name runs requests are addressed to."""

MAX_SPEC_BYTES = 16 * 1024
"""The longest run spec (JSON) a create request may carry."""


def _name(what: str, value: str, *, empty: bool = False) -> None:
    size = utf8_len(value)
    if size > MAX_NAME_BYTES or (size == 0 and not empty):
        raise ValueError(f"{what} is {size} bytes long; 1 to {MAX_NAME_BYTES} allowed")


def _cid(what: str, value: bytes) -> None:
    try:
        Cid.parse(value)
    except InvalidCid as exc:
        raise ValueError(f"{what} is not a CID: {exc.reason}") from None


class _RunRequest(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False, tag_field="op"
):
    peer: str = ""


class RegisterRequest(_RunRequest, frozen=True, tag="register"):
    """Register ``peer`` with a few facts (``num_samples``, tags; see ``check_facts``)."""

    facts: dict[str, Param] = {}

    def __post_init__(self) -> None:
        _name("a peer name", self.peer)


class HeartbeatRequest(_RunRequest, frozen=True, tag="heartbeat"):
    """``peer`` is alive (any request from it counts too)."""

    def __post_init__(self) -> None:
        _name("a peer name", self.peer)


class CreateRunRequest(_RunRequest, frozen=True, tag="create"):
    """Create run ``run`` from the model update ``initial`` (pushed before) with ``spec``
    (a RunSpec as JSON)."""

    run: str
    spec: str
    initial: bytes

    def __post_init__(self) -> None:
        _name("a run name", self.run)
        if len(self.spec) > MAX_SPEC_BYTES:
            raise ValueError(f"a run spec is at most {MAX_SPEC_BYTES} bytes")
        _cid("the initial model", self.initial)


class RunsRequest(_RunRequest, frozen=True, tag="runs"):
    """Every run (``run`` empty) or one, with the registry's counts."""

    run: str = ""

    def __post_init__(self) -> None:
        _name("a run name", self.run, empty=True)


class TaskRequest(_RunRequest, frozen=True, tag="task"):
    """``peer``'s next task in ``run``: answered at once when there is one, else when one
    appears or after ``timeout`` (the server's ``max_wait`` at most) with none."""

    run: str
    timeout: float | None = None

    def __post_init__(self) -> None:
        _name("a peer name", self.peer)
        _name("a run name", self.run)
        if self.timeout is not None and not (math.isfinite(self.timeout) and self.timeout >= 0):
            raise ValueError(f"a task timeout must be finite and >= 0, got {self.timeout!r}")


class ContributeRequest(_RunRequest, frozen=True, tag="contribute"):
    """Submit ``update`` (pushed before) to round ``round`` of ``run``; ``trained_on`` is the
    version it trained from (asynchronous runs: the update is a delta)."""

    run: str
    round: int
    update: bytes
    trained_on: int | None = None
    clipped: bool | None = None
    """A client-side clipping DP run: whether the peer had to clip its delta."""

    def __post_init__(self) -> None:
        _name("a peer name", self.peer)
        _name("a run name", self.run)
        _cid("the update", self.update)
        if self.round < 1 or (self.trained_on is not None and self.trained_on < 0):
            raise ValueError("round must be >= 1 and trained_on >= 0")


class VersionsRequest(_RunRequest, frozen=True, tag="versions"):
    """The versions of ``run`` from ``since`` on (at most MAX_VERSIONS per answer). With
    ``wait``, a request that finds none waits up to that many seconds (the server's
    ``max_wait`` at most) for version ``since`` to be made or the run to finish."""

    run: str
    since: int = 0
    wait: float | None = None

    def __post_init__(self) -> None:
        _name("a run name", self.run)
        if self.since < 0:
            raise ValueError("since must be >= 0")
        if self.wait is not None and not (math.isfinite(self.wait) and self.wait >= 0):
            raise ValueError(f"a versions wait must be finite and >= 0, got {self.wait!r}")


class PartRequest(_RunRequest, frozen=True, tag="part"):
    """A regional coordinator (``peer``: its name upstream) asks for its part of ``run``'s
    current round: the sampled peers it folds (``runs.regional``)."""

    run: str

    def __post_init__(self) -> None:
        _name("a region name", self.peer)
        _name("a run name", self.run)


MAX_SECAGG_MESSAGE = 1 << 20
"""The longest SecAgg+ message a ``secagg`` request carries inline (the masked vector, the
only large one, travels as a pushed block)."""

SECAGG_MESSAGES = 4
"""Server messages a peer receives in a secure round: setup, keys, shares, unmask request."""


class SecAggRequest(_RunRequest, frozen=True, tag="secagg"):
    """A SecAgg+ step of ``peer`` in round ``round`` of secure run ``run``. ``message`` (a
    msgpack SecAgg+ message, b"" for none) is the peer's answer to the current phase; the
    answer is the peer's server message number ``after`` (it holds ``after`` already: 0
    asks for the setup), or none when the phase is still open after ``timeout`` (ask
    again). A masked input's vector is the block ``block`` (codec tensorswap-masked, or raw
    from earlier peers), pushed before."""

    run: str
    round: int
    after: int
    message: bytes = b""
    block: bytes | None = None
    timeout: float | None = None

    def __post_init__(self) -> None:
        _name("a peer name", self.peer)
        _name("a run name", self.run)
        if self.round < 1 or not 0 <= self.after <= SECAGG_MESSAGES:
            raise ValueError(f"round must be >= 1 and after in 0..{SECAGG_MESSAGES}")
        if len(self.message) > MAX_SECAGG_MESSAGE:
            raise ValueError(f"a secagg message is at most {MAX_SECAGG_MESSAGE} bytes")
        if self.block is not None:
            _cid("the masked vector", self.block)
        if self.timeout is not None and not (math.isfinite(self.timeout) and self.timeout >= 0):
            raise ValueError(f"a secagg timeout must be finite and >= 0, got {self.timeout!r}")


MAX_VERSIONS = 256
"""The most versions one ``versions`` answer lists (ask again from the last one + 1)."""

RunRequest = (
    RegisterRequest
    | HeartbeatRequest
    | CreateRunRequest
    | RunsRequest
    | TaskRequest
    | ContributeRequest
    | VersionsRequest
    | SecAggRequest
    | PartRequest
)


class VersionRow(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """One version of a run's global model: its CIDs, the round, who made it, staleness."""

    version: int
    global_cid: str
    state_cid: str | None
    round: int
    participants: list[str]
    staleness: list[int]
    at: float
    epsilon: float | None = None
    """A DP run: its ε after this version's round (at the run's ``dp_delta``)."""
    participant_count: int = 0
    """How many peers' updates made it (``participants`` names them unless ``hidden``)."""
    hidden: bool = False
    """A DP run seen by a peer: ``participants`` is left empty (``runs.views``)."""
    you_took_part: bool | None = None
    """With ``hidden``: whether the asking peer's update is among them."""


class RunRow(msgspec.Struct, frozen=True, forbid_unknown_fields=False, omit_defaults=True):
    """One run as ``runs`` reports it (``deadline_s`` / ``deadline_reason``: the deadline an
    ``auto`` run chose for its current round and why; left out when unset)."""

    name: str
    mode: str
    version: int
    global_cid: str
    state_cid: str | None
    round: int
    selected: list[str]
    finished: bool
    optimizer: str
    strategy: str
    participants: list[str]
    created_at: float
    deadline_s: float | None = None
    deadline_reason: str = ""
    epsilon: float | None = None
    """A DP run's ε so far (at ``dp_delta``); None for a run without DP."""
    dp_delta: float | None = None
    stop_reason: str = ""
    """Why a run finished early (its privacy budget), "" otherwise."""
    secagg: bool = False
    """Whether the run aggregates securely (SecAgg+)."""
    selected_count: int = 0
    """How many peers the current round sampled (``selected`` names them unless hidden)."""
    participant_count: int = 0
    """How many peers made the last version (``participants`` names them unless hidden)."""
    hidden: bool = False
    """A DP run seen by a peer: ``selected`` and ``participants`` left empty, since the
    accountant's subsampling amplification needs the sample secret (``runs.views``)."""
    you_selected: bool | None = None
    """With ``hidden``: whether the asking peer is in the current round's sample."""
    you_took_part: bool | None = None
    """With ``hidden``: whether the asking peer's update made the last version."""


class TaskWire(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """A peer's task: train from ``global_cid`` (version ``version``), submit to ``round``."""

    run: str
    round: int
    version: int
    global_cid: str
    mode: str
    dp: str = ""
    clip: float | None = None
    secagg: bool = False


def task_wire(task: Task) -> TaskWire:
    """A ``RunManager.task`` as the wire carries it."""
    return TaskWire(
        task.run,
        task.round_id.round,
        task.version,
        str(task.global_cid),
        task.mode.value,
        task.dp,
        task.clip,
        task.secagg,
    )


class PartWire(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """A region's part of round ``round`` (training from version ``version``): fold the
    updates of ``covers`` (``fold`` False: relay each peer's on its own), submit once
    ``quorum`` of them are in, before the top's deadline (``left_s`` seconds; None: none)."""

    run: str
    round: int
    version: int
    global_cid: str
    fold: bool
    covers: list[str]
    quorum: int
    left_s: float | None = None


class RunAnswer(msgspec.Struct, frozen=True, forbid_unknown_fields=False, omit_defaults=True):
    """The answer to a runs request (``error`` set when refused)."""

    error: ErrorInfo | None = None
    runs: list[RunRow] | None = None
    task: TaskWire | None = None
    status: StatusWire | None = None
    clients: int | None = None
    active: int | None = None
    versions: list[VersionRow] | None = None
    secagg: bytes | None = None
    """A SecAgg+ server message for the asking peer (msgpack)."""
    secagg_peer: int | None = None
    """The asking peer's participant number in the secure round (with its setup)."""
    part: PartWire | None = None
    """A region's part of a round (``part``)."""


_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(RunRequest)
_answer_decoder = msgspec.msgpack.Decoder(RunAnswer)


def encode(message: RunRequest | RunAnswer) -> bytes:
    return _encoder.encode(message)


def decode_request(body: bytes) -> RunRequest:
    """A checked runs request; msgspec.ValidationError / DecodeError otherwise."""
    return _request_decoder.decode(body)


def decode_answer(body: bytes) -> RunAnswer:
    return _answer_decoder.decode(body)
