"""The round domain: ids, the status tagged union, layouts, specs, contributions, snapshots."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import ClassVar

from tensorswap.rounds.core.errors import InvalidRoundSpec

__all__ = [
    "MAX_ROUND",
    "Aggregating",
    "Collecting",
    "Complete",
    "Contribution",
    "Failed",
    "LayerSpec",
    "Layout",
    "Pending",
    "RoundId",
    "RoundInfo",
    "RoundSpec",
    "RoundStatus",
    "layout_mismatch",
    "status_from_dict",
]

MAX_ROUND = 2**64 - 1

DETERMINISTIC = "deterministic"
"""The round parameter that carries ``RoundSpec.deterministic`` on the wire and in journals."""


# ── ids ──────────────────────────────────────────────────────────────────────
@dataclass(frozen=True, slots=True, order=True)
class RoundId:
    """A round: its number and the peer that initiated it; the key is ``"{round}-{initiator}"``."""

    round: int
    initiator: str

    def __post_init__(self) -> None:
        if isinstance(self.round, bool) or not isinstance(self.round, int):
            raise TypeError(f"round must be an int, got {type(self.round).__name__}")
        if not 0 <= self.round <= MAX_ROUND:
            raise ValueError(f"round must be in [0, 2**64-1], got {self.round}")
        if not isinstance(self.initiator, str) or not self.initiator:
            raise ValueError(f"initiator must be a non-empty str, got {self.initiator!r}")

    def as_key(self) -> str:
        return f"{self.round}-{self.initiator}"

    @classmethod
    def parse_key(cls, key: str) -> RoundId:
        """The inverse of ``as_key`` (the initiator may itself contain dashes)."""
        number, sep, initiator = key.partition("-")
        if not sep or not number.isdigit():
            raise ValueError(f"not a round key ('<round>-<initiator>'): {key!r}")
        return cls(int(number), initiator)

    def __str__(self) -> str:
        return self.as_key()


# ── statuses: a small tagged union ───────────────────────────────────────────
class _Status:
    __slots__ = ()
    name: ClassVar[str]
    is_terminal: ClassVar[bool] = False

    def to_dict(self) -> dict[str, object]:
        """``{"status": name, **fields}``, JSON- and msgpack-ready."""
        fields = {k: getattr(self, k) for k in getattr(self, "__slots__", ())}
        return {"status": self.name, **fields}


@dataclass(frozen=True, slots=True)
class Pending(_Status):
    """Started; no contribution yet."""

    name: ClassVar[str] = "Pending"


@dataclass(frozen=True, slots=True)
class Collecting(_Status):
    """Accepting contributions: ``received`` of ``expected`` peers have submitted."""

    received: int
    expected: int
    name: ClassVar[str] = "Collecting"


@dataclass(frozen=True, slots=True)
class Aggregating(_Status):
    """Closed for contributions; the aggregate is being computed.

    ``reason`` is empty while all goes well; after a transient failure (the disk full while
    storing the aggregate) it says what failed and when the next attempt is, and the round
    stays Aggregating until it succeeds or its retries run out.
    """

    reason: str = ""
    name: ClassVar[str] = "Aggregating"

    def to_dict(self) -> dict[str, object]:
        return (
            {"status": self.name, "reason": self.reason} if self.reason else {"status": self.name}
        )


@dataclass(frozen=True, slots=True)
class Complete(_Status):
    """Done: ``cid`` names the aggregated model update."""

    cid: str
    name: ClassVar[str] = "Complete"
    is_terminal: ClassVar[bool] = True


@dataclass(frozen=True, slots=True)
class Failed(_Status):
    """Given up, for ``reason`` (e.g. ``"timeout: 3 of 8 peers"``)."""

    reason: str
    name: ClassVar[str] = "Failed"
    is_terminal: ClassVar[bool] = True


RoundStatus = Pending | Collecting | Aggregating | Complete | Failed


def status_from_dict(data: Mapping[str, object]) -> RoundStatus:
    """The inverse of ``RoundStatus.to_dict``; ValueError for anything else."""
    name = data.get("status")
    try:
        if name == "Pending":
            return Pending()
        if name == "Collecting":
            return Collecting(_as_int(data["received"]), _as_int(data["expected"]))
        if name == "Aggregating":
            return Aggregating(str(data.get("reason", "")))
        if name == "Complete":
            return Complete(str(data["cid"]))
        if name == "Failed":
            return Failed(str(data["reason"]))
    except KeyError as exc:
        raise ValueError(f"status {name!r} lacks field {exc}") from None
    raise ValueError(f"unknown round status {name!r}")


def _as_int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected an int, got {value!r}")
    return value


# ── layout of an update: names, dtypes, shapes ───────────────────────────────
@dataclass(frozen=True, slots=True)
class LayerSpec:
    """One named tensor of a model update as a round expects it."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    def to_list(self) -> list[object]:
        return [self.name, self.dtype, list(self.shape)]

    @classmethod
    def from_list(cls, item: object) -> LayerSpec:
        if not (isinstance(item, list | tuple) and len(item) == 3):
            raise ValueError(f"layer spec must be [name, dtype, shape], got {item!r}")
        name, dtype, shape = item
        if not isinstance(shape, list | tuple):
            raise ValueError(f"layer shape must be a list, got {shape!r}")
        return cls(str(name), str(dtype), tuple(_as_int(d) for d in shape))


Layout = tuple[LayerSpec, ...]


