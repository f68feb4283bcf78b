"""The rounds application on the wire: typed requests and answers in REQUEST / REPLY frames.

A rounds request is the body of a wire REQUEST frame for the application ``"rounds"`` and
its answer the body of the REPLY (the wire's public extension point: ``BlockServer``
``handlers`` and ``BlockClient.request``). Both bodies are msgpack maps: a request is one of
the ``op``-tagged structs of ``rounds.protocol.messages``, laid out as ``RoundCall``; an answer is a
``RoundAnswer`` whose statuses are ``status``-tagged. A server without a rounds handler
replies ``handled=False``. Layout in ``docs/rounds.md``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import get_args

import msgspec

from tensorswap.errors import TensorSwapError, remote_types
from tensorswap.rounds.core.errors import InvalidRoundSpec
from tensorswap.rounds.core.state import LayerSpec, RoundId, RoundInfo, RoundSpec
from tensorswap.rounds.protocol.messages import (
    MAX_LAYER_DIMS,
    MAX_LAYER_ELEMENTS,
    MAX_NAME_BYTES,
    AggregatingWire,
    CollectingWire,
    CompleteWire,
    ErrorInfo,
    FailedWire,
    Param,
    PendingWire,
    RoundAnswer,
    RoundCall,
    RoundRequest,
    RoundRow,
    SpecWire,
    StartRequest,
    StatusRequest,
    StatusWire,
    SubmitRequest,
    WaitRequest,
    layout_of,
    status_to_wire,
    utf8_len,
)
from tensorswap.wire.errors import ProtocolViolation, RemoteError

__all__ = [
    "APP",
    "MAX_LAYER_DIMS",
    "MAX_LAYER_ELEMENTS",
    "MAX_NAME_BYTES",
    "OPS",
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
    "decode_answer",
    "decode_call",
    "encode_answer",
    "encode_call",
    "error_info",
    "layout_of",
    "peer_of",
    "raise_remote",
    "round_id_of",
    "row_of",
    "spec_from_wire",
    "spec_to_wire",
    "status_to_wire",
]

MAX_REASON_CHARS = 400
"""How much of a dropped contribution's reason a status row carries."""


APP = "rounds"
"""The application name rounds requests are addressed to (``Request.app``)."""

OPS = ("start", "submit", "status", "wait")
"""Rounds requests: start a round, submit the committed update, status (one or all), wait."""

if tuple(cls.__struct_config__.tag for cls in get_args(RoundRequest)) != OPS:
    raise TypeError(f"OPS {OPS} do not name the RoundRequest structs' tags in order")

_encoder = msgspec.msgpack.Encoder()
_call_decoder = msgspec.msgpack.Decoder(RoundRequest)
_answer_decoder = msgspec.msgpack.Decoder(RoundAnswer)


def encode_call(call: RoundRequest | RoundCall) -> bytes:
    """The REQUEST body carrying ``call``: a typed request in the RoundCall layout (every
    key, in order), or a RoundCall as it is."""
    if not isinstance(call, RoundCall):
        call = layout_of(call)
    return _encoder.encode(call)


def decode_call(body: bytes) -> RoundRequest:
    """The request in a client's REQUEST body, checked (see ``rounds.protocol.messages``).

    ProtocolViolation for anything else: not msgpack, nested too deeply, an unknown ``op``,
    a key of the wrong type, a bad round id, peer name or CID, a bad wait timeout.
    """
    try:
        return _call_decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise ProtocolViolation(f"bad rounds request: {exc}") from exc
    except RecursionError:
        raise ProtocolViolation("bad rounds request: nested too deeply") from None


def encode_answer(answer: RoundAnswer) -> bytes:
    """The REPLY body carrying ``answer``."""
    return _encoder.encode(answer)


def decode_answer(body: bytes) -> RoundAnswer:
    """A RoundAnswer from the coordinator's REPLY body; ProtocolViolation when it is none
    (a status with an unknown name or a bad CID included)."""
    try:
        return _answer_decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise ProtocolViolation(f"bad rounds answer: {exc}") from exc
    except RecursionError:
        raise ProtocolViolation("bad rounds answer: nested too deeply") from None


def spec_to_wire(spec: RoundSpec) -> SpecWire:
    layout = None
    if spec.layout is not None:
        layout = [(layer.name, layer.dtype, list(layer.shape)) for layer in spec.layout]
    return SpecWire(
        spec.expected_peers,
        spec.quorum,
        spec.timeout_s,
        spec.strategy,
        spec.stored_params(),
        layout,
    )


def spec_from_wire(wire: SpecWire) -> RoundSpec:
    """The RoundSpec (InvalidRoundSpec when it cannot work).

    Names longer than MAX_NAME_BYTES (strategy, parameter names and string values, layer
    names and dtypes) and layer shapes with a negative dim, more than MAX_LAYER_DIMS dims or
    more than MAX_LAYER_ELEMENTS elements are refused too.
    """
    _check_spec_name(wire.strategy, "strategy")
    for name, value in wire.params.items():
        _check_spec_name(name, "a strategy parameter name")
        if isinstance(value, str):
            _check_spec_name(value, f"strategy parameter {name!r}")
    layout = None
    if wire.layout is not None:
        layout = tuple(_layer_from_wire(n, d, s) for n, d, s in wire.layout)
    return RoundSpec(
        wire.expected_peers, wire.quorum, wire.timeout_s, wire.strategy, wire.params, layout
    )


