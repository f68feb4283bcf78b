"""The server's intake queue: each round's submits batched onto a worker thread, pipelined.

Submits that arrive on any connection while a round's batch is being screened form its next
batch. A batch runs on a worker thread in two phases: screening (its inline blocks stored,
each contribution checked, folded and reserved, in order, under the round's lock) and
recording (journaled, one group commit, then visible). The next batch starts its screening
as soon as the one before has finished its own, while that one's commit (an fsync) is still
running: at most one batch of a round screens at a time, so the screening order is the
arrival order, and at most ``DEPTH`` batches of a round are in flight. Their journal writes
are queued in that order; the group commit may put them in one transaction. Each answer
still waits for its own commit.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from tensorswap.cid import Cid
from tensorswap.rounds.core.state import RoundId, RoundStatus
from tensorswap.rounds.protocol.inline import Blocks, intake_batch

if TYPE_CHECKING:
    from tensorswap.rounds.engine.coordinator import Coordinator

__all__ = ["DEPTH", "IntakeQueue"]

DEPTH = 2
"""The most batches of one round in flight: one screening, the others committing."""

_Queued = tuple[str, Cid, Blocks | None, asyncio.Future[Any]]
"""A submit waiting for its round's intake: peer, update, inline blocks, its answer."""


class IntakeQueue:
    """Batches each round's submits for ``coordinator`` (see the module docstring). Lives on
    one event loop; ``submit`` is called there."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator
        self._queued: dict[RoundId, list[_Queued]] = {}
        self._running: dict[RoundId, int] = {}  # batches in flight per round
        self._screening: dict[RoundId, object] = {}  # the batch screening now, per round
        self.tasks: set[asyncio.Task[None]] = set()
        """The batches in flight (``aclose`` waits for them)."""

    async def submit(
        self, rid: RoundId, peer: str, cid: Cid, blocks: Blocks | None = None
    ) -> RoundStatus:
        """``coordinator.submit`` (``blocks`` stored first), batched with the submits other
        connections make meanwhile; returns once durable, raises what refused it."""
        future: asyncio.Future[RoundStatus | Exception] = asyncio.get_running_loop().create_future()
        self._queued.setdefault(rid, []).append((peer, cid, blocks, future))
        self._kick(rid)
        outcome = await future
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    async def aclose(self) -> None:
        """Wait for the batches in flight (they are journaled or refused, as if answered)."""
        while self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)

    def _kick(self, rid: RoundId) -> None:
        """Start the round's next batch if submits wait, none screens, and there is room."""
        if rid in self._screening or self._running.get(rid, 0) >= DEPTH:
            return
        queue = self._queued.pop(rid, None)
        if not queue:
            return
        token = object()
        self._screening[rid] = token
        self._running[rid] = self._running.get(rid, 0) + 1
        task = asyncio.ensure_future(self._run(rid, queue, token))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _screened(self, rid: RoundId, token: object) -> None:
        if self._screening.get(rid) is token:
            del self._screening[rid]
            self._kick(rid)

    async def _run(self, rid: RoundId, queue: list[_Queued], token: object) -> None:
        loop = asyncio.get_running_loop()
        items = [(peer, cid, blocks) for peer, cid, blocks, _ in queue]

        def screened() -> None:  # on the worker thread, between screening and the commit
            loop.call_soon_threadsafe(self._screened, rid, token)

        try:
            outcomes = await asyncio.to_thread(intake_batch, self.coordinator, rid, items, screened)
        except Exception as exc:  # a bug: every waiter hears of it
            outcomes = [exc] * len(queue)
        finally:
            left = self._running[rid] - 1
            if left:
                self._running[rid] = left
            else:
                del self._running[rid]
            self._screened(rid, token)  # if it failed before screening ended
        for (_, _, _, future), outcome in zip(queue, outcomes, strict=True):
            if not future.done():
                future.set_result(outcome)
        self._kick(rid)