def layout_mismatch(expected: Layout, got: Layout) -> str | None:
    """None when the layouts agree, else one line naming the first difference."""
    want = {layer.name: layer for layer in expected}
    have = {layer.name: layer for layer in got}
    if want.keys() != have.keys():
        missing = sorted(want.keys() - have.keys())
        extra = sorted(have.keys() - want.keys())
        return f"layer names differ: missing {missing}, unexpected {extra}"
    for name, layer in want.items():
        other = have[name]
        if layer.shape != other.shape:
            return f"layer {name!r}: expected shape {list(layer.shape)}, got {list(other.shape)}"
        if layer.dtype != other.dtype:
            return f"layer {name!r}: expected dtype {layer.dtype}, got {other.dtype}"
    return None


# ── configuration, contributions, snapshots ──────────────────────────────────
@dataclass(frozen=True, slots=True)
class RoundSpec:
    """How a round runs: peers expected, quorum at the deadline, deadline, aggregation strategy.

    ``quorum`` (default: ``expected_peers``) is how many contributions a round needs when its
    deadline passes to be aggregated rather than failed. ``timeout_s`` None means no deadline.
    ``strategy`` names an aggregator of ``tensorswap.aggregate``; ``params`` are its options.
    ``layout`` fixes the update's layers up front; when None the first contribution fixes it.
    ``deterministic``: the aggregate's bits do not depend on the order contributions arrive
    in: they are folded in a canonical order (by peer name) when the round closes, instead
    of as they arrive (docs/rounds.md, "Guarantees"). On the wire and in the journal it is
    the parameter ``"deterministic": 1``, which ``params`` may also give.
    """

    expected_peers: int
    quorum: int | None = None
    timeout_s: float | None = None
    strategy: str = "fedavg"
    params: Mapping[str, float | int | str] = field(default_factory=dict)
    layout: Layout | None = None
    deterministic: bool = False

    def __post_init__(self) -> None:
        expected = self.expected_peers
        if isinstance(expected, bool) or not isinstance(expected, int) or expected < 1:
            raise InvalidRoundSpec(f"expected_peers must be an int >= 1, got {expected!r}")
        quorum = expected if self.quorum is None else self.quorum
        if isinstance(quorum, bool) or not isinstance(quorum, int) or not 1 <= quorum <= expected:
            raise InvalidRoundSpec(f"quorum must be an int in [1, {expected}], got {quorum!r}")
        object.__setattr__(self, "quorum", quorum)
        if self.timeout_s is not None and not (
            isinstance(self.timeout_s, int | float) and math.isfinite(self.timeout_s)
        ):
            raise InvalidRoundSpec(f"timeout_s must be a finite number, got {self.timeout_s!r}")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise InvalidRoundSpec(f"timeout_s must be > 0, got {self.timeout_s}")
        if not isinstance(self.strategy, str) or not self.strategy:
            raise InvalidRoundSpec(f"strategy must be a non-empty str, got {self.strategy!r}")
        params = dict(self.params)
        if DETERMINISTIC in params:
            flag = params.pop(DETERMINISTIC)
            if flag not in (0, 1) or isinstance(flag, str):
                raise InvalidRoundSpec(f"{DETERMINISTIC!r} must be 0 or 1, got {flag!r}")
            object.__setattr__(self, "deterministic", self.deterministic or bool(flag))
        if not isinstance(self.deterministic, bool):
            raise InvalidRoundSpec(f"deterministic must be a bool, got {self.deterministic!r}")
        object.__setattr__(self, "params", MappingProxyType(params))
        if self.layout is not None:
            object.__setattr__(self, "layout", tuple(self.layout))

    @property
    def min_peers(self) -> int:
        """The quorum as an int (never None after construction)."""
        return self.quorum if self.quorum is not None else self.expected_peers

    def stored_params(self) -> dict[str, float | int | str]:
        """``params`` as the wire and the journal carry them (``deterministic`` included)."""
        params = dict(self.params)
        if self.deterministic:
            params[DETERMINISTIC] = 1
        return params


@dataclass(frozen=True, slots=True)
class Contribution:
    """One peer's accepted contribution: the CID of its model update and its sample count."""

    round_id: RoundId
    peer: str
    update_cid: str
    num_samples: int = 0
    nbytes: int = 0
    submitted_at: float = 0.0
    scale: float = 1.0
    """The factor its values enter the aggregate with (1; an asynchronous run's staleness
    weight): FedAvg folds ``num_samples`` x ``scale`` x values, divided by the samples."""

    def __post_init__(self) -> None:
        if not isinstance(self.peer, str) or not self.peer:
            raise ValueError(f"peer must be a non-empty str, got {self.peer!r}")
        if not (isinstance(self.scale, int | float) and 0 < self.scale <= 1):
            raise ValueError(f"scale must be a number in (0, 1], got {self.scale!r}")
        for what in ("num_samples", "nbytes"):
            value = getattr(self, what)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{what} must be an int >= 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class RoundInfo:
    """A consistent snapshot of one round."""

    round_id: RoundId
    spec: RoundSpec
    status: RoundStatus
    peers: tuple[str, ...]
    nbytes: int
    created_at: float
    deadline: float | None
    layout: Layout | None
    dropped: tuple[tuple[str, str], ...] = ()
    """Accepted contributions left out of the aggregate, as ``(peer, reason)``: a block of
    theirs failed its hash check (quarantined) or vanished from the store."""
    peer_count: int | None = None
    """How many peers contributed, when ``peers`` lists only the first of them (a page)."""

    @property
    def received(self) -> int:
        return len(self.peers) if self.peer_count is None else self.peer_count

    @property
    def dropped_peers(self) -> frozenset[str]:
        return frozenset(peer for peer, _ in self.dropped)
