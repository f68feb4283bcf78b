"""RegionGate: a coordinator's ``region`` app, where the regions below say hello (see
``region.identity``): region names held by one live coordinator each, loops refused."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tensorswap.region.errors import RegionError, RegionLoop, RegionNameTaken
from tensorswap.region.identity import (
    APP_REGION,
    DOWNSTREAM,
    MAX_CHAIN,
    RegionHello,
    RegionReply,
    decode_hello,
    encode,
    new_coordinator_id,
)
from tensorswap.rounds.protocol import error_info
from tensorswap.wire import AppRequest

if TYPE_CHECKING:
    from tensorswap.region.link import UpstreamLink
    from tensorswap.rounds.server import RoundServer

__all__ = ["MAX_CLAIMS", "RegionGate"]

log = logging.getLogger(__name__)

MAX_CLAIMS = 4096
"""Region names held at once; past it, names whose holder has no live connection go first,
and a hello that still finds no room is refused."""


@dataclass
class _Claim:
    identity: str
    """The coordinator id that holds the name."""
    connections: set[str] = field(default_factory=set)
    """The addresses of its connections here whose serving task still runs."""


class RegionGate:
    """The ``region`` app of ``server``: a region's link says hello on each connection.

    Guarantees:

    - A hello whose chain names this coordinator, or a coordinator above it (``link``'s
      upstream path), is refused with RegionLoop, and this coordinator's own link stops
      when the loop runs through it (the chain also names its upstream, or names a
      coordinator above it): so both ends of a loop stop, each saying why. The
      link checks the other order itself: an upstream path that names a coordinator below
      (on the chain of a live connection here) is a loop too (``below``), so two regions
      that dial each other at the same moment still find it.
    - A region name is held by the coordinator (its id) whose hello named it, while that
      coordinator has a live connection here (its serving task runs and its end of the
      connection is not closed). A hello from another coordinator with that name is refused
      with RegionNameTaken, naming it; one from the same coordinator (a reconnect, or a
      restart over the same data directory) is always accepted; once none of the holder's
      connections is live, another coordinator may take the name (logged).
    - The chain of an accepted hello is the connection's ``DOWNSTREAM`` for the requests
      that follow on it, so a relay upstream from here carries it further.

    Names are held in memory: after this coordinator restarts, the first region to say hello
    with a name holds it. ``identity`` defaults to ``link.identity`` (a region's gate and its
    link are one coordinator), else to a fresh id.
    """

    def __init__(
        self,
        server: RoundServer,
        identity: str | None = None,
        *,
        link: UpstreamLink | None = None,
    ) -> None:
        if identity is None:
            identity = link.identity if link is not None else new_coordinator_id()
        elif link is not None and link.identity != identity:
            raise ValueError("a region's gate and its link must share one coordinator id")
        self.server, self.identity, self.link = server, identity, link
        self._claims: dict[str, _Claim] = {}
        self._chains: dict[str, tuple[str, ...]] = {}  # live hello'd connections' chains
        self.refused = {"loop": 0, "name_taken": 0}
        server.blocks.handlers[APP_REGION] = self._on_hello
        server.stat_sources.append(self.stats)
        if link is not None:
            link.below = self.below

    async def _on_hello(self, request: AppRequest) -> bytes:
        hello = decode_hello(request.body)  # ProtocolViolation: the connection fails
        try:
            self._check_loop(hello)
            self._claim(hello, request.peer)
        except RegionError as exc:
            log.warning("refused region %r from %s: %s", hello.region, request.peer, exc)
            return encode(RegionReply(error=error_info(exc)))
        DOWNSTREAM.set(tuple(hello.chain))  # this connection's task: its later requests
        self._chains[request.peer] = tuple(hello.chain)
        above = self.above()
        return encode(RegionReply(coordinator=self.identity, above=list(above)))

    def below(self) -> set[str]:
        """The coordinators on the chains of the live region connections here."""
        return {c for chain in self._chains.values() for c in chain}

    def above(self) -> tuple[str, ...]:
        """The coordinators above this one, nearest first, as its link learnt them."""
        if self.link is None:
            return ()
        return self.link.upstream_path[: MAX_CHAIN - 1]

    # ── loops ────────────────────────────────────────────────────────────────
    def _check_loop(self, hello: RegionHello) -> None:
        path = " -> ".join([*hello.chain, self.identity])
        above = self.above()
        if self.identity in hello.chain:
            loop = RegionLoop(self.identity, path)
            # through this coordinator's own upstream: its way up loops back here
            ours = bool(above) and above[0] in hello.chain
        else:
            hit = next((c for c in hello.chain if c in above), None)
            if hit is None:
                return
            loop = RegionLoop(self.identity, path, f"{hit} is above this coordinator too")
            ours = True  # a coordinator above this one is also below it
        self.refused["loop"] += 1
        if ours and self.link is not None:
            self.link.stop(loop)
        raise loop

    # ── names ────────────────────────────────────────────────────────────────
    def _claim(self, hello: RegionHello, address: str) -> None:
        identity = hello.chain[-1]
        claim = self._claims.get(hello.region)
        if claim is not None and claim.identity != identity:
            if self._live(claim):
                self.refused["name_taken"] += 1
                raise RegionNameTaken(hello.region, claim.identity, identity)
            log.warning(
                "region %r: now coordinator %s (%s had no live connection left)",
                hello.region,
                identity,
                claim.identity,
            )
            claim = None
        if claim is None:
            self._make_room()
            claim = self._claims[hello.region] = _Claim(identity)
        claim.connections.add(address)
        task = asyncio.current_task()
        if task is not None:  # the connection's serving task: it ends with the connection
            task.add_done_callback(
                functools.partial(self._release, hello.region, identity, address)
            )

    def _release(self, region: str, identity: str, address: str, _: object) -> None:
        self._chains.pop(address, None)
        claim = self._claims.get(region)
        if claim is not None and claim.identity == identity:
            claim.connections.discard(address)

    def _live(self, claim: _Claim) -> bool:
        """Whether any connection of the claim's holder is still up (its end not closed)."""
        listener = self.server.blocks.listener
        if listener is None or not claim.connections:
            return bool(claim.connections)
        up = {t.peer for t in listener.served() if not t.peer_closed}
        return not claim.connections.isdisjoint(up)

    def _make_room(self) -> None:
        if len(self._claims) < MAX_CLAIMS:
            return
        for name in [n for n, c in self._claims.items() if not self._live(c)]:
            del self._claims[name]
        if len(self._claims) >= MAX_CLAIMS:
            raise RegionError(f"{len(self._claims)} region names held here: no room for more")

    def holders(self) -> dict[str, str]:
        """Each region name held here and the coordinator id holding it."""
        return {name: claim.identity for name, claim in self._claims.items()}

    def stats(self) -> Mapping[str, float | int | str]:
        """For the server's ``status`` stats: this coordinator's id, the regions below, the
        hellos refused, and (for a region) the state of its link upstream."""
        out: dict[str, float | int | str] = {
            "coordinator_id": self.identity,
            "regions_below": sum(1 for c in self._claims.values() if c.connections),
            "region_loops_refused": self.refused["loop"],
            "region_names_refused": self.refused["name_taken"],
        }
        if self.link is not None:
            out["upstream_state"] = self.link.state
        return out
