"""The streamed path of BlockStrategy's training rounds: which strategies may have the block
service aggregate their replies, whether a round's replies allow it, and the replies and the
result the wrapped strategy is handed then (its metrics and arithmetic run as without it)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.serverapp.strategy import (
    FedAdagrad,
    FedAdam,
    FedAvg,
    FedAvgM,
    FedYogi,
    Strategy,
)

from tensorswap.cid import Cid
from tensorswap.flower.records import peer_of, record_of
from tensorswap.flower.reference import ArrayRef, is_reference
from tensorswap.rounds.core import RoundId

__all__ = ["MEAN_STEPS", "Opened", "Plan", "plan_round", "refusal", "settled"]

MEAN_STEPS: frozenset[Callable[..., object]] = frozenset(
    cls.aggregate_train for cls in (FedAvg, FedAvgM, FedAdam, FedYogi, FedAdagrad)
)
"""Flower 1.42's ``aggregate_train``s whose arrays are FedAvg's sample-weighted mean of the
replies' arrays (``strategy_utils.aggregate_arrayrecords``, weights from ``weighted_by_key``),
or a server step taken from that mean and the strategy's own state (FedAvgM's momentum,
FedOpt's FedAdam / FedYogi / FedAdagrad). FedProx inherits FedAvg's. Not here: Krum,
MultiKrum, Bulyan, FedMedian, FedTrimmedAvg, QFedAvg, the XGBoost strategies and the DP
wrappers (they read each reply's arrays), nor any override of it in a subclass."""

STREAMED_DTYPES = frozenset({"float32", "float64"})
"""What the coordinator's FedAvg sums in the arrays' own dtype, as Flower's does (Flower's
float16 sums in float16, its integer arrays come out float64: those stay in the ServerApp)."""


def refusal(strategy: Strategy) -> str | None:
    """Why the block service may not aggregate ``strategy``'s replies (None: it may): it must
    be a FedAvg whose ``aggregate_train`` and reply checks are Flower's, one of
    ``MEAN_STEPS``; a subclass that overrides them is refused (pass ``stream=True`` to
    ``BlockStrategy`` to vouch for one)."""
    name = type(strategy).__name__
    if not isinstance(strategy, FedAvg):
        return f"{name} is not a FedAvg"
    if type(strategy).aggregate_train not in MEAN_STEPS:
        return f"{name}.aggregate_train is not one of Flower's FedAvg-family aggregations"
    checks = type(strategy)._check_and_log_replies
    if checks is not FedAvg._check_and_log_replies:
        return f"{name} checks its replies its own way"
    if not isinstance(strategy.weighted_by_key, str):
        return f"{name}.weighted_by_key is not a str"
    return None


@dataclass(frozen=True)
class Opened:
    """A round the strategy opened on the service's coordinator at ``configure_train`` for
    the sampled nodes (``peers``, their names in the rounds), which their mods submit to."""

    round_id: RoundId
    peers: frozenset[str]


@dataclass(frozen=True)
class Plan:
    """A round whose replies the service aggregates: each reply with arrays (by position in
    the replies) under its reference's key, and the (peer, root) entries submitted."""

    keys: dict[int, str]
    ref: ArrayRef
    """The first reply's reference (every reply's names, shapes and dtypes are the same)."""
    entries: list[tuple[str, Cid]]
    samples: int
    submitted: tuple[str | None, ...] = ()
    """Each entry's ``ArrayRef.submitted``: the round its node's mod submitted it to."""

    def unlike(self, opened: Opened) -> str | None:
        """Why the service's aggregate of the round ``opened`` (the nodes' mods submitted to
        it as they replied) is not the aggregate of this plan's entries, or None when it is:
        every sampled node's reply is here, and each says its mod's submit of its very root
        to that round was accepted under its node's name. The round expects as many peers
        as were sampled, so it then holds exactly these entries (a name another took would
        have refused the node's own submit), and its deterministic fold is this plan's."""
        peers = {peer for peer, _ in self.entries}
        if peers != opened.peers:
            return f"{len(peers & opened.peers)} of the {len(opened.peers)} sampled nodes replied"
        key = opened.round_id.as_key()
        unsent = sum(1 for s in self.submitted if s != key)
        if unsent:
            return f"{unsent} replies were not submitted to round {key} as they arrived"
        return None

    def handed(self, replies: list[Message], arrays: dict[str, np.ndarray]) -> list[Message]:
        """``replies`` with each reference replaced by one ArrayRecord of the aggregate's
        read-only ``arrays``: the weighted mean of equal arrays is those arrays, so the
        strategy's own aggregation gives the aggregate (up to float rounding), and its
        metrics are the replies' own."""
        record = record_of({name: arrays[name] for name in self.ref.names}, writable=False)
        for at, key in self.keys.items():
            content = replies[at].content
            replies[at].content = RecordDict(
                {k: record if k == key else r for k, r in content.items()}
            )
        return replies


def plan_round(replies: list[Message], weight_key: str) -> Plan | str | None:
    """The plan for aggregating ``replies`` in the service, or why not (their arrays are then
    fetched and the strategy aggregates them itself, as Flower would, errors included); None
    when no reply holds anything to aggregate. Each reply that is not an error must hold one
    reference stored with a weight (``ArrayRef.samples``) equal to its one MetricRecord's
    ``weight_key``, no array inline, the same names, shapes and float dtypes as the others,
    and come from a node of its own; the weights must add up to more than 0."""
    keys: dict[int, str] = {}
    refs: list[ArrayRef] = []
    peers: list[str] = []
    for at, message in enumerate(replies):
        if message.has_error():
            continue
        found = _reference(message.content, weight_key)
        if isinstance(found, str):
            return found
        keys[at], ref = found
        refs.append(ref)
        peers.append(peer_of(message.metadata.src_node_id))
    if not refs:
        return None
    first = refs[0]
    if any(
        (r.names, r.shapes, r.dtypes) != (first.names, first.shapes, first.dtypes) for r in refs
    ):
        return "the replies' arrays differ in names, shapes or dtypes"
    if not set(first.dtypes) <= STREAMED_DTYPES:
        return f"dtypes {sorted(set(first.dtypes) - STREAMED_DTYPES)} are not summed as Flower does"
    if len(set(peers)) != len(peers):
        return "two replies come from one node"
    samples = sum(r.samples or 0 for r in refs)
    if samples <= 0:
        return f"the replies' {weight_key!r} add up to {samples}"
    entries = [(peer, r.root) for peer, r in zip(peers, refs, strict=True)]
    return Plan(keys, first, entries, samples, tuple(r.submitted for r in refs))


def _reference(content: RecordDict, weight_key: str) -> tuple[str, ArrayRef] | str:
    """A reply's one reference (and its key), or why it has none the service can aggregate."""
    if content.array_records:
        return "a reply holds arrays inline"
    found = [
        (key, record)
        for key, record in content.items()
        if isinstance(record, ConfigRecord) and is_reference(record)
    ]
    if len(found) != 1 or len(content.metric_records) != 1:
        return "a reply holds other than one reference and one MetricRecord"
    key, record = found[0]
    ref = ArrayRef.parse(key, dict(record.items()))
    weight = next(iter(content.metric_records.values())).get(weight_key)
    if ref.samples is None or isinstance(weight, bool) or weight != ref.samples:
        return f"a reply's arrays were not stored with its {weight_key!r} as their weight"
    return key, ref


def settled(
    returned: ArrayRecord | None, aggregate: dict[str, np.ndarray], replies: int
) -> ArrayRecord | None:
    """What the bridge returns for the strategy's arrays: the service's ``aggregate`` itself
    where the strategy's ``returned`` arrays are its recomputation (each element within the
    rounding of a weighted mean of ``replies`` equal arrays: FedAvg), so the next round's
    model is already held by the service, block for block; else ``returned`` as it is (a
    server step: FedAdam's, FedAvgM's momentum)."""
    if returned is None or set(returned.keys()) != set(aggregate):
        return returned
    for name, array in returned.items():
        if not _rounding_of(array.numpy(), aggregate[name], replies):
            return returned
    return record_of({name: aggregate[name] for name in returned})


_SLICE = 1 << 20


def _rounding_of(got: np.ndarray, mean: np.ndarray, replies: int) -> bool:
    """Whether ``got`` is ``mean`` up to ``replies`` multiplications and additions of it (each
    rounding by half an ulp of at most twice its magnitude), compared a slice at a time."""
    if got.dtype != mean.dtype or got.shape != mean.shape:
        return False
    flat_got, flat_mean = got.reshape(-1), mean.reshape(-1)
    for at in range(0, flat_mean.size, _SLICE):
        piece = flat_mean[at : at + _SLICE]
        bound = (2 * replies + 2) * np.spacing(np.abs(piece))
        if not np.all(np.abs(flat_got[at : at + _SLICE] - piece) <= bound):
            return False
    return True
