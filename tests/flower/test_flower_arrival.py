"""Replies folded as they arrive: BlockStrategy's ``configure_train`` opens a round on the
service's coordinator for the sampled nodes, each node's mod submits its reply to it after
pushing it, and ``aggregate_train`` takes that round's aggregate only where Flower handed it a
reply of every sampled node, each submitted there; else the replies it was handed are
aggregated in a round of their own, as before. Driven without a Flower run: the strategy's
calls and the mod on messages made here, one BlockService on 127.0.0.1 (port 0)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

flwr = pytest.importorskip("flwr")
from flwr.app import (  # noqa: E402
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp.strategy import FedAvg  # noqa: E402
from proxy import CuttingProxy  # noqa: E402  (tests/flower, on sys.path: conftest)

from tensorswap.errors.flower import BadReference  # noqa: E402
from tensorswap.flower import ArrayRef, BlockLink, BlockService, BlockStrategy  # noqa: E402
from tensorswap.flower.mod import blocks_mod  # noqa: E402
from tensorswap.flower.records import REPLY_PLAN, reference_of  # noqa: E402
from tensorswap.rounds.core import RoundId  # noqa: E402
from tensorswap.store import MemoryStore, ModelUpdate, put_update  # noqa: E402

NODES = (11, 12, 13, 14)
WEIGHT = "num-examples"


class Nodes:
    """The ServerApp's view of the federation (``Grid.get_node_ids``: all connected)."""

    def get_node_ids(self) -> list[int]:
        return list(NODES)


@pytest.fixture
def service() -> Iterator[BlockService]:
    with BlockService() as running:  # started on entering
        yield running


def model() -> ArrayRecord:
    rng = np.random.default_rng(0)
    return ArrayRecord(
        {
            "w": Array(rng.standard_normal((96, 64)).astype(np.float32)),
            "b": Array(rng.standard_normal(64).astype(np.float64)),
        }
    )


def train(message: Message, context: Context) -> Message:
    """A node's deterministic "training": its own noise on every array, its own weight."""
    node = message.metadata.dst_node_id
    trained = ArrayRecord()
    for i, (name, array) in enumerate(message.content["arrays"].items()):
        values = array.numpy()
        noise = np.random.default_rng([node, i]).standard_normal(values.shape)
        trained[name] = Array(values + noise.astype(values.dtype))
    metrics = MetricRecord({WEIGHT: node - 10, "loss": 0.5})
    return Message(RecordDict({"arrays": trained, "metrics": metrics}), reply_to=message)


def fedavg() -> FedAvg:
    return FedAvg(fraction_train=1.0, min_train_nodes=4, min_available_nodes=4)


def configured(strategy: BlockStrategy | FedAvg) -> list[Message]:
    return list(strategy.configure_train(1, model(), ConfigRecord(), Nodes()))  # type: ignore[arg-type]


def answer(address: str, messages: list[Message]) -> list[Message]:
    """Each message through the node's ``blocks_mod`` to ``train`` and back."""
    mod = blocks_mod(address)
    replies = []
    for message in messages:
        context = Context(1, message.metadata.dst_node_id, {}, RecordDict(), {})
        replies.append(mod(message, context, train))
    return replies


def plain(dropped: frozenset[int] = frozenset()) -> dict[str, np.ndarray]:
    """Flower's FedAvg alone on the same training, the nodes in ``dropped`` failed."""
    messages = configured(fedavg())
    replies = [
        _failed(m) if m.metadata.dst_node_id in dropped else train(m, _ctx()) for m in messages
    ]
    arrays, _ = fedavg().aggregate_train(1, replies)
    return {name: array.numpy() for name, array in arrays.items()}


def _ctx() -> Context:
    return Context(1, 0, {}, RecordDict(), {})


def _failed(message: Message) -> Message:
    return Message(Error(code=1, reason="the reply was lost"), reply_to=message)


def _copy(reply: Message, sent: Message) -> Message:
    """The same reply again (aggregating replaces a reply's records in place)."""
    if reply.has_error():
        return _failed(sent)
    return Message(RecordDict(dict(reply.content.items())), reply_to=sent)


