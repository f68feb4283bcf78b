"""UpstreamLink: a regional coordinator's RoundClient of the tier above, reconnected with
backoff; it says who it is on every connection (``region.identity``) and counts every byte
it moves."""

from __future__ import annotations

import asyncio
import logging
import ssl as ssl_module
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TypeVar

from tensorswap.cid import Cid
from tensorswap.errors import PrivacyError, RoundsError
from tensorswap.region.errors import RegionError, RegionLoop, UpstreamUnavailable
from tensorswap.region.identity import DOWNSTREAM, MAX_CHAIN, new_coordinator_id, say_hello
from tensorswap.region.throttle import DialThrottle
from tensorswap.rounds.client import (
    RETRYABLE,
    RETRYABLE_CODES,
    Backoff,
    RoundClient,
    SubmitResult,
    request_submit_batch,
    retryable,
)
from tensorswap.rounds.core import RoundId, RoundNotFound, RoundStatus
from tensorswap.rounds.protocol import BatchItem, BatchSubmitRequest, RoundRow, submit_proof
from tensorswap.store import BlockStore
from tensorswap.wire import Timeouts, WireLimits
from tensorswap.wire.errors import (
    AuthenticationFailed,
    ProtocolViolation,
    RemoteError,
)

__all__ = ["DEFAULT_BACKOFF", "Backoff", "LinkTraffic", "UpstreamLink"]

log = logging.getLogger(__name__)

T = TypeVar("T")


TRANSIENT = RETRYABLE
"""Failures after which the link connects again and repeats the request (a submit then
sends only the blocks the upstream still lacks): the rounds clients' own set
(``rounds.client.reconnect.RETRYABLE``)."""

DEFAULT_BACKOFF = Backoff(first=0.1, give_up_after=900.0)
"""The link's reconnection delays: 0.1 s doubling to 5 s, jittered; an operation gives up
(UpstreamUnavailable) after failing for 15 minutes in a row (``--upstream-patience``)."""


@dataclass(frozen=True, slots=True)
class LinkTraffic:
    """Bytes the link sent and received over all its connections, and connections made."""

    bytes_sent: int
    bytes_received: int
    connections: int