def _check_spec_name(value: str, what: str) -> None:
    size = utf8_len(value)
    if size > MAX_NAME_BYTES:
        raise InvalidRoundSpec(f"{what} is {size} bytes long; at most {MAX_NAME_BYTES} allowed")


def _layer_from_wire(name: str, dtype: str, dims: list[int]) -> LayerSpec:
    _check_spec_name(name, "a layer name")
    _check_spec_name(dtype, f"layer {name!r}'s dtype")
    if len(dims) > MAX_LAYER_DIMS:
        raise InvalidRoundSpec(
            f"layer {name!r} has {len(dims)} dims; at most {MAX_LAYER_DIMS} allowed"
        )
    if any(d < 0 for d in dims):
        raise InvalidRoundSpec(f"layer {name!r} has a negative dim: {dims}")
    if math.prod(dims) > MAX_LAYER_ELEMENTS:
        raise InvalidRoundSpec(
            f"layer {name!r} of shape {dims} has more than {MAX_LAYER_ELEMENTS} elements"
        )
    return LayerSpec(name, dtype, tuple(int(x) for x in dims))


def row_of(info: RoundInfo) -> RoundRow:
    spec = info.spec
    return RoundRow(
        round=info.round_id.round,
        initiator=info.round_id.initiator,
        status=status_to_wire(info.status),
        received=info.received,
        expected=spec.expected_peers,
        quorum=spec.min_peers,
        strategy=spec.strategy,
        nbytes=info.nbytes,
        peers=list(info.peers),
        created_at=info.created_at,
        deadline=info.deadline,
        dropped=[(peer, why[:MAX_REASON_CHARS]) for peer, why in info.dropped],
        deterministic=spec.deterministic,
    )


def round_id_of(call: RoundCall | RoundRequest) -> RoundId:
    """The call's RoundId; ProtocolViolation for one that is not valid.

    The initiator must be a non-empty name of at most MAX_NAME_BYTES bytes (UTF-8). (A
    decoded RoundRequest was checked already.)
    """
    size = utf8_len(call.initiator)
    if size > MAX_NAME_BYTES:
        raise ProtocolViolation(
            f"bad round id in a rounds request: the initiator is {size} bytes long; "
            f"at most {MAX_NAME_BYTES} allowed"
        )
    try:
        return RoundId(call.round, call.initiator)
    except (TypeError, ValueError) as exc:
        raise ProtocolViolation(f"bad round id in a rounds request: {exc}") from exc


def peer_of(call: RoundCall | SubmitRequest) -> str:
    """The call's peer name; ProtocolViolation unless it is 1 to MAX_NAME_BYTES bytes long."""
    size = utf8_len(call.peer)
    if not 0 < size <= MAX_NAME_BYTES:
        op = call.op if isinstance(call, RoundCall) else "submit"
        raise ProtocolViolation(
            f"a {op} request's peer name is {size} bytes long; 1 to {MAX_NAME_BYTES} allowed"
        )
    return call.peer


# ── errors across the wire ───────────────────────────────────────────────────
REMOTE_TYPES: Mapping[str, type[TensorSwapError]] = remote_types()
"""The refusals a client raises typed (``tensorswap.errors.register_remote``: every built-in
one is registered once ``tensorswap.errors`` is imported, whatever else the process has)."""


def error_info(exc: TensorSwapError) -> ErrorInfo:
    """What a refusal tells the client: the leaf's name, message and plain-valued facts."""
    facts: dict[str, Param | None] = {
        k: v
        for k, v in vars(exc).items()
        if not k.startswith("_") and (v is None or isinstance(v, int | float | str))
    }
    return ErrorInfo(type(exc).__name__, str(exc), facts)


def raise_remote(
    info: ErrorInfo, peer: str, types: Mapping[str, type[TensorSwapError]] | None = None
) -> None:
    """Raise the error the server reported: the same RoundsError leaf, with its facts.

    Codes that are not rounds errors become the wire's RemoteError(code, message).
    Only the known leaves are ever built; nothing is looked up by an arbitrary name. Only
    plain facts become attributes: a name starting with ``_`` or one the class already has
    (``args``, ``with_traceback``, ...) is skipped, so a server cannot break the exception.
    ``types`` replaces the known leaves (a service with leaves of its own passes them).
    """
    cls = (REMOTE_TYPES if types is None else types).get(info.code)
    if cls is None:
        raise RemoteError(info.code, info.message, peer)
    exc = cls.__new__(cls)
    Exception.__init__(exc, info.message)
    for key, value in info.facts.items():
        if key.startswith("_") or hasattr(cls, key):
            continue
        setattr(exc, key, value)
    raise exc
