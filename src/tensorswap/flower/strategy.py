"""BlockStrategy: wraps a Flower Strategy so that the arrays of the messages it sends travel as
blocks (references in the messages) and the replies' references are resolved before it
aggregates."""

from __future__ import annotations

import itertools
import logging
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from tensorswap.errors.flower import AggregateUnavailable, FlowerBridgeError
from tensorswap.flower.link import BlockLink
from tensorswap.flower.prefetch import RoundPrefetch
from tensorswap.flower.records import has_reference, peer_of, swap_in, swap_out, with_reply_plan
from tensorswap.flower.reference import ArrayRef, is_reference
from tensorswap.flower.streamed import Opened, Plan, plan_round, refusal, settled
from tensorswap.rounds.core import RoundId

__all__ = ["AGGREGATE_TIMEOUT", "ARRIVAL_TIMEOUT", "BlockStrategy", "MessageBytes"]

log = logging.getLogger(__name__)

AGGREGATE_TIMEOUT = 600.0
"""Seconds the service's coordinator has for one round's aggregate (its round's deadline)."""
ARRIVAL_TIMEOUT = 3600.0
"""The deadline (seconds after ``configure_train``) of the round the sampled nodes' mods
submit their replies to as they reply; a round still short of a reply then fails, and the
replies Flower hands the strategy are aggregated in a round of their own."""
TrainCall = Callable[[int, Iterable[Message]], tuple[ArrayRecord | None, MetricRecord | None]]

_BRIDGED = ("configure_train", "aggregate_train", "configure_evaluate", "aggregate_evaluate")
"""The four calls the bridge stands in: while an overridden ``start`` runs, they are set on the
wrapped strategy's instance (shadowing its class's methods, ``super()`` calls untouched)."""
_ABSENT = object()


@dataclass
class MessageBytes:
    """Bytes the messages of a run carried (Flower's ``count_bytes`` of each record), and
    the bytes of the arrays their references stand for, sent down and up."""

    carried: int = 0
    referenced: int = 0

    def ratio(self) -> float:
        return self.carried / self.referenced if self.referenced else 0.0


def content_bytes(content: RecordDict) -> int:
    """What Flower counts for a message's records (arrays, metrics, configs, references)."""
    return sum(record.count_bytes() for record in content.values())


