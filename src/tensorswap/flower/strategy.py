"""BlockStrategy: wraps a Flower Strategy so that the arrays of the messages it sends travel as
blocks (references in the messages) and the replies' references are resolved before it
aggregates."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from tensorswap.flower.link import BlockLink
from tensorswap.flower.records import has_reference, swap_in, swap_out
from tensorswap.flower.reference import ArrayRef, is_reference

__all__ = ["BlockStrategy", "MessageBytes"]

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
    """

    def __init__(
        self,
        strategy: Strategy,
        address: str,
        *,
        key: bytes | None = None,
        swarm: bool = True,
        link: BlockLink | None = None,
    ) -> None:
        self.strategy = strategy
        self.address = address
        self.swarm = swarm
        self.link = link if link is not None else BlockLink(address, key=key)
        self.bytes = MessageBytes()

    def __getattr__(self, name: str) -> Any:
        if name == "strategy":  # not yet set (during unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.strategy, name)

    def close(self) -> None:
        self.link.close()

    def __enter__(self) -> BlockStrategy:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ── Strategy ─────────────────────────────────────────────────────────────
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return self._sending(self.strategy.configure_train(server_round, arrays, config, grid))

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        return self.strategy.aggregate_train(server_round, self._received(replies))

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
        sending = {"configure_train", "configure_evaluate"}
        for name, call in originals.items():
            bridge = self._sending_call(call) if name in sending else self._received_call(call)
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

    def _received_call(self, call: Callable[..., Any]) -> Callable[..., Any]:
        def bridge(server_round: int, replies: Iterable[Message]) -> Any:
            return call(server_round, self._received(replies))

        return bridge

    # ── the swaps ────────────────────────────────────────────────────────────
    def _sending(self, messages: Iterable[Message]) -> list[Message]:
        out = list(messages)
        memo: dict[int, ArrayRef | None] = {}
        for message in out:
            if message.has_content():
                message.content = swap_out(message.content, self._push, swarm=self.swarm, memo=memo)
                self._count(message.content)
        return out

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
