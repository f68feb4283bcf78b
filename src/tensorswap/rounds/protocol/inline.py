"""Submit a tiny update in one request: its blocks ride inside the submit (one round trip).

A plain ``RoundClient.submit`` costs an Offer (which blocks does the coordinator lack?), the
BLOCK frames, then the ``submit`` request: two round trips and five or more frames for an
update of a few hundred bytes, where the per-frame Python on both sides costs more than the
bytes. An ``InlineSubmitRequest`` carries the update's blocks (children before the manifests
that list them) with the submit, addressed to its own application, ``APP_INLINE``: a
coordinator that predates it answers "no handler" (``Reply.handled`` False) and the
connection goes on, so the client falls back to the plain path and remembers.

What the coordinator does with one (``RoundServer``): checks the peer's proof when it holds
per-peer keys (the ``rounds.protocol.batch.submit_proof`` of this contribution; nothing is
stored for a refused one), reserves the blocks' bytes in the block server's in-flight budget and
hands the submit to the round's intake with its blocks: the intake's worker thread checks each
block against its CID (a mismatch fails the connection with ``BlockHashMismatch``, as a
BLOCK frame's would) and stores it, then submits the update with the others queued
meanwhile, exactly as ``submit`` (one thread hop and one transaction per batch, durable
before the answer); the event loop only decodes and answers. The answer is a
``RoundAnswer``, as for ``submit``. Blocks the coordinator already holds are stored again
(their age restarts): for updates this small a resend costs less than asking.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import msgspec

from tensorswap.cid import Cid
from tensorswap.errors import HashMismatch, InvalidCid, TensorSwapError
from tensorswap.rounds.core.model import RoundId, RoundStatus
from tensorswap.rounds.protocol.batch import PROOF_BYTES
from tensorswap.rounds.protocol.messages import MAX_NAME_BYTES, _Request, utf8_len
from tensorswap.rounds.storage._fresh import FreshBlocks
from tensorswap.rounds.storage._tiered import small_or_none
from tensorswap.store import BlockStore
from tensorswap.wire import ByteBudget, ProtocolViolation, Reservation
from tensorswap.wire.errors import BlockHashMismatch

if TYPE_CHECKING:
    from tensorswap.rounds.engine.coordinator import Coordinator

__all__ = [
    "APP_INLINE",
    "INLINE_SEND_BYTES",
    "MAX_INLINE_BLOCKS",
    "MAX_INLINE_BYTES",
    "Blocks",
    "InlineBlock",
    "InlineSubmitRequest",
    "decode_inline",
    "encode_inline",
    "inline_blocks",
    "intake_batch",
    "put_blocks",
    "reserve_inline",
]

APP_INLINE = "rounds/inline"
"""The application an inline submit is addressed to (a REQUEST frame's ``app``)."""

MAX_INLINE_BLOCKS = 256
"""The most blocks one inline submit may carry."""

MAX_INLINE_BYTES = 1024 * 1024
"""The most block bytes (in all) one inline submit may carry; anything larger is refused."""

INLINE_SEND_BYTES = 32 * 1024
"""``RoundClient.submit`` sends an update inline when its blocks total at most this."""


class InlineBlock(msgspec.Struct, frozen=True, array_like=True):
    """One block of an inline submit: ``[cid (binary), bytes]``."""

    cid: bytes
    data: bytes


class InlineSubmitRequest(_Request, frozen=True, omit_defaults=True, tag="submit_inline"):
    """Store ``blocks`` (children first), then submit ``update`` for ``peer``; ``proof`` is
    the peer's ``submit_proof`` (empty where the coordinator holds no per-peer keys)."""

    peer: str
    update: bytes
    blocks: list[InlineBlock]
    proof: bytes = b""

    def __post_init__(self) -> None:
        self._check_round_id()
        size = utf8_len(self.peer)
        if not 0 < size <= MAX_NAME_BYTES:
            raise ValueError(
                f"an inline submit's peer name is {size} bytes long; 1 to {MAX_NAME_BYTES} allowed"
            )
        if len(self.proof) not in (0, PROOF_BYTES):
            raise ValueError(f"an inline submit's proof is {len(self.proof)} bytes long")
        if not 0 < len(self.blocks) <= MAX_INLINE_BLOCKS:
            raise ValueError(
                f"an inline submit carries {len(self.blocks)} blocks; "
                f"1 to {MAX_INLINE_BLOCKS} allowed"
            )
        total = sum(len(block.data) for block in self.blocks)
        if total > MAX_INLINE_BYTES:
            raise ValueError(
                f"an inline submit carries {total} bytes of blocks; "
                f"at most {MAX_INLINE_BYTES} allowed"
            )
        try:
            Cid.parse(self.update)
            for block in self.blocks:
                Cid.parse(block.cid)
        except InvalidCid as exc:
            raise ValueError(f"an inline submit names an invalid CID: {exc.reason}") from None

    @property
    def cid(self) -> Cid:
        """The update's CID (checked when this request was built or decoded)."""
        return Cid.parse(self.update)

    @property
    def nbytes(self) -> int:
        """The blocks' bytes, in all."""
        return sum(len(block.data) for block in self.blocks)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(InlineSubmitRequest)


def encode_inline(
    round_id: RoundId,
    peer: str,
    update: Cid,
    blocks: Sequence[tuple[Cid, bytes | memoryview]],
    proof: bytes = b"",
) -> bytes:
    """The REQUEST body of an inline submit (the blocks in the order given: children first)."""
    call = InlineSubmitRequest(
        round=round_id.round,
        initiator=round_id.initiator,
        peer=peer,
        update=update.to_bytes(),
        blocks=[InlineBlock(cid.to_bytes(), data) for cid, data in blocks],  # type: ignore[arg-type]
        proof=proof,
    )
    return _encoder.encode(call)


def decode_inline(body: bytes) -> InlineSubmitRequest:
    """A client's inline submit, checked (bounds, names, CIDs); ProtocolViolation if not one."""
    try:
        return _decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise ProtocolViolation(f"bad inline submit: {exc}") from exc
    except RecursionError:
        raise ProtocolViolation("bad inline submit: nested too deeply") from None


Blocks = list[tuple[Cid, bytes]]
"""An inline submit's blocks with their CIDs, children first."""


def inline_blocks(call: InlineSubmitRequest) -> Blocks:
    """The blocks of ``call`` with their CIDs, in order (checked when it was decoded)."""
    return [(Cid.parse(block.cid), block.data) for block in call.blocks]


async def reserve_inline(budget: ByteBudget, call: InlineSubmitRequest) -> Reservation:
    """Hold ``call``'s block bytes in ``budget`` (waits while others' bytes fill it)."""
    total = call.nbytes
    return await budget.reserve(total, f"an inline submit ({total} bytes of blocks)")


def put_blocks(store: BlockStore, blocks: Sequence[tuple[Cid, bytes]]) -> None:
    """Check each block against its CID and store it, in order (children first).

    A block that does not hash to its CID raises BlockHashMismatch; the blocks before it
    stay stored, as for BLOCK frames. Runs on the intake's worker thread.
    """
    for cid, data in blocks:
        try:
            store.put_verified(cid, data)
        except HashMismatch as exc:
            raise BlockHashMismatch(cid, exc.actual) from exc


def intake_batch(
    coordinator: Coordinator,
    rid: RoundId,
    items: list[tuple[str, Cid, Blocks | None]],
    screened: Callable[[], None] | None = None,
) -> list[RoundStatus | Exception]:
    """On the round intake's worker thread: store each item's inline blocks (an item whose
    blocks fail their check gets that failure), then ``submit_many`` the rest, in order,
    screened through a ``FreshBlocks`` view (the blocks just checked are read from memory);
    per item its status or the error that refused it. ``screened`` is called once every
    item is screened, before they are journaled (``rounds.server._queue`` then starts the next
    batch), or at the end if none got that far.

    A ``CoordinatorStore`` keeps the blocks of the whole batch as rows of one transaction
    (``rounds.storage._tiered``: no file per block); another store gets them one by one.
    """
    outcomes: list[RoundStatus | Exception | None] = [None] * len(items)
    todo: list[int] = []
    fresh: dict[Cid, bytes] = {}
    tiered = small_or_none(coordinator.store)
    for index, (_, _, blocks) in enumerate(items):
        try:
            if blocks:
                if tiered is None:
                    put_blocks(coordinator.store, blocks)
                else:
                    check_blocks(blocks)
                fresh.update(blocks)
        except TensorSwapError as exc:
            outcomes[index] = exc
            continue
        todo.append(index)
    if tiered is not None and fresh:
        try:
            tiered.put_small(fresh.items())
        except TensorSwapError as exc:
            for index in todo:
                outcomes[index] = exc
            todo = []
    if todo:
        pairs = [(items[i][0], items[i][1]) for i in todo]
        view = FreshBlocks(coordinator.store, fresh) if fresh else None
        done = coordinator.submit_many(rid, pairs, store=view, screened=screened)
        for index, outcome in zip(todo, done, strict=True):
            outcomes[index] = outcome
    elif screened is not None:
        screened()
    return [o if o is not None else RuntimeError("no outcome") for o in outcomes]


def check_blocks(blocks: Sequence[tuple[Cid, bytes]]) -> None:
    """BlockHashMismatch for the first block that does not hash to its CID."""
    for cid, data in blocks:
        if not cid.matches(data):
            raise BlockHashMismatch(cid, Cid.of(data, codec=cid.codec, hash=cid.hash))
