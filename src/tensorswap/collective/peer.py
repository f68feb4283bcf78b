"""Collective: one peer of a group; joins through a rendezvous, serves and fetches slices."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Self

from tensorswap._netaddr import split_host_port
from tensorswap.cid import Cid
from tensorswap.collective._call import CallRun, CallStats, Compression
from tensorswap.collective._reduce import WatchedStore, waker
from tensorswap.collective.errors import BadCollectiveMessage, GroupMismatch, JoinTimedOut
from tensorswap.collective.messages import (
    APP,
    MAX_CHUNKS,
    MAX_MEMBERS,
    MAX_WAIT,
    PEER_APP,
    Answer,
    CallView,
    Join,
    Member,
    Poll,
    RendezvousCall,
    decode_answer,
    decode_join_answer,
    decode_slice,
    decode_view,
    encode,
)
from tensorswap.transport import TcpTransport, Transport
from tensorswap.wire import (
    AppRequest,
    BlockClient,
    BlockHashMismatch,
    BlockServer,
    FailedConnection,
    FrameConnection,
    Timeouts,
    TransportError,
)
from tensorswap.wire.messages import Welcome

__all__ = ["CONGESTION", "POLL_WAIT", "CallStats", "Collective"]

logger = logging.getLogger("tensorswap.collective")

POLL_WAIT = 0.2
"""How long one poll waits at the rendezvous for news: the pace of a peer's sign of life."""
CONGESTION = "cubic"
"""The TCP congestion control of the connections that carry a call's blocks (``join``'s
``congestion``): the butterfly runs n-1 flows through every link at once, which BBR (this
VM's default) shares less evenly than cubic: 0.82 against 0.87 of the bandwidth bound on
the netlab (docs/collective.md, "Measured across shaped links")."""


