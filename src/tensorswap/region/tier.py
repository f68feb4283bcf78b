"""RegionalTier: a coordinator for the peers below, a RoundClient of the coordinator above.

A round the region's peers complete here is not marked Complete with the regional partial:
the coordinator's ``finish`` hook hands the stored partial to the tier, which submits it
upstream as one contribution (weighted by the region's summed num_samples), waits for the
upper round, pulls the global result into the region's store once, and only then completes
the regional round with the global result's CID. So a peer's ``wait`` / ``fetch_result`` on
the region returns the global result, and the upstream link carries one update per region
per direction.

A run's round the region folds (``RunFolds``) goes up the same way; it completes with the
region's fold once the top's round completes, and its global model comes down with the
run's next task instead (``RunsProxy``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from dataclasses import dataclass

from tensorswap.cid import Cid, Multicodec
from tensorswap.errors import BlockNotFound, TensorSwapError
from tensorswap.region.errors import ForeignContribution, UpstreamIncompatible
from tensorswap.region.identity import coordinator_id
from tensorswap.region.journal import Forward, ForwardState, RegionJournal
from tensorswap.region.link import UpstreamLink
from tensorswap.rounds import CoordinatorHooks
from tensorswap.rounds.core import (
    Complete,
    DuplicateContribution,
    Failed,
    RoundAlreadyTerminal,
    RoundClosed,
    RoundId,
)
from tensorswap.rounds.engine import Coordinator
from tensorswap.store import UpdateManifest, encode_manifest, manifest_closure, read_manifest

__all__ = ["COMPOSING_STRATEGY", "RegionalTier", "TierStats"]

log = logging.getLogger(__name__)

COMPOSING_STRATEGY = "fedavg"
"""The one upstream strategy regional partials compose under (sample-weighted averaging)."""
DETERMINISTIC_REFUSAL = "deterministic: folds each peer's update in name order, not partials"


@dataclass(frozen=True, slots=True)
class TierStats:
    """What the tier did since it started, and the bytes on its upstream link."""

    forwarded: int
    completed: int
    failed: int
    late: int
    upstream_bytes_sent: int
    upstream_bytes_received: int
    upstream_connections: int
    upstream_state: str = "ok"
    """The link's ``state``: ``ok``, ``backing off: ...`` or ``stopped: ...`` (a loop)."""


