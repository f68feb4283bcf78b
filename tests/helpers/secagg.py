"""An in-process SecAgg+ round (the library's server and one client per peer) for tests."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import numpy as np

from tensorswap.privacy.secagg import SecAggClient, SecAggConfig, SecAggServer, decode, encode
from tensorswap.privacy.secagg.protocol import Message
from tensorswap.privacy.secagg.quantize import MODULUS

DIM = 257


def _updates(peers: Collection[int], dim: int = DIM) -> dict[int, tuple[np.ndarray, int]]:
    rng = np.random.default_rng(2026)
    return {p: (rng.normal(0, 0.3, dim).astype(np.float32), 10 + 7 * p) for p in peers}


def _wire(message: Message) -> Message:
    return decode(encode(message))


class Round:
    """An in-process round: the server and one client per peer, messages through msgpack."""

    def __init__(self, config: SecAggConfig) -> None:
        self.config = config
        self.updates = _updates(config.peers, config.dim)
        self.clients = {
            p: SecAggClient(p, u, w, rng=np.random.default_rng(p))
            for p, (u, w) in self.updates.items()
        }
        self.server = SecAggServer(config)
        self.outbox: dict[int, Message] = self.server.setup_messages()
        self.sent: dict[int, list[Message]] = {p: [] for p in config.peers}

    def phase(
        self,
        skip: Collection[int] = (),
        *,
        alter: Callable[[int, Message], Message] | None = None,
        order: Sequence[int] | None = None,
    ) -> None:
        """Every peer not in ``skip`` answers its message (in ``order``, default by id; a
        malicious peer's reply changed by ``alter(peer, reply)``); then the server closes the
        phase."""
        peers = sorted(self.outbox) if order is None else list(order)
        for peer in peers:
            if peer in skip or peer not in self.outbox:
                continue
            reply = self.clients[peer].handle(_wire(self.outbox[peer]))
            if alter is not None:
                reply = alter(peer, reply)
            self.sent[peer].append(reply)
            self.server.receive(_wire(reply))
        self.outbox = self.server.close_phase()

    def run(self, drop_masked: Collection[int] = (), drop_unmask: Collection[int] = ()) -> None:
        self.phase()
        self.phase()
        self.phase(skip=drop_masked)
        self.phase(skip=drop_unmask)

    def plain_sum(self, peers: Collection[int]) -> np.ndarray:
        total = np.zeros(self.config.dim + 1, dtype=np.uint64)
        for p in peers:
            quantized = self.clients[p].quantized
            assert quantized is not None
            total += quantized
        return (total % MODULUS).astype(np.uint32)

    def fedavg(self, peers: Collection[int]) -> np.ndarray:
        weights = sum(self.updates[p][1] for p in peers)
        clipped = {p: np.clip(self.updates[p][0].astype(np.float64), -1, 1) for p in peers}
        return sum(clipped[p] * self.updates[p][1] for p in peers) / weights
