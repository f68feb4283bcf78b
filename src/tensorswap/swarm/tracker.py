"""SwarmTracker: the coordinator's list of peers that serve a result's blocks (the "swarm" app)."""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from tensorswap.cid import Cid
from tensorswap.store.base import BlockStore
from tensorswap.swarm.errors import BadSwarmMessage
from tensorswap.swarm.messages import (
    MAX_LISTED,
    TRACKER_APP,
    Announce,
    Holder,
    HoldersAnswer,
    HoldersQuery,
    decode_call,
    encode,
    parse_root,
)
from tensorswap.wire import AppRequest, BlockServer

__all__ = ["SwarmTracker"]


@dataclass(slots=True)
class _Entry:
    holder: Holder
    seen: float


class SwarmTracker:
    """Which peers serve which roots; answers the ``"swarm"`` app on a coordinator's port.

    - ``announce(root, peer, host, port)``: ``peer`` serves ``root`` (it may still be
      fetching it: a seeder tells fetchers which chunks it holds). Refused (answered with an
      ``error``, the connection goes on) unless the coordinator's ``store`` holds ``root``,
      so only results the coordinator serves are tracked. An empty ``host`` is the address
      the announce came from. Answered with the holders before it.
    - ``holders(root)``: up to MAX_LISTED holders, the asker left out: all of them in
      announce order while they fit, else a random sample (the load spreads).
    - ``leave(root, peer)``.

    Bounded: ``max_roots`` roots (the least recently announced one is forgotten first),
    ``max_holders`` per root (the oldest announce is dropped), and an entry not announced
    again for ``ttl`` seconds is dropped. A peer that does not announce is never listed:
    that is the opt-out. The tracker trusts what authenticated peers announce; a holder that
    lies costs fetchers a retry elsewhere (every block is checked against its CID), never a
    wrong value.
    """

    def __init__(
        self,
        store: BlockStore,
        *,
        max_roots: int = 256,
        max_holders: int = 1024,
        ttl: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.max_roots = max_roots
        self.max_holders = max_holders
        self.ttl = ttl
        self.clock = clock
        self._roots: OrderedDict[Cid, OrderedDict[str, _Entry]] = OrderedDict()
        self.announces = 0
        self.refused = 0

    def attach(self, server: BlockServer) -> SwarmTracker:
        """Answer the ``"swarm"`` app on ``server`` (a RoundServer's ``blocks``)."""
        server.handlers[TRACKER_APP] = self.handle
        return self

    async def handle(self, request: AppRequest) -> bytes:
        """A tracker request's reply body (refusals inside it; BadSwarmMessage if undecodable)."""
        call = decode_call(request.body, request.peer)
        root = parse_root(call.root, request.peer)
        if isinstance(call, Announce):
            try:
                host = call.host or _host_of(request.peer)
                holders = self.announce(root, call.peer, host, call.port)
            except BadSwarmMessage as exc:
                self.refused += 1
                return encode(HoldersAnswer(error=exc.reason))
            return encode(HoldersAnswer(holders=holders))
        if isinstance(call, HoldersQuery):
            return encode(HoldersAnswer(holders=self.holders(root, call.peer)))
        self.leave(root, call.peer)
        return encode(HoldersAnswer())

    def announce(self, root: Cid, peer: str, host: str, port: int) -> list[Holder]:
        if not peer:
            raise BadSwarmMessage("an announce without a peer name")
        if not self.store.has(root):
            raise BadSwarmMessage(f"the coordinator does not serve {root}")
        entries = self._roots.get(root)
        if entries is None:
            entries = self._roots[root] = OrderedDict()
            while len(self._roots) > self.max_roots:
                self._roots.popitem(last=False)
        self._roots.move_to_end(root)
        before = self.holders(root, peer)
        if peer in entries:
            entries[peer].holder = Holder(peer, host, port)
            entries[peer].seen = self.clock()
        else:
            entries[peer] = _Entry(Holder(peer, host, port), self.clock())
            while len(entries) > self.max_holders:
                entries.popitem(last=False)
        self.announces += 1
        return before

    def holders(self, root: Cid, asker: str = "") -> list[Holder]:
        entries = self._roots.get(root)
        if not entries:
            return []
        now = self.clock()
        for name in [n for n, e in entries.items() if now - e.seen > self.ttl]:
            del entries[name]
        listed = [e.holder for n, e in entries.items() if n != asker]
        if len(listed) > MAX_LISTED:
            listed = random.sample(listed, MAX_LISTED)
        return listed

    def leave(self, root: Cid, peer: str) -> None:
        entries = self._roots.get(root)
        if entries is not None:
            entries.pop(peer, None)


def _host_of(peer: str) -> str:
    """The host of a ``host:port`` / ``[v6]:port`` transport peer name."""
    host = peer.rpartition(":")[0] or peer
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host
