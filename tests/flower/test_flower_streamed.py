"""BlockStrategy's streamed path, piece by piece: which strategies stream, when a round's
replies allow it (else the replies are aggregated in the ServerApp, as before), what the mod
reads as a reply's weight, and when the service's aggregate is returned as the strategy's."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pytest

flwr = pytest.importorskip("flwr")
from flwr.app import (  # noqa: E402
    Array,
    ArrayRecord,
    ConfigRecord,
    Error,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp.strategy import (  # noqa: E402
    DifferentialPrivacyServerSideFixedClipping,
    FedAdagrad,
    FedAdam,
    FedAvg,
    FedAvgM,
    FedMedian,
    FedProx,
    FedTrimmedAvg,
    FedYogi,
    Krum,
    QFedAvg,
    Strategy,
)

from tensorswap.cid import Cid  # noqa: E402
from tensorswap.flower import ArrayRef, BlockStrategy  # noqa: E402
from tensorswap.flower.records import (  # noqa: E402
    REPLY_PLAN,
    ReplyPlan,
    reference_of,
    reply_samples,
    take_reply_plan,
    with_reply_plan,
)
from tensorswap.flower.streamed import Plan, plan_round, refusal, settled  # noqa: E402

ROOT = Cid.parse("bagaybqabdyqm6keke3shdenkrlaklv5u5v7r4tcxz3o4ptocjpwsy5lvyyeywli")
ARRAYS = {"w": np.ones((2, 3), np.float32), "b": np.zeros(3, np.float32)}


class Overriding(FedAvg):  # type: ignore[misc]
    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        return super().aggregate_train(server_round, replies)


@pytest.mark.parametrize("cls", [FedAvg, FedProx, FedAvgM, FedAdam, FedYogi, FedAdagrad])
def test_flowers_fedavg_family_streams(cls: type[Strategy]) -> None:
    assert refusal(cls()) is None


@pytest.mark.parametrize(
    "make",
    [
        lambda: Krum(),
        lambda: FedMedian(),
        lambda: FedTrimmedAvg(),
        lambda: QFedAvg(client_learning_rate=0.1),
        lambda: Overriding(),
        lambda: DifferentialPrivacyServerSideFixedClipping(FedAvg(), 1.0, 1.0, 2),
    ],
)
def test_other_aggregations_do_not(make: object) -> None:
    assert isinstance(refusal(make()), str)  # type: ignore[operator]


def test_stream_true_vouches_for_a_subclass_but_needs_a_weight() -> None:
    with BlockStrategy(Overriding(), "127.0.0.1:9", stream=True) as bridged:
        assert bridged.stream_refusal is None
    with pytest.raises(TypeError, match="FedAvg-like"):
        BlockStrategy(DifferentialPrivacyServerSideFixedClipping(FedAvg(), 1.0, 1.0, 2),
                      "127.0.0.1:9", stream=True)  # fmt: skip


def test_the_mod_reads_the_plan_and_the_weight() -> None:
    content = RecordDict({"config": ConfigRecord({"lr": 0.1})})
    planned = with_reply_plan(content, "num-examples")
    stripped, plan = take_reply_plan(planned)
    assert plan == ReplyPlan("num-examples") and REPLY_PLAN not in stripped
    assert list(stripped) == ["config"]
    assert take_reply_plan(content) == (content, None)
    _, plan = take_reply_plan(with_reply_plan(content, "num-examples", (3, "flower-abc")))
    assert plan == ReplyPlan("num-examples", (3, "flower-abc"))

    def reply(**metrics: object) -> RecordDict:
        arrays = ArrayRecord({"w": Array(np.ones(2, np.float32))})
        return RecordDict({"arrays": arrays, "metrics": MetricRecord(metrics)})  # type: ignore[arg-type]

    assert reply_samples(reply(**{"num-examples": 12}), "num-examples") == 12
    assert reply_samples(reply(**{"num-examples": 12.0}), "num-examples") == 12
    assert reply_samples(reply(**{"num-examples": 12.5}), "num-examples") is None
    assert reply_samples(reply(**{"num-examples": -1}), "num-examples") is None
    assert reply_samples(reply(loss=1.0), "num-examples") is None


def _reply(node: int, samples: int | None = 5, weight: object = 5, **arrays: np.ndarray) -> Message:
    sent = Message(RecordDict(), dst_node_id=node, message_type="train")
    ref = ArrayRef.of(ROOT, arrays or ARRAYS, samples=samples)
    content = RecordDict({"arrays": reference_of(ref), "metrics": MetricRecord({"n": weight})})
    return Message(content, reply_to=sent)


def _inline(node: int) -> Message:
    sent = Message(RecordDict(), dst_node_id=node, message_type="train")
    arrays = ArrayRecord({"w": Array(np.ones(2, np.float32))})
    return Message(RecordDict({"arrays": arrays, "metrics": MetricRecord({"n": 5})}), reply_to=sent)


def _error(node: int) -> Message:
    sent = Message(RecordDict(), dst_node_id=node, message_type="train")
    return Message(Error(code=1, reason="it broke"), reply_to=sent)


@pytest.mark.usefixtures("task")
def test_a_round_streams_past_failed_nodes() -> None:
    replies = [_reply(1, 3, 3), _error(2), _reply(3, 0, 0)]
    plan = plan_round(replies, "n")
    assert isinstance(plan, Plan)
    assert plan.entries == [("node-1", ROOT), ("node-3", ROOT)] and plan.samples == 3
    handed = plan.handed(
        replies, {"w": np.full((2, 3), 2, np.float32), "b": np.ones(3, np.float32)}
    )
    assert list(handed[0].content["arrays"]) == ["w", "b"] and handed[1].has_error()
    assert plan_round([_error(1)], "n") is None


@pytest.mark.usefixtures("task")
@pytest.mark.parametrize(
    ("replies", "why"),
    [
        (lambda: [_reply(1), _inline(2)], "inline"),
        (lambda: [_reply(1), _reply(2, samples=None)], "not stored with"),
        (lambda: [_reply(1), _reply(2, samples=5, weight=6)], "not stored with"),
        (lambda: [_reply(1), _reply(1)], "one node"),
        (lambda: [_reply(1, 0, 0), _reply(2, 0, 0)], "add up to 0"),
        (lambda: [_reply(1, w=np.ones(3, np.int64))], "dtypes"),
        (lambda: [_reply(1), _reply(2, w=np.ones(4, np.float32))], "differ"),
    ],
)
def test_a_round_that_cannot_stream_says_why(replies: object, why: str) -> None:
    plan = plan_round(replies(), "n")  # type: ignore[operator]
    assert isinstance(plan, str) and why in plan


def test_the_aggregate_stands_for_the_strategys_recomputed_mean() -> None:
    mean = {"w": np.linspace(-3, 3, 600, dtype=np.float32)}
    factors = [0.1, 0.2, 0.3, 0.4]
    recomputed = sum(mean["w"] * f for f in factors[1:]) + mean["w"] * factors[0]
    returned = ArrayRecord({"w": Array(np.asarray(recomputed))})
    kept = settled(returned, mean, len(factors))
    assert kept is not returned and kept is not None
    assert np.array_equal(kept["w"].numpy(), mean["w"])
    stepped = ArrayRecord({"w": Array(mean["w"] + np.float32(1e-3))})  # a server step
    assert settled(stepped, mean, len(factors)) is stepped
    assert settled(None, mean, 4) is None