class UpstreamLink:
    """Connections to the coordinator above, as the peer ``region``, over the region's store.

    Each operation leases a connection of its own (a long ``wait`` on one round never holds
    up another round's submit), made on demand and kept for reuse. An operation that fails
    with a transient error (``TRANSIENT``) closes its connection and is repeated on a new
    one after a backoff; it raises UpstreamUnavailable once it has failed for
    ``backoff.patience`` seconds in a row. Refusals from the upstream (a RoundsError) and
    authentication or protocol failures are raised at once.

    Every new connection starts with the ``region`` hello: the region's name and the chain
    of coordinator ids the connection passes through (the ``DOWNSTREAM`` chain of the
    request being relayed, then ``identity``; connections are pooled per chain). Dials are
    paced link-wide (``DialThrottle``): after failed dials (busy, refused, a refused hello)
    no dial is made for a growing, capped, jittered delay, then one probe; meanwhile an
    operation that needs a new connection takes the last failure as its own (a transient
    one is retried on its own backoff, a refusal raised at once). A RegionLoop (from the upstream's
    gate, or found here in the upstream's path) stops the link for good (``stop``): every
    operation then raises it without dialling, and ``state`` says so.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        region: str,
        store: BlockStore | None = None,
        key: bytes | None = None,
        peer_key: bytes | None = None,
        ssl: ssl_module.SSLContext | None = None,
        timeouts: Timeouts | None = None,
        limits: WireLimits | None = None,
        backoff: Backoff | None = None,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not region:
            raise ValueError("a region needs a non-empty name (its peer name upstream)")
        self.host, self.port, self.region = host, port, region
        self.store: BlockStore | None = store
        """Where submitted updates are read from and results pulled into (the region's)."""
        self._key, self._ssl, self._timeouts, self._limits = key, ssl, timeouts, limits
        self._peer_key = peer_key
        """The region's own key where the upstream holds per-peer keys: its submits carry
        the proof (``rounds.protocol.batch.submit_proof``)."""
        self.backoff = backoff or DEFAULT_BACKOFF
        self._sleep, self._clock = sleep, clock
        self.identity = new_coordinator_id()
        """This coordinator's id on chains (``RegionalTier.open`` sets its data dir's)."""
        self.upstream_path: tuple[str, ...] = ()
        """The upstream's id and those above it, from its last hello answer."""
        self.stopped: RegionLoop | None = None
        """Why the link stopped for good (a loop), or None."""
        self.below: Callable[[], Collection[str]] = tuple
        """The coordinator ids below this one (its gate's ``below``): an upstream path that
        names one of them is a loop."""
        self.throttle = DialThrottle(self.backoff, clock=clock)
        self._idle: dict[tuple[str, ...], list[RoundClient]] = {}
        self._busy: set[RoundClient] = set()
        self._fetching: dict[Cid, asyncio.Future[None]] = {}
        self._sent = self._received = self._connections = 0
        self._closed = False

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def state(self) -> str:
        """``ok``, ``backing off`` (with the last refusal) or ``stopped`` (with the loop)."""
        if self.stopped is not None:
            return f"stopped: {self.stopped}"
        if self.throttle.last is not None:
            return f"backing off: {self.throttle.last}"
        return "ok"

    def stop(self, reason: RegionLoop) -> None:
        """Stop relaying for good: every operation from now raises ``reason`` (logged once)."""
        if self.stopped is None:
            self.stopped = reason
            log.error("upstream %s: stopped relaying upstream: %s", self.address, reason)

    def _clients(self) -> list[RoundClient]:
        return [*(c for pool in self._idle.values() for c in pool), *self._busy]

    def traffic(self) -> LinkTraffic:
        """Bytes over every connection so far, live ones included (the transports' counts)."""
        live = self._clients()
        # each client's own connection and its cut-through ones (``RoundClient.cut``)
        sent = self._sent + sum(c.blocks.transport.bytes_sent + c.cut.bytes_sent for c in live)
        received = self._received + sum(
            c.blocks.transport.bytes_received + c.cut.bytes_received for c in live
        )
        return LinkTraffic(sent, received, self._connections)

    # ── operations ───────────────────────────────────────────────────────────
    async def round_row(self, round_id: RoundId, *, until_started: bool = False) -> RoundRow:
        """The upstream's row for the round; with ``until_started``, RoundNotFound counts as
        transient (the upper round may be started after the region's)."""
        again = (RoundNotFound,) if until_started else ()
        what = f"reading upstream round {round_id}"
        return await self._retrying(what, lambda c: c.round_row(round_id), again)

    async def submit(self, round_id: RoundId, update: Cid) -> SubmitResult | RoundStatus:
        """Push what the upstream lacks of ``update`` (from the region's store) and submit it;
        with the region's ``peer_key`` as a proven one-item ``submit_batch`` (an upstream
        with per-peer keys refuses plain submits)."""
        what = f"submitting round {round_id}"
        if self._peer_key is None:
            return await self._retrying(what, lambda c: c.submit(round_id, update))
        return await self._retrying(what, lambda c: self._proven(c, round_id, update))

    async def _proven(self, client: RoundClient, round_id: RoundId, update: Cid) -> RoundStatus:
        assert self._peer_key is not None
        await client.blocks.push(client.store, update)
        proof = submit_proof(self._peer_key, round_id, self.region, update)
        request = BatchSubmitRequest(
            round=round_id.round,
            initiator=round_id.initiator,
            items=[BatchItem(self.region, update.to_bytes(), proof)],
        )
        (outcome,) = await request_submit_batch(client, request)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    async def wait(self, round_id: RoundId) -> RoundStatus:
        """The upstream round's terminal status (as long as it takes)."""
        what = f"waiting for upstream round {round_id}"
        return await self._retrying(what, lambda c: c.wait(round_id))

    async def fetch(self, cid: Cid) -> None:
        """Pull what the region's store lacks of ``cid`` from the upstream; callers asking
        for the same CID meanwhile share that one transfer (each update comes down once)."""
        running = self._fetching.get(cid)
        if running is None:

            async def pull(client: RoundClient) -> None:
                await client.blocks.pull(cid, client.store)

            running = asyncio.ensure_future(self._retrying(f"fetching {cid}", pull))
            self._fetching[cid] = running
            running.add_done_callback(lambda done: self._fetched(cid, done))
        await asyncio.shield(running)  # a cancelled caller leaves it to the others

    async def relay(
        self,
        app: str,
        body: bytes,
        *,
        push: Cid | Sequence[Cid] | None = None,
        timeout: float | None = None,
        once: bool = False,
    ) -> bytes:
        """Send the request ``body`` for ``app`` upstream and return the reply body, after
        pushing what the upstream lacks of ``push`` (one root or several, from the region's
        store). ``timeout``
        bounds the wait for the reply (None: the wire's read timeout); ``once``: a transient
        failure raises UpstreamUnavailable at once, without retrying. Not idempotent by
        itself: a request repeated after a broken connection may be answered with a
        refusal (a duplicate), which the reply then carries."""

        async def call(client: RoundClient) -> bytes:
            if push is not None and (isinstance(push, Cid) or len(push) > 0):
                await client.blocks.push(client.store, push)
            return await client.blocks.request(app, body, timeout=timeout or "read")

        patience = 0.0 if once else None
        return await self._retrying(f"relaying a {app!r} request", call, patience=patience)

    def _fetched(self, cid: Cid, done: asyncio.Future[None]) -> None:
        self._fetching.pop(cid, None)
        if not done.cancelled():
            done.exception()  # retrieved here too: its callers may all have gone

    async def aclose(self) -> None:
        """Close every connection (operations in progress fail with a transport error)."""
        self._closed = True
        for client in self._clients():
            await self._discard(client)

    # ── internals ────────────────────────────────────────────────────────────
    async def _retrying(
        self,
        what: str,
        op: Callable[[RoundClient], Awaitable[T]],
        again: tuple[type[BaseException], ...] = (),
        *,
        patience: float | None = None,
    ) -> T:
        delays, failing_since = self.backoff.delays(), None
        if patience is None:
            given = self.backoff.give_up_after
            patience = float("inf") if given is None else given
        retried: tuple[type[BaseException], ...] = (*TRANSIENT, *again, RemoteError)
        while True:
            try:
                async with self._lease() as client:
                    return await op(client)
            except (AuthenticationFailed, ProtocolViolation):
                raise
            except retried as exc:
                if isinstance(exc, RoundsError) and not isinstance(exc, again):
                    raise  # a refusal (PeerNotAuthorised is an OSError too), not a broken link
                if isinstance(exc, RemoteError) and exc.code not in _RETRIED_CODES:
                    raise
                now, delay = self._clock(), next(delays)
                failing_since = now if failing_since is None else failing_since
                if self._closed or now - failing_since >= patience:
                    waited = now - failing_since
                    raise UpstreamUnavailable(self.address, what, waited, str(exc)) from exc
                log.info(
                    "upstream %s: %s failed (%s); again in %.2fs", self.address, what, exc, delay
                )
                await self._sleep(delay)

    @asynccontextmanager
    async def _lease(self) -> AsyncIterator[RoundClient]:
        if self._closed:
            raise UpstreamUnavailable(self.address, "closing", 0.0, "the link is closed")
        if self.stopped is not None:
            raise self.stopped.with_traceback(None)  # raised again and again: no tb grows
        chain = (*DOWNSTREAM.get(), self.identity)
        pool = self._idle.get(chain)
        client = pool.pop() if pool else await self._connect(chain)
        self._busy.add(client)
        try:
            yield client
        except BaseException as exc:
            self._busy.discard(client)
            if isinstance(exc, Exception) and _keeps_connection(exc):
                self._idle.setdefault(chain, []).append(client)  # a refusal: still in sync
            else:
                await self._discard(client)
            raise
        self._busy.discard(client)
        if self._closed:
            await self._discard(client)
        else:
            self._idle.setdefault(chain, []).append(client)

    async def _connect(self, chain: tuple[str, ...]) -> RoundClient:
        if self.store is None:
            raise RuntimeError("the upstream link has no store yet (RegionalTier.attach sets it)")
        if len(chain) > MAX_CHAIN:
            raise RegionError(f"a chain of {len(chain)} coordinators: at most {MAX_CHAIN}")
        blocked = self.throttle.admit()
        if blocked is not None:  # backing off: the last dial's failure stands for this one
            raise blocked.with_traceback(None)
        try:
            client = await self._dial(chain)
        except Exception as exc:
            if isinstance(exc, RegionLoop):
                self.throttle.abandoned()  # the link is stopped: no dial follows
            else:
                delay = self.throttle.failed(exc, refused=not retryable(exc))
                log.info("upstream %s: dial failed (%s); next in %.2fs", self.address, exc, delay)
            raise
        except BaseException:
            self.throttle.abandoned()
            raise
        self.throttle.succeeded()
        self._connections += 1
        return client

    async def _dial(self, chain: tuple[str, ...]) -> RoundClient:
        """A new connection that said hello with ``chain`` (RegionLoop stops the link)."""
        assert self.store is not None
        client = await RoundClient.connect(
            self.host,
            self.port,
            peer=self.region,
            key=self._key,
            peer_key=self._peer_key,
            ssl=self._ssl,
            store=self.store,
            limits=self._limits,
            timeouts=self._timeouts,
        )
        # a partial is not a peer's update: announcing it would make the upper round
        # deterministic (cut-through), which a tier's upper round must not be
        client.cut.enabled = False
        try:
            reply = await say_hello(client.blocks, self.region, chain)
            if reply is not None:
                path = (reply.coordinator, *reply.above)
                self._check_path(chain, path)
                self.upstream_path = path
        except BaseException as exc:
            client.blocks.transport.abort()
            self._sent += client.blocks.transport.bytes_sent + client.cut.bytes_sent
            self._received += client.blocks.transport.bytes_received + client.cut.bytes_received
            if isinstance(exc, RegionLoop):
                self.stop(exc)
            raise
        return client

    def _check_path(self, chain: tuple[str, ...], path: tuple[str, ...]) -> None:
        """RegionLoop if the upstream's path up names this coordinator or one below it."""
        where = " -> ".join((*chain, *path))
        if self.identity in path:
            raise RegionLoop(self.identity, where, "found in the upstream's path up")
        below = set(self.below())
        hit = next((c for c in path if c in below), None)
        if hit is not None:
            raise RegionLoop(self.identity, where, f"{hit}, above, is below this coordinator too")

    async def _discard(self, client: RoundClient) -> None:
        for chain, pool in list(self._idle.items()):
            if client in pool:
                pool.remove(client)
            if not pool:
                del self._idle[chain]
        self._busy.discard(client)
        transport = client.blocks.transport
        self._sent += transport.bytes_sent + client.cut.bytes_sent
        self._received += transport.bytes_received + client.cut.bytes_received
        try:
            await client.aclose()
        except Exception as exc:  # closing a broken connection: nothing left to do
            log.debug("upstream %s: close failed: %s", self.address, exc)


_RETRIED_CODES = RETRYABLE_CODES | {"internal", "checksum_mismatch", "block_hash_mismatch"}
"""RemoteError codes worth another attempt (the upstream was overloaded or hit a fault)."""


def _keeps_connection(exc: Exception) -> bool:
    """Whether the connection stays usable after ``exc`` (the upstream answered a refusal;
    a DP refusal is one too, though PrivacyError is no longer a RoundsError)."""
    return isinstance(exc, RoundsError | PrivacyError)