class Collective:
    """A member of a collective group (see ``join``); ``all_reduce`` averages with the
    others. Calls run one at a time; ``aclose`` (or ``async with``) leaves the group."""

    def __init__(
        self,
        rendezvous: tuple[str, int],
        *,
        group: str,
        peer: str,
        size: int,
        key: bytes | None,
        quorum: int = 1,
        compression: Compression = "none",
        relayed: bool = False,
        congestion: str | None = CONGESTION,
    ) -> None:
        self.rendezvous = rendezvous
        self.relayed = relayed
        """No listener: others reach this peer through the rendezvous (``join(listen=None)``)."""
        self.group, self.peer, self.size, self.key = group, peer, size, key
        self.quorum = quorum
        self.compression: Compression = compression
        self.congestion = congestion
        """The TCP congestion control asked for on the block connections (None: the system's)."""
        self.congestion_refused = 0
        """Block connections whose kernel refused ``congestion`` (they keep the system's)."""
        self.store = WatchedStore()
        self.server = BlockServer(
            self.store,
            key=key,
            handlers={PEER_APP: self._on_slice},
            on_failure=self._on_failure,
            name="collective",
        )
        self.members: list[str] = []
        """The peers whose inputs are in the last result (before any call: the group)."""
        self.roster: list[Member] = []
        self.stats = CallStats()
        self.call = 0
        self.received: dict[tuple[int, str, int], list[bytes]] = {}
        """(call, peer, slice) -> the chunk CIDs that peer says it pushed here."""
        self.pushed_in: dict[int, list[Cid]] = {}
        """call -> the reduced chunks its reducers pushed here (named in their notices)."""
        self.arrivals: dict[tuple[int, str, int], float] = {}
        """(call, peer, slice) -> when (on ``clock``) that notice came."""
        self.rates: dict[str, float] = {}
        """Per peer, the rate (values per second) of its last push measured here."""
        self.forged: dict[str, str] = {}
        """Peers whose push this server refused for a block that fails its CID, and why
        (the call in progress, or the next, accuses them)."""
        self.errors: dict[str, Any] = {}
        """Per tensor name, the compression error kept for error feedback."""
        self.wake = asyncio.Event()
        self.tamper: Callable[[list[Cid]], list[Cid]] | None = None
        """Fault-injection seam, None by default: called once per call with the CIDs of the
        chunks this peer has just committed to; the chunks it returns are what the peer then
        sends (a lying peer, for tests that its reducers name and exclude it)."""
        self.clock: Callable[[], float] = time.monotonic
        """The clock the no-progress rule reads (``_progress``); a test may set its own."""
        self._views: dict[int, CallView] = {}
        self._control: BlockClient | None = None
        self._poll_client: BlockClient | None = None
        self._relay: BlockClient | None = None
        self._relay_lock = asyncio.Lock()
        self._poller: asyncio.Task[None] | None = None
        self._peers: dict[str, BlockClient] = {}
        self._dialing: dict[str, asyncio.Lock] = {}
        self._addresses: dict[str, Member] = {}
        self._lock = asyncio.Lock()
        self._old: list[Cid] = []

    # ── joining ─────────────────────────────────────────────────────────────
    @classmethod
    async def join(
        cls,
        address: str,
        *,
        group: str,
        peer: str,
        size: int,
        key: bytes | None = None,
        listen: str | None = "127.0.0.1:0",
        advertise: str = "",
        timeout: float = 120.0,
        quorum: int = 1,
        compression: Compression = "none",
        congestion: str | None = CONGESTION,
    ) -> Self:
        """Join ``group`` at the rendezvous ``address`` (``HOST:PORT`` of a ``tensorswap
        serve``), serving slices on ``listen``; returns once ``size`` peers are in the group.
        ``listen=None``: open no listener (behind a NAT): the peer only dials out, and the
        rendezvous relays what others push to it and fetch from it (docs/collective.md).

        ``advertise``: the host others dial (default: the address the rendezvous sees).
        Raises JoinTimedOut after ``timeout`` seconds, GroupMismatch when the group has
        another size. ``quorum``: the fewest members a call may end with (TooFewPeers).
        ``congestion``: the TCP congestion control of the connections that carry blocks
        (to and from other peers, and the relay), where the kernel allows it; None keeps
        the system's default."""
        self = cls(
            split_host_port(address),
            group=group,
            peer=peer,
            size=size,
            key=key,
            quorum=quorum,
            compression=compression,
            relayed=listen is None,
            congestion=congestion,
        )
        self.store.on_put = waker(asyncio.get_running_loop(), self.wake)
        try:
            if listen is not None:
                await self.server.start(*split_host_port(listen), handler=self._serve)
            self._control = await self._dial(*self.rendezvous)
            self._poll_client = await self._dial(*self.rendezvous)
            await self._join(advertise, timeout)
        except BaseException:
            await self.aclose()
            raise
        self._poller = asyncio.ensure_future(self._poll_loop())
        return self

    async def _dial(self, host: str, port: int) -> BlockClient:
        """A connection that names this peer in its handshake (how a reducer knows whose
        push failed its checks)."""
        return await BlockClient.connect(
            host, port, key=self.key, timeouts=_TIMEOUTS, name=self.peer
        )

    async def _dial_blocks(self, host: str, port: int) -> BlockClient:
        """``_dial`` for a connection that carries blocks: its congestion control set, on
        the sockets its redials open too."""
        client = await self._dial(host, port)
        self._tune(client.conn.transport)
        redial = client.redial
        if redial is not None:

            async def tuned() -> tuple[FrameConnection, Welcome]:
                conn, welcome = await redial()
                self._tune(conn.transport)
                return conn, welcome

            client.redial = tuned
        return client

    def _tune(self, transport: Transport) -> None:
        if not self.congestion or not isinstance(transport, TcpTransport):
            return
        if not transport.set_congestion_control(self.congestion):
            self.congestion_refused += 1

    async def _serve(self, transport: Transport) -> None:
        """Serve one connection to this peer's slice server (what it sends: fetched slices)."""
        self._tune(transport)
        await self.server.handle(transport)

    async def _join(self, advertise: str, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        while True:
            left = timeout - (loop.time() - start)
            message = Join(
                self.group,
                self.peer,
                self.size,
                advertise,
                0 if self.relayed else self.server.port,
                wait=max(0.0, min(MAX_WAIT, left)),
                relayed=self.relayed,
            )
            answer = decode_join_answer(await self._ask(message), self.peer)
            if answer.error is not None:
                raise GroupMismatch(self.group, answer.error)
            if answer.formed:
                self.roster = list(answer.members)
                self.members = [m.peer for m in answer.members]
                self.call = answer.call
                return
            if left <= 0:
                raise JoinTimedOut(self.group, answer.have, self.size, timeout)

    async def _ask(self, message: RendezvousCall) -> bytes:
        assert self._control is not None  # set by join before any call
        return await self._control.request(APP, encode(message))

    async def ask(self, message: RendezvousCall) -> Answer:
        """A commit / reduced / accuse / done, answered with the call's view."""
        return decode_answer(await self._ask(message), self.peer)

    # ── the view of the current call ────────────────────────────────────────
    async def _poll_loop(self) -> None:
        """Poll the rendezvous for the current call for as long as the group is open."""
        assert self._poll_client is not None
        while True:
            call = self.call
            held = self._views.get(call)
            poll = Poll(self.group, call, self.peer, -1 if held is None else held.version)
            poll = Poll(poll.group, poll.call, poll.peer, poll.version, POLL_WAIT)
            try:
                body = await self._poll_client.request(APP, encode(poll))
                view = decode_view(body, self.peer)
            except (TransportError, BadCollectiveMessage) as exc:
                logger.warning("%s: poll failed: %s", self.peer, exc)
                await asyncio.sleep(POLL_WAIT)  # a pause before the client redials
                continue
            self.note_view(view)

    def note_view(self, view: CallView) -> None:
        """Keep ``view`` if it is newer than the one held; wake the call."""
        held = self._views.get(view.call)
        if held is None or view.version > held.version or view.error is not None:
            self._views[view.call] = view
            for old in [c for c in self._views if c < view.call - 2]:
                del self._views[old]
            self.wake.set()

    def view(self, call: int) -> CallView | None:
        return self._views.get(call)

    # ── peers ───────────────────────────────────────────────────────────────
    async def client_of(self, member: Member) -> BlockClient:
        """A connection to ``member``'s slice server (one per member, kept). Tasks that
        ask at once wait for one dial: a second would replace the first client unclosed."""
        lock = self._dialing.setdefault(member.peer, asyncio.Lock())
        async with lock:
            client = self._peers.get(member.peer)
            if client is None or self._addresses.get(member.peer) != member:
                if client is not None:
                    client.redial = None
                    with contextlib.suppress(Exception):
                        await client.aclose()
                client = await self._dial_blocks(member.host, member.port)
                self._peers[member.peer] = client
                self._addresses[member.peer] = member
            return client

    async def forget_client(self, name: str) -> None:
        """Drop the connection to ``name`` (the next ``client_of`` dials again). A task that
        still holds the old client gets ConnectionBroken from it, not a redialled socket
        that nothing would close."""
        client = self._peers.pop(name, None)
        if client is not None:
            client.redial = None
            with contextlib.suppress(Exception):
                client.conn.transport.abort()

    async def relay_client(self) -> BlockClient:
        """The connection to the rendezvous that carries relayed blocks (dialled once)."""
        async with self._relay_lock:
            if self._relay is None:
                self._relay = await self._dial_blocks(*self.rendezvous)
            return self._relay

    async def forget_relay(self) -> None:
        """Drop the relay connection (the next ``relay_client`` dials again)."""
        client, self._relay = self._relay, None
        if client is not None:
            client.redial = None
            with contextlib.suppress(Exception):
                client.conn.transport.abort()

    async def _on_slice(self, request: AppRequest) -> bytes:
        """A peer's "the blocks just pushed are my slice j of call c" (kept for the call)."""
        sent = decode_slice(request.body, request.peer)
        if sent.group != self.group or sent.call < self.call - 1:
            return b"stale"
        if len(self.received) > 4 * 256 * 256:
            raise BadCollectiveMessage("too many slice notices held", request.peer)
        if sent.reduced:  # blocks stored before a request is handled: only those held
            held = self.pushed_in.setdefault(sent.call, [])
            if len(held) + len(sent.chunks) > 4 * MAX_CHUNKS:
                raise BadCollectiveMessage("too many reduced chunks pushed", request.peer)
            cids = (Cid.parse(raw) for raw in sent.chunks)
            held.extend(c for c in cids if self.store.has(c))
            return b"ok"
        self.received[(sent.call, sent.peer, sent.slice)] = list(sent.chunks)
        self.arrivals[(sent.call, sent.peer, sent.slice)] = self.clock()
        self.wake.set()
        return b"ok"

    def _on_failure(self, failure: FailedConnection) -> None:
        """A connection whose block did not hash to its CID: its client (the name it gave)
        is to be accused of a mismatch."""
        if not isinstance(failure.error, BlockHashMismatch) or not failure.client:
            return
        if failure.client in self.forged or len(self.forged) < MAX_MEMBERS:
            self.forged[failure.client] = str(failure.error)
            self.wake.set()

    # ── the collective calls ────────────────────────────────────────────────
    async def all_reduce(self, tensors: Mapping[str, Any], weight: float = 1.0) -> dict[str, Any]:
        """The weighted mean sum(w_i x_i) / sum(w_i) over the group, float32, the same bits
        on every member; numpy out (torch out for torch in). ``members`` then names the
        peers whose inputs it holds. A peer that dies or lies is dropped and the others
        finish without it; raises PeerExcluded if this peer was dropped, TooFewPeers below
        the quorum, ResultMismatch if members ended with different results. ``tensors``
        must not be written until this returns: they are copied chunk by chunk while the
        call runs (what another task wrote meanwhile may or may not be in this call)."""
        async with self._lock:
            run = CallRun(self, self.call, tensors, weight)
            try:
                result = await run.run()
            finally:
                self._clean(run)
            self.call += 1
            self.members = list(run.final)
            self.stats = run.stats
            return result

    def _clean(self, run: CallRun) -> None:
        """Forget the previous call's blocks (this one's stay: late peers may fetch them)."""
        held = run.blocks()
        keep = set(held)  # equal inputs in two calls are the same blocks: keep this call's
        for cid in self._old:
            if cid not in keep:
                self.store.delete(cid)
        self._old = held
        for key in [k for k in self.received if k[0] <= run.number]:
            del self.received[key]
        for key in [k for k in self.arrivals if k[0] <= run.number]:
            del self.arrivals[key]
        for call in [c for c in self.pushed_in if c <= run.number]:
            del self.pushed_in[call]

    # ── lifecycle ───────────────────────────────────────────────────────────
    async def aclose(self) -> None:
        """Leave: stop polling and serving, close every connection."""
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        for client in [self._control, self._poll_client, self._relay, *self._peers.values()]:
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.aclose()
        self._peers.clear()
        await self.server.aclose()
        await _settle()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


_TIMEOUTS = Timeouts()


async def _settle() -> None:
    """Let the loop run the callbacks that closing (or aborting) transports scheduled, so
    their sockets are closed before the caller's loop may end."""
    for _ in range(2):
        await asyncio.sleep(0)
