"""The coordinator's cut-through applications: announcements in, the result streamed out.

``CutService`` answers ``"rounds/announce"`` and ``"rounds/stream"`` (``rounds.protocol.cut``)
for a ``RoundServer`` over the coordinator's ``CutThrough`` (``rounds.engine.cut``), and hands
that state every block the block service stores. A stream request waits on the event loop
(no thread held), woken when a piece of the round's result is stored, the round's
cut-through is abandoned, or the round ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from tensorswap.cid import Cid
from tensorswap.errors import HashMismatch
from tensorswap.rounds.core import PeerNotAuthorised
from tensorswap.rounds.core.state import Complete, RoundId, RoundStatus
from tensorswap.rounds.engine.coordinator import Coordinator
from tensorswap.rounds.protocol.batch import PeerKeys
from tensorswap.rounds.protocol.cut import (
    APP_ANNOUNCE,
    APP_STREAM,
    MAX_STREAM_CHUNKS,
    AnnounceAnswer,
    StreamAnswer,
    StreamRequest,
    decode_announce,
    decode_stream,
    encode,
)
from tensorswap.rounds.protocol.messages import status_to_wire
from tensorswap.rounds.server._waiters import Waiters
from tensorswap.wire import AppRequest, BlocksReply, RequestHandler
from tensorswap.wire.errors import BlockHashMismatch

__all__ = ["CutService"]


class CutService:
    """The announce and stream handlers of one RoundServer (see the module docstring).

    ``peer_keys`` (a callable: the server's keys may be set after it is built) makes every
    announcement prove its peer's key, as submits must. ``max_wait`` bounds one stream
    request's wait, whatever the client asked.
    """

    def __init__(
        self,
        coordinator: Coordinator,
        peer_keys: Callable[[], PeerKeys | None],
        max_wait: Callable[[], float],
    ) -> None:
        self.coordinator = coordinator
        self.cut = coordinator.cut
        self._peer_keys = peer_keys
        self._max_wait = max_wait
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiters = Waiters()
        self.cut.listeners.append(self._changed)
        coordinator.subscribe(self._status_changed)

    @property
    def handlers(self) -> dict[str, RequestHandler]:
        return {APP_ANNOUNCE: self.announce, APP_STREAM: self.stream}

    def on_stored(self, cid: Cid, data: memoryview) -> None:
        """The block service's hook: every stored block goes to the cut-through state."""
        self.cut.on_stored(cid, data)

    async def announce(self, request: AppRequest) -> bytes:
        self._loop = asyncio.get_running_loop()
        call = decode_announce(request.body)
        rid, cid = call.round_id, call.cid
        keys = self._peer_keys()
        if keys is not None:
            try:
                keys.check(rid, call.peer, cid, call.proof)
            except PeerNotAuthorised as exc:
                return encode(AnnounceAnswer(False, str(exc)))
        try:
            verdict = await asyncio.to_thread(
                self.cut.announce, rid, call.peer, cid, call.manifests()
            )
        except HashMismatch as exc:  # bad bytes from the peer: the connection ends
            raise BlockHashMismatch(exc.cid, exc.actual) from exc
        return encode(AnnounceAnswer(verdict.ok, verdict.reason, verdict.chunk_bytes))

    async def stream(self, request: AppRequest) -> bytes:
        self._loop = asyncio.get_running_loop()
        call = decode_stream(request.body)
        rid = call.round_id
        try:
            with self._waiters.waiting(rid) as event:
                async with asyncio.timeout(min(call.timeout, self._max_wait())):
                    while True:
                        event.clear()
                        answer = self._answer(call)
                        if answer is not None:
                            return answer
                        await event.wait()
        except TimeoutError:
            return _plain(StreamAnswer())  # nothing new yet: the client asks again

    def _answer(self, call: StreamRequest) -> bytes | None:
        """The answer to ``call`` now, or None while there is nothing new to say."""
        rid = call.round_id
        status = self.coordinator.status(rid)
        if status is None:
            return _plain(StreamAnswer(abandoned="no such round"))
        if status.is_terminal:
            return self._terminal(call, status)
        state = self.cut.state(rid)
        if state is None:
            return _plain(StreamAnswer(abandoned="the coordinator holds no cut-through for it"))
        progress, abandoned = state
        if abandoned is not None:
            return _plain(StreamAnswer(abandoned=abandoned))
        if len(progress) <= call.after:
            if call.ready is False and self.cut.ready(rid):
                return _plain(StreamAnswer(ready=True))  # the client's pacing may start
            return None
        new = progress[call.after : call.after + MAX_STREAM_CHUNKS]
        # a piece every peer holds as the same block (a frozen layer) is that block: the
        # peer pushed it, so it is listed (``own``) but not sent back
        mine = set(self.cut.peer_blocks(rid, call.peer))
        own = [i for i, c in enumerate(new) if c in mine]
        body = encode(StreamAnswer(chunks=[c.to_bytes() for c in new], own=own, ready=True))
        return BlocksReply(body, [c for c in new if c not in mine], [])

    def _terminal(self, call: StreamRequest, status: RoundStatus) -> bytes:
        body = encode(StreamAnswer(status=status_to_wire(status)))
        if not isinstance(status, Complete):
            return BlocksReply(body, [], [])
        rid = call.round_id
        state = self.cut.state(rid)
        streamed = [] if state is None else state[0][: call.after]
        have = streamed + self.cut.peer_blocks(rid, call.peer)
        return BlocksReply(body, [Cid.parse(status.cid)], have)

    def _status_changed(self, rid: RoundId, status: RoundStatus) -> None:
        if status.is_terminal:
            self._changed(rid)

    def _changed(self, rid: RoundId) -> None:
        """From any thread: wake the round's stream requests on the loop."""
        loop = self._loop
        if rid in self._waiters and loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._wake, rid)

    def _wake(self, rid: RoundId) -> None:
        self._waiters.wake(rid)


def _plain(answer: StreamAnswer) -> BlocksReply:
    """An answer no block follows (the client still reads the closing Got, as after any
    ``"rounds/stream"`` reply)."""
    return BlocksReply(encode(answer), [], [])
