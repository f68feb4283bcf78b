"""RunFolds: a region folds the updates of its peers the top sampled for a run's round and
submits one contribution upstream (``runs.regional`` has the top's side).

When the top hands one of the region's peers a task in a run that folds, the region asks
the top for its part of that round (the covered peers, their quorum, the top's deadline)
and starts the run's round ``RoundId(n, run)`` in its own coordinator: its covered peers
submit there, and ``RegionalTier`` submits the fold upstream under the region's name,
weighted by their summed num_samples. The top's next version comes down once, with the
next task (``RunsProxy``).
"""

from __future__ import annotations

import asyncio
import logging
import threading

import msgspec

from tensorswap.cid import Cid
from tensorswap.errors import TensorSwapError
from tensorswap.region.journal import RegionJournal
from tensorswap.region.link import UpstreamLink
from tensorswap.rounds import Admission, CoordinatorHooks
from tensorswap.rounds.core import Layout, RoundId, RoundSpec, RoundStatus
from tensorswap.rounds.engine import Coordinator, inspect_update
from tensorswap.runs.errors import NotSelected
from tensorswap.runs.messages import APP as RUNS_APP
from tensorswap.runs.messages import PartRequest, PartWire, TaskWire, decode_answer, encode

__all__ = ["LOCAL_SHARE", "RunFolds"]

log = logging.getLogger(__name__)

LOCAL_SHARE = 0.9
"""The share of the top round's time left that a region's own round gets: it closes at
that point (by its quorum) and its fold still reaches the top before the top's deadline."""

RETRY_HELD_S = 1.0
"""How often a peer held on a regional round that ended (below its quorum) asks the top
again, until the top moves on to the next round."""

_MAX_PLAIN = 1024  # rounds remembered as not folded here