class BlockStrategy(Strategy):
    """``strategy`` (any message-API Strategy: FedAvg, FedAdam, FedProx, Krum, the DP
    wrappers...) with its arrays moved through the block service at ``address``.

    The messages ``configure_train`` / ``configure_evaluate`` return carry, in place of each
    ArrayRecord, a reference to its arrays, pushed once to the service however many messages
    share it (only the blocks the service lacks: a frozen tensor is not sent again); with
    ``swarm`` the receivers fetch chunks from each other too. Before ``aggregate_train`` /
    ``aggregate_evaluate`` see the replies, their references are resolved into ArrayRecords
    of read-only arrays over this process's store (a one-chunk tensor is the store's block
    itself, no copy). Metrics, configs, errors and everything else pass through unchanged;
    the strategy's results are those it computes on the same arrays. ``bytes`` counts what
    the messages carried against the arrays referenced. Attributes not defined here are the
    wrapped strategy's. Close with ``close()`` (the link; also at interpreter exit).

    **Streamed aggregation** (``stream``): for a FedAvg-family strategy (``streamed.refusal``:
    Flower's FedAvg, FedProx, FedAvgM, FedAdam, FedYogi, FedAdagrad; ``stream=True`` vouches
    for a subclass that overrides ``aggregate_train`` around FedAvg's, ``False`` turns it off)
    the train messages ask the ClientApps' mods to store each reply with its weight (the
    metric ``weighted_by_key``), and the service's coordinator computes the weighted mean of
    the replies it holds: only that one aggregate comes to this process, not every reply.
    The strategy is then handed the replies with the aggregate as every reply's arrays (its
    metrics, checks and server step run as they would; its mean of equal arrays is the
    aggregate up to float rounding), and where its arrays are that mean the service's own
    aggregate is returned (so the next round's model is not pushed again). The service
    folds the replies as they come: ``configure_train`` opens a round on its coordinator
    for the sampled nodes, each node's mod submits its reply to it after pushing it, and
    ``aggregate_train`` takes that round's aggregate where Flower handed it a reply of
    every sampled node, each submitted there (``Plan.unlike``); otherwise the replies it
    was handed are aggregated in a round of their own (the same deterministic fold). A round the
    service cannot aggregate (a reply inline, without weight, of another layout or dtype;
    a refusal there; a service without a coordinator) is aggregated here as before, with a
    warning saying why.
    """

    def __init__(
        self,
        strategy: Strategy,
        address: str,
        *,
        key: bytes | None = None,
        swarm: bool = True,
        link: BlockLink | None = None,
        stream: bool | None = None,
    ) -> None:
        self.strategy = strategy
        self.address = address
        self.swarm = swarm
        self.link = link if link is not None else BlockLink(address, key=key)
        self.bytes = MessageBytes()
        self.streamed_rounds = 0
        """Training rounds whose replies the block service aggregated."""
        self.arrival_rounds = 0
        """Of those, the rounds aggregated in the round the nodes submitted to as they
        replied (the rest: in a round the strategy started once it had every reply)."""
        self.prefetched_rounds = 0
        """Of those, the rounds whose aggregate this process had fetched before
        ``aggregate_train`` was called (``BlockLink.prefetch_round``)."""
        self._opened: dict[int, Opened] = {}
        self._prefetches: dict[int, RoundPrefetch] = {}
        self._refused = _stream_refusal(strategy, stream)
        if self._refused is not None and stream is None:
            log.info("%s: replies aggregated in this process (%s)", type(strategy).__name__,
                     self._refused)  # fmt: skip
        self._initiator = f"flower-{uuid.uuid4().hex[:16]}"
        self._rounds = itertools.count(1)

    def __getattr__(self, name: str) -> Any:
        if name == "strategy":  # not yet set (during unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.strategy, name)

    def prefetch(self, server_round: int) -> RoundPrefetch | None:
        """The prefetch of the aggregate of the round opened for training round
        ``server_round`` (None: none opened, or it was aggregated since): its task awaits
        the round on a connection of its own and fetches the aggregate as soon as the last
        sampled node's reply is folded, while Flower relays the replies."""
        return self._prefetches.get(server_round)

    @property
    def stream_refusal(self) -> str | None:
        """Why this strategy's training replies are never aggregated in the block service
        (None: they are, round by round, where ``streamed`` allows)."""
        return self._refused

    def close(self) -> None:
        self._drop_prefetches()
        self.link.close()

    def __enter__(self) -> BlockStrategy:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ── Strategy ─────────────────────────────────────────────────────────────
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        messages = self.strategy.configure_train(server_round, arrays, config, grid)
        return self._sending(messages, train_round=server_round)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        return self._aggregating(self.strategy.aggregate_train, server_round, replies)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return self._sending(self.strategy.configure_evaluate(server_round, arrays, config, grid))

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        return self.strategy.aggregate_evaluate(server_round, self._received(replies))

    def summary(self) -> None:
        self.strategy.summary()

    def start(self, grid: Grid, initial_arrays: ArrayRecord, *args: Any, **kwargs: Any) -> Result:
        """Run the wrapped strategy: its own ``start`` where its class overrides Flower's (the
        bridge set on the instance for the call's duration), else Flower's ``Strategy.start``
        over this wrapper. Arguments as ``Strategy.start``'s."""
        inner = self.strategy
        if type(inner).start is Strategy.start:
            return super().start(grid, initial_arrays, *args, **kwargs)
        with self._bridged(inner):
            return inner.start(grid, initial_arrays, *args, **kwargs)

    @contextmanager
    def _bridged(self, inner: Strategy) -> Iterator[None]:
        """``inner``'s four calls through the bridge on its instance, restored afterwards."""
        own = vars(inner)
        saved = {name: own.get(name, _ABSENT) for name in _BRIDGED}
        originals = {name: getattr(inner, name) for name in _BRIDGED}
        bridges = {
            "configure_train": self._training_sending_call(originals["configure_train"]),
            "aggregate_train": self._training_call(originals["aggregate_train"]),
            "configure_evaluate": self._sending_call(originals["configure_evaluate"]),
            "aggregate_evaluate": self._received_call(originals["aggregate_evaluate"]),
        }
        for name, bridge in bridges.items():
            setattr(inner, name, bridge)
        try:
            yield
        finally:
            for name, value in saved.items():
                if value is _ABSENT:
                    own.pop(name, None)
                else:
                    own[name] = value

    def _sending_call(self, call: Callable[..., Iterable[Message]]) -> Callable[..., list[Message]]:
        def bridge(*args: Any, **kwargs: Any) -> list[Message]:
            return self._sending(call(*args, **kwargs))

        return bridge

    def _training_sending_call(
        self, call: Callable[..., Iterable[Message]]
    ) -> Callable[..., list[Message]]:
        def bridge(
            server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
        ) -> list[Message]:
            messages = call(server_round, arrays, config, grid)
            return self._sending(messages, train_round=server_round)

        return bridge

    def _training_call(self, call: TrainCall) -> TrainCall:
        def bridge(
            server_round: int, replies: Iterable[Message]
        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
            return self._aggregating(call, server_round, replies)

        return bridge

    def _received_call(self, call: Callable[..., Any]) -> Callable[..., Any]:
        def bridge(server_round: int, replies: Iterable[Message]) -> Any:
            return call(server_round, self._received(replies))

        return bridge

    # ── the swaps ────────────────────────────────────────────────────────────
    def _sending(
        self, messages: Iterable[Message], *, train_round: int | None = None
    ) -> list[Message]:
        """The messages with their arrays pushed and referenced; for training round
        ``train_round`` (streamed), each also asks its node's mod to store the reply with its
        weight and to submit it to the round opened here for the sampled nodes."""
        out = list(messages)
        memo: dict[int, ArrayRef | None] = {}
        planned: list[Message] = []
        streamed = train_round is not None and self._refused is None
        for message in out:
            if message.has_content():
                message.content = swap_out(message.content, self._push, swarm=self.swarm, memo=memo)
                if streamed and has_reference(message.content):
                    planned.append(message)
        opened = None if not planned else self._open(train_round or 0, planned)
        for message in planned:
            round_ = None if opened is None else (opened.round_id.round, opened.round_id.initiator)
            message.content = with_reply_plan(
                message.content, self.strategy.weighted_by_key, round_
            )
        for message in out:
            if message.has_content():
                self._count(message.content)
        return out

    def _open(self, server_round: int, messages: list[Message]) -> Opened | None:
        """A round on the service's coordinator for the nodes ``messages`` go to (one each),
        which their mods submit their replies to; None (logged) when the service refuses."""
        self._opened.clear()  # a round configured but never aggregated: left to its deadline
        self._drop_prefetches()
        peers = frozenset(peer_of(m.metadata.dst_node_id) for m in messages)
        if len(peers) != len(messages):
            return None
        round_id = RoundId(next(self._rounds), self._initiator)
        try:
            self.link.open_round(round_id, len(peers), timeout=ARRIVAL_TIMEOUT)
        except FlowerBridgeError as exc:
            log.info("round %d: replies not folded as they arrive: %s", server_round, exc)
            return None
        opened = self._opened[server_round] = Opened(round_id, peers)
        self._prefetches[server_round] = self.link.prefetch_round(round_id, timeout=ARRIVAL_TIMEOUT)
        return opened

    def _aggregating(
        self, call: TrainCall, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """``call`` (the strategy's ``aggregate_train``) on the replies: with the service's
        aggregate where the round allows it (``streamed``), else on the replies' own arrays."""
        out = list(replies)
        plan = None if self._refused is not None else plan_round(out, self.strategy.weighted_by_key)
        if isinstance(plan, str):
            log.warning("round %d: replies aggregated in this process: %s", server_round, plan)
        elif plan is not None:
            aggregate = self._arrived(server_round, plan)
            if aggregate is None:
                aggregate = self._aggregate(server_round, plan)
            if aggregate is not None:
                for message in out:
                    if not message.has_error():
                        self._count(message.content)
                arrays, metrics = call(server_round, plan.handed(out, aggregate))
                self.streamed_rounds += 1
                return settled(arrays, aggregate, len(plan.entries)), metrics
        return call(server_round, self._received(out))

    def _arrived(self, server_round: int, plan: Plan) -> dict[str, Any] | None:
        """The aggregate of the round the nodes submitted to as they replied, where it is
        the plan's (``Plan.unlike``); None (logged) where it is not or the service gives none.
        Its prefetch (started by ``_open``) is taken where it brought the aggregate, and
        cancelled otherwise: the round is then awaited and fetched here, as without it."""
        opened = self._opened.pop(server_round, None)
        prefetch = self._prefetches.pop(server_round, None)
        if opened is None:
            return None
        unlike = plan.unlike(opened)
        try:
            if unlike is None:
                _, arrays = self.link.round_aggregate(
                    opened.round_id, timeout=AGGREGATE_TIMEOUT, prefetched=prefetch
                )
                self.arrival_rounds += 1
                if prefetch is not None and prefetch.taken:
                    self.prefetched_rounds += 1
                return arrays
        except AggregateUnavailable as exc:
            unlike = str(exc)
        finally:
            if prefetch is not None:  # not taken: its wait (or fetch) ends here
                prefetch.cancel()
        log.info("round %d: the replies handed are aggregated afresh: %s", server_round, unlike)
        return None

    def _drop_prefetches(self) -> None:
        """End the prefetches of rounds opened and not aggregated."""
        for prefetch in self._prefetches.values():
            prefetch.cancel()
        self._prefetches.clear()

    def _aggregate(self, server_round: int, plan: Plan) -> dict[str, Any] | None:
        """The service's aggregate of the plan's replies; None (logged) when it gives none."""
        round_id = RoundId(next(self._rounds), self._initiator)
        try:
            _, arrays = self.link.aggregate(round_id, plan.entries, timeout=AGGREGATE_TIMEOUT)
        except AggregateUnavailable as exc:
            log.warning("round %d: replies aggregated in this process: %s", server_round, exc)
            return None
        return arrays

    def _push(self, arrays: dict[str, Any]) -> Any:
        return self.link.push(arrays, hold=True)

    def _received(self, replies: Iterable[Message]) -> list[Message]:
        out = list(replies)
        for message in out:
            if message.has_content() and has_reference(message.content):
                self._count(message.content)
                message.content = swap_in(
                    message.content, lambda ref: self.link.fetch(ref.root), writable=False
                )
        return out

    def _count(self, content: RecordDict) -> None:
        self.bytes.carried += content_bytes(content)
        for key, record in content.items():
            if isinstance(record, ConfigRecord) and is_reference(record):
                self.bytes.referenced += ArrayRef.parse(key, dict(record.items())).nbytes


def _stream_refusal(strategy: Strategy, stream: bool | None) -> str | None:
    """Why the service does not aggregate the strategy's replies (None: it does)."""
    if stream is False:
        return "stream=False"
    if stream is None:
        return refusal(strategy)
    if not isinstance(getattr(strategy, "weighted_by_key", None), str):
        raise TypeError(f"stream=True needs a FedAvg-like strategy, not {type(strategy).__name__}")
    return None