class RegionalTier(CoordinatorHooks):
    """Finishes the rounds of ``coordinator`` (a region) through ``link`` (its upstream).

    Guarantees:

    - Each regional round that aggregates is submitted upstream once, under the region's
      name and the same round id, as its partial aggregate with num_samples = the samples
      it covers (FedAvg, and robust strategies: the regional tier applies the robust rule,
      the upper tier averages the regions weighted by samples) or = the peers it covers
      (``mean``), so an upstream FedAvg gives the flat result. An upstream round with any
      other strategy is refused: the regional round fails with UpstreamIncompatible's
      reason, and so is a deterministic upper round (``RoundSpec.deterministic``: its bits
      are each peer's update summed in name order, which no partial can give; a run's
      regions relay such a run's peers one by one instead). An upper round not started
      yet is waited for (within the link's patience).
    - The regional round completes with the upstream's result (its blocks pulled into the
      region's store first) or fails with the upstream's reason; a region whose submit came
      too late (the upper round closed) still serves the global result to its peers.
    - Every step is journaled (``RegionJournal``) before the next: after kill -9 the
      coordinator aggregates the round again, and the tier goes on from the journaled partial
      and state: never a second submission, never a second partial. A submit refused as a
      duplicate counts as the region's own earlier one only when the upstream holds this
      very partial (its CID); another CID under the region's name is someone else's
      (ForeignContribution): the regional round fails, its peers told why.
    """

    def __init__(self, link: UpstreamLink) -> None:
        self.link = link
        self.coordinator: Coordinator | None = None
        self.journal: RegionJournal | None = None
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: list[tuple[RoundId, Cid]] = []
        self._tasks: dict[RoundId, asyncio.Task[None]] = {}
        self._counts = {"forwarded": 0, "completed": 0, "failed": 0, "late": 0}

    @classmethod
    def open(
        cls,
        data_dir: str | os.PathLike[str],
        link: UpstreamLink,
        *,
        durable: bool = True,
        **kwargs: object,
    ) -> RegionalTier:
        """A tier over ``Coordinator.open(data_dir, hooks=[tier])`` (kwargs go there) and a
        ``RegionJournal`` in its database; ``link.store`` is replaced by the coordinator's
        store, and ``link.identity`` by the coordinator id kept in ``data_dir``. Call ``start``
        on the event loop that should run it; ``close`` closes all."""
        tier = cls(link)
        coordinator = Coordinator.open(
            data_dir,
            durable=durable,
            hooks=[tier],
            **kwargs,  # type: ignore[arg-type]
        )
        try:
            assert coordinator.journal is not None  # Coordinator.open always journals
            link.identity = coordinator_id(data_dir)
            tier.attach(coordinator, RegionJournal(coordinator.journal.path, durable=durable))
        except BaseException:
            coordinator.close()
            raise
        return tier

    def attach(self, coordinator: Coordinator, journal: RegionJournal) -> None:
        """Serve ``coordinator`` (built with ``hooks=[self]``), journaling in ``journal``."""
        if self not in coordinator.hooks:
            raise ValueError("the coordinator must be built with hooks=[tier]")
        self.coordinator, self.journal = coordinator, journal
        self.link.store = coordinator.store
        journal.forget({info.round_id for info in coordinator.rounds()})

    # ── the coordinator's hooks ──────────────────────────────────────────────
    def finish(self, round_id: RoundId, aggregate: Cid) -> bool:
        """Takes every round over (on the coordinator's aggregation thread): its stored
        partial goes upstream, and the round ends with the top's answer."""
        if self.coordinator is not None:
            self.coordinator.tracker.note_aggregating(round_id, f"partial {aggregate} stored")
        with self._lock:
            loop = self._loop
            if loop is None:
                self._pending.append((round_id, aggregate))  # before start: a restart's rounds
                return True
        loop.call_soon_threadsafe(self._spawn, round_id, aggregate)
        return True

    def roots(self) -> list[Cid]:
        """The partials and global results the region's journal names."""
        return [] if self.journal is None else self.journal.roots()

    async def start(self) -> None:
        """Run on the current event loop: forward what was handed over before, and from now."""
        with self._lock:
            self._loop = asyncio.get_running_loop()
            pending, self._pending = self._pending, []
        for round_id, partial in pending:
            self._spawn(round_id, partial)

    def _spawn(self, round_id: RoundId, partial: Cid) -> None:
        task = self._tasks.get(round_id)
        if task is not None and not task.done():
            return  # already on its way upstream
        task = asyncio.get_running_loop().create_task(self._forward(round_id, partial))
        self._tasks[round_id] = task
        task.add_done_callback(lambda t: self._tasks.pop(round_id, None))

    # ── one round ────────────────────────────────────────────────────────────
    async def _forward(self, round_id: RoundId, computed: Cid) -> None:
        coordinator, journal = self.coordinator, self.journal
        assert coordinator is not None and journal is not None, "attach before start"
        try:
            record = journal.get(round_id)
            if record is None or not await asyncio.to_thread(self._holds, record):
                partial = await asyncio.to_thread(self._weighted, round_id, computed)
                record = await asyncio.to_thread(journal.record_partial, round_id, partial)
            if record.state is ForwardState.PARTIAL:
                record = await self._submit(record)
            what = "late upstream" if record.state is ForwardState.LATE else "submitted upstream"
            where = f"{what} to {self.link.address}; waiting for the upper round"
            coordinator.tracker.note_aggregating(round_id, where)
            status = await self.link.wait(round_id)
            if isinstance(status, Failed):
                await self._fail(round_id, f"upstream round failed: {status.reason}")
                return
            assert isinstance(status, Complete)
            result = Cid.parse(status.cid)
            if await asyncio.to_thread(journal.run_round, round_id) is not None:
                await self._finish_run_round(round_id, record.partial)
                return
            await asyncio.to_thread(journal.set_state, round_id, ForwardState.RESULT, result)
            await self.link.fetch(result)
            await asyncio.to_thread(coordinator.complete_round, round_id, result)
            self._count("completed")
            log.info("round %s: global result %s served to the region", round_id, result)
        except RoundAlreadyTerminal:
            return  # the regional round ended meanwhile
        except TensorSwapError as exc:
            log.warning("round %s: upstream failed: %s", round_id, exc)
            await self._fail(round_id, f"upstream: {exc}")
        except Exception as exc:  # a bug: the round must still end, with the reason
            log.exception("round %s: forwarding failed", round_id)
            await self._fail(round_id, f"region: {type(exc).__name__}: {exc}")

    async def _finish_run_round(self, round_id: RoundId, partial: Cid) -> None:
        """A run's round folded here: the top steps its global model from the upper round's
        aggregate, and the next task brings the new version down (once); so nothing is
        fetched here, and the regional round completes with the region's own fold."""
        assert self.coordinator is not None and self.journal is not None
        # journaled with the fold as its result: a root the region holds (the top's
        # aggregate is never pulled here, so it must not be named as one)
        await asyncio.to_thread(self.journal.set_state, round_id, ForwardState.RESULT, partial)
        await asyncio.to_thread(self.coordinator.complete_round, round_id, partial)
        self._count("completed")
        log.info("run round %s: the region's fold is in the top's version", round_id)

    async def _fail(self, round_id: RoundId, reason: str) -> None:
        assert self.coordinator is not None
        self._count("failed")
        with contextlib.suppress(RoundAlreadyTerminal):
            await asyncio.to_thread(self.coordinator.fail_round, round_id, reason)

    async def _submit(self, record: Forward) -> Forward:
        """Check the upper round composes, submit the partial once; the journaled state."""
        rid, journal = record.round_id, self.journal
        assert journal is not None
        row = await self.link.round_row(rid, until_started=True)
        if row.strategy != COMPOSING_STRATEGY:
            raise UpstreamIncompatible(rid.as_key(), row.strategy)
        if row.deterministic:  # its bits come from each peer's update, in name order
            raise UpstreamIncompatible(rid.as_key(), row.strategy, DETERMINISTIC_REFUSAL)
        state = ForwardState.SUBMITTED
        try:
            await self.link.submit(rid, record.partial)
            self._count("forwarded")
        except DuplicateContribution as exc:
            self._check_own(record, exc)  # accepted before a crash cut the answer off
        except (RoundClosed, RoundAlreadyTerminal) as exc:
            log.warning("round %s: too late upstream (%s); serving the global result", rid, exc)
            self._count("late")
            state = ForwardState.LATE
        await asyncio.to_thread(journal.set_state, rid, state)
        return Forward(rid, record.partial, state)

    def _check_own(self, record: Forward, exc: DuplicateContribution) -> None:
        """Raise ForeignContribution unless the upstream's contribution under the region's
        name is ``record``'s partial (an upstream that does not name it is trusted, warned)."""
        held = getattr(exc, "cid", None)  # set only by upstreams that name it
        if held is None:
            log.warning(
                "round %s: the upstream does not say which update it holds from %r; taking "
                "it for this region's earlier submit",
                record.round_id,
                self.link.region,
            )
        elif held != record.partial:
            key = record.round_id.as_key()
            raise ForeignContribution(
                key, self.link.region, str(held), str(record.partial)
            ) from exc

    def _holds(self, record: Forward) -> bool:
        """Whether every block of the journaled partial is still in the store."""
        store = self.link.store
        assert store is not None
        try:
            return not store.missing(manifest_closure(store, record.partial))
        except (TensorSwapError, BlockNotFound):
            return False

    def _weighted(self, round_id: RoundId, computed: Cid) -> Cid:
        """The partial as submitted upstream: ``computed`` as it is, or, for a ``mean`` round,
        under a new update manifest (same tensors) whose num_samples is the peers it covers."""
        coordinator = self.coordinator
        assert coordinator is not None
        info = coordinator.info(round_id)
        if info is None or info.spec.strategy != "mean":
            return computed
        manifest = read_manifest(coordinator.store, computed, verify=True)
        if not isinstance(manifest, UpdateManifest):
            raise UpstreamIncompatible(round_id.as_key(), "mean", "the partial is no update")
        covered = manifest.metadata.get("contributors", "")
        peers = int(covered) if covered.isdigit() else len(set(info.peers) - info.dropped_peers)
        relabeled = UpdateManifest(
            manifest.name, max(peers, 1), manifest.tensors, dict(manifest.metadata)
        )
        return coordinator.store.put(
            encode_manifest(relabeled), codec=Multicodec.TENSORSWAP_MANIFEST
        )

    # ── counters and lifecycle ───────────────────────────────────────────────
    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def stats(self) -> TierStats:
        traffic = self.link.traffic()
        with self._lock:
            counts = dict(self._counts)
        return TierStats(
            **counts,
            upstream_bytes_sent=traffic.bytes_sent,
            upstream_bytes_received=traffic.bytes_received,
            upstream_connections=traffic.connections,
            upstream_state=self.link.state,
        )

    async def aclose(self) -> None:
        """Stop forwarding (rounds in flight stay Aggregating, resumed after a restart) and
        close the upstream link. The coordinator is closed by ``close``."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.link.aclose()

    def close(self) -> None:
        """Close the coordinator and the journal (after ``aclose``)."""
        if self.coordinator is not None:
            self.coordinator.close()
        if self.journal is not None:
            self.journal.close()