class RunFolds(CoordinatorHooks):
    """The runs rounds ``coordinator`` (a region's) folds for the top behind ``link``; one
    of its hooks (``admit``).

    Guarantees:

    - A folded round is journaled (``RegionJournal.record_run_round``: its covered peers)
      before it starts here; after a restart it is served on from the journal.
    - Only the covered peers may submit to it (NotSelected otherwise, as at the top).
    - Its quorum is the top's for the covered peers and its deadline ``LOCAL_SHARE`` of the
      top round's time left (none when the top round has none).
    - A run that does not fold (async, DP, secure, robust strategies), or a top that
      predates ``part``, is left to the relay: each peer's contribution goes up on its own.
    """

    def __init__(self, link: UpstreamLink, coordinator: Coordinator, journal: RegionJournal):
        self.link, self.coordinator, self.journal = link, coordinator, journal
        self._lock = threading.Lock()
        self._covers: dict[RoundId, tuple[str, ...]] = journal.run_rounds()
        self._plain: dict[RoundId, None] = {}
        self._preparing: dict[RoundId, asyncio.Future[None]] = {}
        self._events: dict[RoundId, set[asyncio.Event]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        coordinator.hooks.add(self)
        coordinator.subscribe(self._on_round)

    def covers(self, round_id: RoundId) -> tuple[str, ...] | None:
        """The peers a folded round covers; None for a round not folded here."""
        with self._lock:
            return self._covers.get(round_id)

    # ── starting a folded round ──────────────────────────────────────────────
    async def prepare(self, task: TaskWire) -> None:
        """Make sure the task's round is started here if the region folds it (once per
        round; concurrent callers share the one request to the top)."""
        rid = RoundId(task.round, task.run)
        if task.mode != "sync" or task.secagg or task.dp or rid in self._plain:
            return
        if self.coordinator.info(rid) is not None:
            return
        self._loop = asyncio.get_running_loop()
        running = self._preparing.get(rid)
        if running is None:
            running = asyncio.ensure_future(self._prepare(rid, task))
            self._preparing[rid] = running
            running.add_done_callback(lambda _: self._preparing.pop(rid, None))
        await asyncio.shield(running)

    async def _prepare(self, rid: RoundId, task: TaskWire) -> None:
        body = encode(PartRequest(peer=self.link.region, run=task.run))
        try:
            answer = decode_answer(await self.link.relay(RUNS_APP, body))
        except (TensorSwapError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.info("run round %s: no part from the top (%s); relaying its peers", rid, exc)
            self._mark_plain(rid)
            return
        part = answer.part
        if answer.error is not None or part is None or not self._folds(part, task):
            self._mark_plain(rid)
            return
        assert part is not None
        timeout = None if part.left_s is None else part.left_s * LOCAL_SHARE
        spec = RoundSpec(
            len(part.covers),
            quorum=max(1, min(part.quorum, len(part.covers))),
            timeout_s=timeout,
            strategy="fedavg",
            layout=await asyncio.to_thread(self._layout, task),
        )
        covers = tuple(sorted(part.covers))
        await asyncio.to_thread(self.journal.record_run_round, rid, list(covers))
        with self._lock:
            self._covers[rid] = covers
        await asyncio.to_thread(self.coordinator.start_round, rid, spec)
        log.info("run round %s: folding %d peer(s) here: %s", rid, len(covers), covers)

    @staticmethod
    def _folds(part: PartWire, task: TaskWire) -> bool:
        timely = part.left_s is None or part.left_s > 0
        same = part.round == task.round and part.global_cid == task.global_cid
        return part.fold and bool(part.covers) and same and timely

    def _layout(self, task: TaskWire) -> Layout:
        cid = Cid.parse(task.global_cid)  # pulled into the region's store before the task
        return inspect_update(self.coordinator.store, cid, task.run, "run").layout

    def _mark_plain(self, rid: RoundId) -> None:
        self._plain[rid] = None
        while len(self._plain) > _MAX_PLAIN:
            del self._plain[next(iter(self._plain))]

    # ── peers of a folded round ──────────────────────────────────────────────
    def held(self, peer: str, task: TaskWire) -> bool:
        """Whether ``peer``'s task from the top must wait: the region folds the round and
        already has the peer's update, or no longer takes any (the top does not know yet)."""
        rid = RoundId(task.round, task.run)
        if self.covers(rid) is None:
            return False
        info = self.coordinator.info(rid)
        if info is None:
            return False
        return peer in info.peers or info.status.name not in ("Pending", "Collecting")

    async def wait_change(self, task: TaskWire, timeout: float) -> None:
        """Until the regional round of ``task`` changes status, or ``timeout`` seconds (at
        most RETRY_HELD_S once it has ended: then only the top can move on)."""
        rid = RoundId(task.round, task.run)
        info = self.coordinator.info(rid)
        if info is None or info.status.is_terminal:
            await asyncio.sleep(min(timeout, RETRY_HELD_S))
            return
        self._loop = asyncio.get_running_loop()
        event = asyncio.Event()
        self._events.setdefault(rid, set()).add(event)
        try:
            if self.coordinator.info(rid) == info:  # no change between the read and now
                async with asyncio.timeout(timeout):
                    await event.wait()
        except TimeoutError:
            pass
        finally:
            waiting = self._events.get(rid)
            if waiting is not None:
                waiting.discard(event)
                if not waiting:
                    del self._events[rid]

    def _on_round(self, round_id: RoundId, status: RoundStatus) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed() and round_id in self._events:
            loop.call_soon_threadsafe(self._wake, round_id)

    def _wake(self, round_id: RoundId) -> None:
        for event in self._events.get(round_id, ()):
            event.set()

    def admit(self, admission: Admission) -> None:
        """The coordinator's hook: only the covered peers submit to a folded round."""
        rid, peer = admission.round_id, admission.peer
        covers = self.covers(rid)
        if covers is not None and peer not in covers:
            raise NotSelected(rid.initiator, rid.round, peer, len(covers))