def aggregated(strategy: BlockStrategy, replies: list[Message]) -> dict[str, np.ndarray]:
    arrays, metrics = strategy.aggregate_train(1, replies)
    assert arrays is not None and metrics is not None
    return {name: array.numpy() for name, array in arrays.items()}


def assert_close(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-6)


def assert_same_bits(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].tobytes() == want[name].tobytes()


def opened_round(messages: list[Message]) -> RoundId:
    """The round the strategy opened, as its messages name it to the mods (read before the
    mod takes the plan out of them)."""
    plan = messages[0].content[REPLY_PLAN]
    return RoundId(int(plan["round"]), str(plan["initiator"]))  # type: ignore[call-overload]


@pytest.mark.usefixtures("task")
def test_replies_submitted_as_they_arrive_give_the_fresh_rounds_bits(
    service: BlockService,
) -> None:
    with BlockStrategy(fedavg(), service.address, swarm=False) as early:
        messages = configured(early)
        opened = opened_round(messages)
        replies = answer(service.address, messages)
        again = [_copy(r, m) for r, m in zip(replies, messages, strict=True)]
        for reply in replies:
            ref = ArrayRef.parse("arrays", dict(reply.content["arrays"].items()))
            assert ref.submitted == opened.as_key()
        prefetch = early.prefetch(1)
        assert prefetch is not None and prefetch.wait(60)  # folded: fetched before asked for
        fetched = early.link.counters.fetched_bytes
        assert fetched >= sum(a.numpy().nbytes for a in model().values())
        got = aggregated(early, replies)
        assert (early.streamed_rounds, early.arrival_rounds, early.prefetched_rounds) == (1, 1, 1)
        assert early.link.counters.fetched_bytes == fetched  # aggregate_train fetched nothing
        assert early.prefetch(1) is None and early.link.prefetching == 0
    with BlockStrategy(fedavg(), service.address, swarm=False) as fresh:  # today's path
        want = aggregated(fresh, again)
        assert (fresh.streamed_rounds, fresh.arrival_rounds) == (1, 0)
    assert_same_bits(got, want)
    assert_close(got, plain())


@pytest.mark.usefixtures("task")
@pytest.mark.parametrize("how", ["error", "missing"])
def test_a_reply_flower_drops_is_left_out_as_flower_leaves_it(
    service: BlockService, how: str
) -> None:
    """Node 13's mod submitted its reply; Flower then hands the strategy an error in its
    place, or nothing: the opened round holds a reply Flower dropped, so the replies handed
    are aggregated in a round of their own, equal to Flower's FedAvg without node 13."""
    with BlockStrategy(fedavg(), service.address, swarm=False) as bridged:
        messages = configured(bridged)
        replies = answer(service.address, messages)
        at = next(i for i, m in enumerate(messages) if m.metadata.dst_node_id == 13)
        if how == "error":
            replies[at] = _failed(messages[at])
        else:
            del replies[at]
        prefetch = bridged.prefetch(1)
        got = aggregated(bridged, replies)
        assert (bridged.streamed_rounds, bridged.arrival_rounds) == (1, 0)
        assert bridged.prefetched_rounds == 0 and prefetch is not None and not prefetch.taken
        assert prefetch.done() and bridged.link.prefetching == 0
        again = configured(bridged)  # the link goes on: the next round's prefetch is taken
        assert_close(aggregated(bridged, answer(service.address, again)), plain())
        assert (bridged.arrival_rounds, bridged.prefetched_rounds) == (1, 1)
    assert_close(got, plain(dropped=frozenset({13})))


