"""Flower records and tensorswap references: an ArrayRecord swapped out for a ConfigRecord that
references its stored arrays, and swapped back in as an ArrayRecord over the store's blocks."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from io import BytesIO
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict
from flwr.common.constant import SType

from tensorswap.cid import Cid
from tensorswap.codec import DType
from tensorswap.errors import CodecError
from tensorswap.flower.reference import MAX_NAME, ArrayRef, is_reference

__all__ = [
    "REPLY_PLAN",
    "ReplyPlan",
    "StoredArray",
    "arrays_of",
    "has_reference",
    "peer_of",
    "record_of",
    "reference_of",
    "reply_samples",
    "swap_in",
    "swap_out",
    "take_reply_plan",
    "with_reply_plan",
]

REPLY_PLAN = "tensorswap.reply"
"""The record of a train message (and its field) that asks the ClientApp's mod to store the
reply's arrays with their weight: the value is the metric the weight is read from (the
strategy's ``weighted_by_key``); fields ``round`` and ``initiator``, where present, name the
coordinator's round the mod submits them to (``ReplyPlan``). The mod removes it before the
ClientApp runs."""
_MAX_SAMPLES = 2**63 - 1

Push = Callable[[dict[str, np.ndarray]], Cid]
Fetch = Callable[[ArrayRef], dict[str, np.ndarray]]


class StoredArray(Array):
    """A Flower Array over values held by tensorswap: ``numpy()`` returns them without
    Flower's serialization round trip (no ``np.save`` / ``np.load``), the very array when
    ``writable`` is False (a read-only view of the store's block for a one-chunk tensor), a
    writable copy otherwise. ``data`` (the ``.npy`` bytes Flower would have carried) is made
    only if something asks for it, such as Flower sending the array on inline."""

    def __init__(self, values: np.ndarray, *, writable: bool = True) -> None:
        state = self.__dict__
        state["dtype"] = str(values.dtype)
        state["shape"] = tuple(int(d) for d in values.shape)
        state["stype"] = SType.NUMPY
        state["_values"] = values
        state["_writable"] = writable

    @property
    def data(self) -> bytes:
        npy = self.__dict__.get("_npy")
        if npy is None:
            buffer = BytesIO()
            np.save(buffer, self.__dict__["_values"], allow_pickle=False)
            npy = self.__dict__["_npy"] = buffer.getvalue()
        return bytes(npy)

    @data.setter
    def data(self, value: bytes) -> None:
        self.__dict__["_npy"] = value
        self.__dict__.pop("_values", None)

    def numpy(self) -> np.ndarray:
        values: np.ndarray | None = self.__dict__.get("_values")
        if values is None:
            return super().numpy()
        if self.__dict__["_writable"] and not values.flags.writeable:
            return values.copy()
        return values


def arrays_of(record: ArrayRecord) -> dict[str, np.ndarray] | None:
    """The record's arrays by name, or None when it cannot travel as a reference (empty, an
    array not serialized by numpy, a dtype tensorswap does not store): it then goes inline."""
    if not record:
        return None
    arrays: dict[str, np.ndarray] = {}
    for name, array in record.items():
        if array.stype != SType.NUMPY:
            return None
        held = array.__dict__.get("_values") if isinstance(array, StoredArray) else None
        values = held if held is not None else array.numpy()
        try:
            DType.of(values.dtype)
        except CodecError:
            return None
        arrays[name] = values
    return arrays


def reference_of(ref: ArrayRef) -> ConfigRecord:
    """The ConfigRecord that stands for the arrays in a message."""
    return ConfigRecord(ref.fields())


def record_of(arrays: Mapping[str, np.ndarray], *, writable: bool = True) -> ArrayRecord:
    """An ArrayRecord of StoredArrays over ``arrays`` (names kept in order)."""
    record = ArrayRecord()
    for name, values in arrays.items():
        record[name] = StoredArray(values, writable=writable)
    return record


def swap_out(
    content: RecordDict,
    push: Push,
    *,
    swarm: bool = False,
    memo: dict[int, ArrayRef | None] | None = None,
    samples: int | None = None,
) -> RecordDict:
    """A copy of ``content`` with every ArrayRecord that can be referenced replaced, under
    the same key, by a reference to its arrays, stored with ``push``. ``memo`` (by record
    identity; the caller keeps the records alive) makes messages that share one record share
    one push and one reference. ``samples``: the weight ``push`` stored the arrays with (their
    update's ``num_samples``), said in each reference."""
    out = RecordDict()
    for key, record in content.items():
        if not isinstance(record, ArrayRecord):
            out[key] = record
            continue
        if memo is not None and id(record) in memo:
            ref = memo[id(record)]
        else:
            arrays = arrays_of(record)
            ref = None
            if arrays is not None:
                ref = ArrayRef.of(push(arrays), arrays, swarm=swarm, samples=samples)
            if memo is not None:
                memo[id(record)] = ref
        out[key] = record if ref is None else reference_of(ref)
    return out


def swap_in(content: RecordDict, fetch: Fetch, *, writable: bool = True) -> RecordDict:
    """A copy of ``content`` with every reference replaced, under its key, by an ArrayRecord
    of the arrays ``fetch`` brings (checked against the reference: names, shapes, dtypes)."""
    out = RecordDict()
    for key, record in content.items():
        if isinstance(record, ConfigRecord) and is_reference(record):
            ref = ArrayRef.parse(key, _fields(record))
            arrays = fetch(ref)
            ref.check(arrays)
            out[key] = record_of({name: arrays[name] for name in ref.names}, writable=writable)
        else:
            out[key] = record
    return out


@dataclass(frozen=True, slots=True)
class ReplyPlan:
    """What a train message's ``REPLY_PLAN`` asks of the mod: store the reply's arrays
    weighted by its metric ``weight_key``; with ``round`` (the round's number and
    initiator, opened by the strategy for the nodes it sampled) also submit them to that
    round of the service's coordinator as this node's contribution, so that the service
    has every reply before Flower hands them to the strategy."""

    weight_key: str
    round: tuple[int, str] | None = None


def with_reply_plan(
    content: RecordDict, weight_key: str, round: tuple[int, str] | None = None
) -> RecordDict:
    """A copy of a train message's ``content`` that asks the mod to store the reply's arrays
    weighted by its metric ``weight_key`` (``REPLY_PLAN``) and, with ``round``, to submit
    them to that round (number, initiator)."""
    fields: dict[str, Any] = {REPLY_PLAN: weight_key}
    if round is not None:
        fields["round"], fields["initiator"] = round
    out = RecordDict(dict(content.items()))
    out[REPLY_PLAN] = ConfigRecord(fields)
    return out


def take_reply_plan(content: RecordDict) -> tuple[RecordDict, ReplyPlan | None]:
    """``content`` without its ``REPLY_PLAN`` record, and the plan it holds (None: no plan,
    or one that does not say a weight's name; its round left out when malformed)."""
    plan = content.get(REPLY_PLAN)
    if plan is None:
        return content, None
    out = RecordDict({k: r for k, r in content.items() if k != REPLY_PLAN})
    fields = dict(plan.items()) if isinstance(plan, ConfigRecord) else {}
    key = fields.get(REPLY_PLAN)
    if not isinstance(key, str) or not 0 < len(key) <= MAX_NAME:
        return out, None
    number, initiator = fields.get("round"), fields.get("initiator")
    if (
        isinstance(number, int)
        and not isinstance(number, bool)
        and 0 <= number <= _MAX_SAMPLES
        and isinstance(initiator, str)
        and 0 < len(initiator) <= MAX_NAME
    ):
        return out, ReplyPlan(key, (number, initiator))
    return out, ReplyPlan(key)


def peer_of(node_id: int) -> str:
    """The peer name a node's reply has in the service's rounds (``node-<id>``)."""
    return f"node-{node_id}"


def reply_samples(content: RecordDict, weight_key: str) -> int | None:
    """The weight of a train reply, as a coordinator's FedAvg takes it (an int >= 0): its one
    MetricRecord's ``weight_key``, when the reply holds exactly one ArrayRecord and one
    MetricRecord and the value is a whole number; else None (its arrays go unweighted)."""
    if len(content.array_records) != 1 or len(content.metric_records) != 1:
        return None
    value = next(iter(content.metric_records.values())).get(weight_key)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_SAMPLES:
        return None
    return value


def has_reference(content: RecordDict) -> bool:
    """Whether any record of ``content`` is a tensorswap reference."""
    return any(isinstance(r, ConfigRecord) and is_reference(r) for r in content.values())


def _fields(record: ConfigRecord) -> dict[str, Any]:
    return dict(record.items())
