"""A RoundClient's side of cut-through rounds: announce an update, stream the result back.

Before pushing an update's chunks, ``RoundClient.submit`` announces it (``begin``: its
manifests, on a connection of its own, ``rounds.protocol.cut``). When the coordinator takes
the announcement, a task on that connection asks for the result's chunks as the coordinator
folds them, while this peer's own chunks still upload on the main connection: the round then
costs about the larger of its upload and its download, not their sum. Every block streamed
is hash-checked into the client's store; the final answer (the round's status) is followed
by whatever of the result the client still lacks, so ``fetch_result`` loads it locally
(``take``). If the coordinator turns the announcement down, predates cut-through, or goes
back to the barrier, the client goes on as before: the chunks streamed were a prefetch,
used only where the result's manifest names them.

An update cut in other chunks than the coordinator's results cannot take part. The
coordinator says its chunk size in the connection's Welcome (``Welcome.chunk_bytes``), so a
fresh client cuts its first update that way; where it did not (an older coordinator, a size
changed since), the refusal of the announcement says it, and the client re-cuts that update
once and cuts every later one so (``chunk_bytes``).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Protocol

from tensorswap.cid import Cid
from tensorswap.codec import DType
from tensorswap.errors import StoreError, TensorSwapError
from tensorswap.rounds.client._cut_gate import DEFAULT_LEAD_BYTES, UploadGate
from tensorswap.rounds.client.retention import RoundBlocks
from tensorswap.rounds.core.state import Complete, RoundId, RoundStatus
from tensorswap.rounds.protocol.batch import submit_proof
from tensorswap.rounds.protocol.cut import (
    APP_ANNOUNCE,
    APP_STREAM,
    MAX_ANNOUNCE_BYTES,
    AnnounceAnswer,
    AnnounceRequest,
    StreamRequest,
    decode_announce_answer,
    decode_stream_answer,
    encode,
)
from tensorswap.rounds.protocol.messages import CompleteWire
from tensorswap.store import (
    DEFAULT_CHUNK_BYTES,
    BlockStore,
    ModelUpdate,
    chunk_bounds,
    put_update,
    read_manifest,
)
from tensorswap.store.manifest import TensorManifest
from tensorswap.wire import BlockClient, RemoteError


class RoundClient(Protocol):
    """What of a ``RoundClient`` its cut-through uses."""

    peer: str
    blocks: BlockClient
    store: BlockStore
    retention: RoundBlocks | None
    peer_key: bytes | None
    dial: Callable[[], Awaitable[BlockClient]] | None


__all__ = ["CutThroughClient"]

log = logging.getLogger(__name__)

_POLL = 30.0  # seconds one stream request waits for a piece at most
_ROUNDS_KEPT = 8  # rounds whose stream is remembered (older ones are cancelled)


class CutThroughClient:
    """The announce and the result stream of one RoundClient (see the module docstring).

    ``enabled`` False (or a coordinator that predates cut-through, which turns it off) makes
    every round a barrier round. ``chunk_bytes``: how ``submit`` cuts updates given as values.
    ``streamed`` counts the result blocks that arrived by the stream."""

    def __init__(self, client: RoundClient) -> None:
        self.client = client
        self.enabled = True
        self.chunk_bytes = _said_chunk_bytes(client.blocks)
        self.streamed = 0
        self.lead_bytes: int | None = DEFAULT_LEAD_BYTES
        """How far this peer's upload may run ahead of the pieces streamed back
        (``client._cut_gate``); None: not paced."""
        self.paced_waits = 0
        """Chunks of this client's uploads that waited for the round (over all rounds)."""
        self._gates: dict[RoundId, UploadGate] = {}
        self._idle: list[BlockClient] = []
        self._closing: set[asyncio.Task[None]] = set()
        self._live: set[BlockClient] = set()  # its connections not yet closed
        self._gone = (0, 0)  # bytes sent and received over the closed ones
        self._tasks: OrderedDict[RoundId, asyncio.Task[RoundStatus | None]] = OrderedDict()

    @property
    def bytes_sent(self) -> int:
        """Bytes sent over this client's cut-through connections (live ones included)."""
        return self._gone[0] + sum(c.transport.bytes_sent for c in self._live)

    @property
    def bytes_received(self) -> int:
        """Bytes received over this client's cut-through connections (live ones included)."""
        return self._gone[1] + sum(c.transport.bytes_received for c in self._live)

    def streaming(self, round_id: RoundId) -> bool:
        """Whether the round's result is coming by the stream (a waited submit then asks for
        no blocks behind its answer)."""
        return round_id in self._tasks

    async def begin(self, round_id: RoundId, cid: Cid, update: ModelUpdate | None) -> Cid:
        """Announce ``cid`` for the round and start streaming its result; the CID to push
        (``update`` re-cut to the coordinator's chunk size where it had to be)."""
        client = self.client
        if not self.enabled or client.dial is None or round_id in self._tasks:
            return cid
        try:
            conn = self._idle.pop() if self._idle else await client.dial()
            self._live.add(conn)
        except (OSError, TensorSwapError) as exc:
            log.info("cut-through off: no second connection (%s)", exc)
            self.enabled = False
            return cid
        answer = await self._announce(conn, round_id, cid)
        if answer is not None and not answer.ok and update is not None:
            size = answer.chunk_bytes
            if size > 0 and not _cut_in(client.store, cid, size):  # as the coordinator cuts
                self.chunk_bytes = size
                cid = await asyncio.to_thread(put_update, client.store, update, chunk_bytes=size)
                answer = await self._announce(conn, round_id, cid)
        if answer is None or not answer.ok:
            if answer is not None:
                log.debug("round %s: no cut-through: %s", round_id, answer.reason)
            self._give_back(conn)
            return cid
        gate = self._gate_of(cid)
        if gate is not None:
            self._gates[round_id] = gate
        self._tasks[round_id] = asyncio.create_task(self._stream(conn, round_id, gate))
        while len(self._tasks) > _ROUNDS_KEPT:
            rid, old = self._tasks.popitem(last=False)
            old.cancel()
            self._drop_gate(rid)
        return cid

    def gate(self, round_id: RoundId) -> UploadGate | None:
        """The pacing of this peer's upload in the round (None: not paced)."""
        return self._gates.get(round_id)

    def before_send(self, round_id: RoundId) -> Callable[[Cid], Awaitable[None]] | None:
        """What a push of this peer's chunks to the round awaits before each (None: none)."""
        gate = self._gates.get(round_id)
        return None if gate is None else gate.before

    def _gate_of(self, cid: Cid) -> UploadGate | None:
        if not self.lead_bytes:
            return None
        try:
            return UploadGate.of(self.client.store, cid, lead_bytes=self.lead_bytes)
        except StoreError:
            return None

    def _drop_gate(self, round_id: RoundId) -> None:
        gate = self._gates.pop(round_id, None)
        if gate is not None:
            gate.close()
            self.paced_waits += gate.waits

    async def _announce(
        self, conn: BlockClient, round_id: RoundId, cid: Cid
    ) -> AnnounceAnswer | None:
        client = self.client
        try:
            blocks = _manifest_blocks(client, cid)
        except StoreError:
            return None
        if sum(len(data) for _, data in blocks) > MAX_ANNOUNCE_BYTES:
            return None
        key = client.peer_key
        proof = b"" if key is None else submit_proof(key, round_id, client.peer, cid)
        call = AnnounceRequest(
            round=round_id.round,
            initiator=round_id.initiator,
            peer=client.peer,
            update=cid.to_bytes(),
            blocks=blocks,
            proof=proof,
        )
        try:
            return decode_announce_answer(await conn.request(APP_ANNOUNCE, encode(call)))
        except RemoteError as exc:
            if exc.code == "unsupported":
                self.enabled = False  # a coordinator from before cut-through
            return None

    async def _stream(
        self, conn: BlockClient, round_id: RoundId, gate: UploadGate | None = None
    ) -> RoundStatus | None:
        """Ask for the result's pieces until the round ends; its status (Complete: the
        result whole in the store), or None when the round went back to the barrier."""
        client, after, got, ready = self.client, 0, [], False
        read = conn.conn.timeouts.read
        ok = False
        try:
            while True:
                call = StreamRequest(
                    round=round_id.round,
                    initiator=round_id.initiator,
                    peer=client.peer,
                    after=after,
                    timeout=_POLL,
                    ready=ready,
                )
                body, pulled = await conn.request_blocks(
                    APP_STREAM,
                    encode(call),
                    client.store,
                    _roots_of,
                    timeout=None if read is None else _POLL + read,
                )
                self.streamed += pulled.blocks
                answer = decode_stream_answer(body)
                if answer.abandoned or answer.status is not None:
                    ok = True
                    return None if answer.abandoned else answer.status.to_status()  # type: ignore[union-attr]
                new = answer.chunk_cids()
                after += len(new)
                got.extend(new)
                ready = ready or answer.ready
                if gate is not None and ready:
                    gate.arm()
                    gate.progressed(after)
        finally:
            if gate is not None:
                gate.close()
            if client.retention is not None and got:
                client.retention.hold_new(round_id, got)
            if ok:
                self._give_back(conn)
            else:  # cancelled or failed mid-answer: not for another stream
                await asyncio.shield(self._close(conn))

    async def take(self, round_id: RoundId, timeout: float | None) -> Cid | None:
        """The round's result CID when its stream brought it whole into the store; None
        when there was no stream, it went back to the barrier or failed (the caller fetches
        as usual). Waits up to ``timeout`` seconds (None: as long as the stream takes)."""
        task = self._tasks.pop(round_id, None)
        self._drop_gate(round_id)
        if task is None:
            return None
        try:
            status = await asyncio.wait_for(asyncio.shield(task), timeout)
        except TimeoutError:
            task.cancel()
            return None
        except (OSError, TensorSwapError) as exc:
            log.info("round %s: the result stream failed (%s); fetching it", round_id, exc)
            return None
        return Cid.parse(status.cid) if isinstance(status, Complete) else None

    async def cancel(self, round_id: RoundId) -> None:
        """Stop streaming the round's result (it is fetched otherwise: a ``SwarmPeer``)."""
        task = self._tasks.pop(round_id, None)
        self._drop_gate(round_id)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def _give_back(self, conn: BlockClient) -> None:
        if len(self._idle) >= 2:
            self._closing.add(asyncio.get_running_loop().create_task(self._close(conn)))
            for task in [t for t in self._closing if t.done()]:
                self._closing.discard(task)
        else:
            self._idle.append(conn)

    async def aclose(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for round_id in list(self._gates):
            self._drop_gate(round_id)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        idle, self._idle = self._idle, []
        for conn in idle:
            await self._close(conn)
        await asyncio.gather(*self._closing, return_exceptions=True)

    async def _close(self, conn: BlockClient) -> None:
        if conn in self._live:
            self._live.discard(conn)
            sent, received = self._gone
            transport = conn.transport
            self._gone = (sent + transport.bytes_sent, received + transport.bytes_received)
        await conn.aclose()


MIN_SAID_CHUNK_BYTES = 4096


def _said_chunk_bytes(blocks: BlockClient) -> int:
    """The coordinator's result chunk size where its Welcome says one in bounds (a fresh
    client then cuts its first update so, not twice); else the default."""
    said = blocks.welcome.chunk_bytes
    fits = MIN_SAID_CHUNK_BYTES <= said <= blocks.welcome.max_block_bytes
    return said if isinstance(said, int) and fits else DEFAULT_CHUNK_BYTES


def _cut_in(store: BlockStore, cid: Cid, size: int) -> bool:
    """Whether every tensor of update ``cid`` is cut in chunks of ``size`` bytes."""
    try:
        for link in read_manifest(store, cid).links():
            tensor = read_manifest(store, link)
            if not isinstance(tensor, TensorManifest):
                return False
            got = [0]
            for chunk in tensor.chunks:
                got.append(got[-1] + chunk.values)
            itemsize = DType.parse(tensor.dtype).numpy.itemsize
            if tensor.chunks and tuple(got) != chunk_bounds(tensor.size, itemsize, size):
                return False
    except (StoreError, ValueError):
        return False
    return True


def _manifest_blocks(client: RoundClient, cid: Cid) -> list[tuple[bytes, bytes]]:
    """The update's manifest and its tensors' manifests, ``[cid, bytes]``, root first."""
    store = client.store
    root = read_manifest(store, cid)
    blocks = [(cid.to_bytes(), bytes(store.get(cid)))]
    for link in root.links():
        blocks.append((link.to_bytes(), bytes(store.get(link))))
    return blocks


def _roots_of(body: bytes) -> list[Cid]:
    answer = decode_stream_answer(body)
    if isinstance(answer.status, CompleteWire):
        return [Cid.parse(answer.status.cid)]
    return answer.sent_cids()