@pytest.mark.usefixtures("task")
def test_a_round_still_short_of_a_reply_ends_its_prefetch(service: BlockService) -> None:
    """Node 13 never answers: the opened round waits for it, and so does its prefetch, until
    ``aggregate_train`` aggregates the three replies afresh; the prefetch is cancelled then
    (its connection closed). A round configured and never aggregated loses its prefetch at
    the next ``configure_train``, and the last one at ``close``."""
    with BlockStrategy(fedavg(), service.address, swarm=False) as bridged:
        messages = configured(bridged)
        replies = answer(service.address, [m for m in messages if m.metadata.dst_node_id != 13])
        prefetch = bridged.prefetch(1)
        assert prefetch is not None and not prefetch.done()
        got = aggregated(bridged, replies)
        assert (bridged.streamed_rounds, bridged.arrival_rounds) == (1, 0)
        assert prefetch.done() and prefetch.error == "cancelled" and not prefetch.taken
        assert bridged.link.prefetching == 0
        configured(bridged)
        first = bridged.prefetch(1)
        configured(bridged)
        assert first is not None and first.done() and bridged.link.prefetching == 1
        last = bridged.prefetch(1)
    assert last is not None and last.done() and bridged.link.prefetching == 0
    assert_close(got, plain(dropped=frozenset({13})))


@pytest.mark.usefixtures("task")
def test_a_failed_prefetch_leaves_the_round_to_the_usual_fetch(service: BlockService) -> None:
    """The strategy's link reaches the service through a proxy that cuts its second
    connection at once, the prefetch's: the prefetch fails, and ``aggregate_train`` awaits
    and fetches the opened round's aggregate on the link's own connection, as before: the
    same bits as a fresh round over the same replies."""
    proxy = CuttingProxy(service.port, cut=0, which=2)
    try:
        link = BlockLink(f"127.0.0.1:{proxy.port}")
        with BlockStrategy(fedavg(), service.address, swarm=False, link=link) as early:
            messages = configured(early)
            replies = answer(service.address, messages)
            again = [_copy(r, m) for r, m in zip(replies, messages, strict=True)]
            prefetch = early.prefetch(1)
            assert prefetch is not None and prefetch.wait(60) and prefetch.error is not None
            got = aggregated(early, replies)
            assert (early.arrival_rounds, early.prefetched_rounds) == (1, 0)
            assert proxy.connections == 2 and link.prefetching == 0
    finally:
        proxy.close()
    with BlockStrategy(fedavg(), service.address, swarm=False) as fresh:
        assert_same_bits(got, aggregated(fresh, again))


@pytest.mark.usefixtures("task")
def test_a_name_taken_before_its_node_keeps_that_update_out(service: BlockService) -> None:
    """Another client submits an update of its own as node 12 to the opened round before
    node 12's mod does: the mod's submit is refused, its reply says it was not submitted,
    and the round Flower's replies make is aggregated afresh, that update left out."""
    with BlockStrategy(fedavg(), service.address, swarm=False) as bridged:
        messages = configured(bridged)
        with BlockLink(service.address) as other:
            forged = {"w": np.full((96, 64), 1e3, np.float32), "b": np.zeros(64)}
            refused = other.submit_held(
                opened_round(messages), "node-12", other.push(forged, samples=1000)
            )
            assert refused is None
        replies = answer(service.address, messages)
        marks = {
            r.metadata.src_node_id: ArrayRef.parse("arrays", dict(r.content["arrays"].items()))
            for r in replies
        }
        assert marks[12].submitted is None and marks[11].submitted is not None
        got = aggregated(bridged, replies)
        assert (bridged.streamed_rounds, bridged.arrival_rounds) == (1, 0)
    assert_close(got, plain())


def test_the_reference_says_which_round_holds_its_arrays() -> None:
    arrays = {"w": np.ones(3, np.float32)}
    ref = ArrayRef.of(put_update(MemoryStore(), ModelUpdate(arrays, 4)), arrays, samples=4)
    marked = ArrayRef(ref.root, ref.names, ref.shapes, ref.dtypes, samples=4, submitted="7-x")
    fields = dict(reference_of(marked).items())
    assert ArrayRef.parse("arrays", fields) == marked
    assert "submitted" not in reference_of(ref)
    with pytest.raises(BadReference, match="submitted"):
        ArrayRef.parse("arrays", {**fields, "submitted": 7})
    with pytest.raises(BadReference, match="submitted"):
        ArrayRef.parse("arrays", {**fields, "submitted": "x" * 4096})
