"""Retention: forget old terminal rounds and delete the blocks no remaining round references."""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

from tensorswap.cid import Cid
from tensorswap.rounds.core.deadline import Clock
from tensorswap.rounds.core.state import Complete, RoundId, RoundTracker
from tensorswap.rounds.storage._lock import SharedLock
from tensorswap.store import BlockStore, DirectoryStore
from tensorswap.store.gc import GcResult, collect_garbage

__all__ = ["DEFAULT_GC_GRACE", "Retention", "RetentionWorker"]

log = logging.getLogger(__name__)

TEMP_SWEEP_EVERY = 16
"""Queued collections between two walks of the store: one sweeps abandoned temp files, and
lists what other processes put (in between, the store's own account is read: ``inventory``)."""
TEMP_FILE_AGE = 3600.0
"""Seconds after which a temp file (a write that never finished) is removed by a sweep."""

DEFAULT_GC_GRACE = 600.0
"""Seconds a block stored or touched recently is spared by a collection though unreferenced:
time for a peer to push an update and submit it (a push touches the blocks it finds held)."""


@dataclass(frozen=True, slots=True)
class Retention:
    """What ``Coordinator.collect_garbage`` did (or, for a dry run, would do)."""

    rounds_removed: int
    """Terminal rounds forgotten (their journal entries deleted)."""
    blocks: GcResult
    """The block store's collection: removed, kept, and spared for the grace period."""


class RetentionWorker:
    """Runs collections for a coordinator: on demand, or queued on a background thread as
    rounds end (``keep_rounds`` set). Holds the lock exclusively while it runs, so no submit
    or aggregation is between its reads and its deletes."""

    def __init__(
        self,
        tracker: RoundTracker,
        store: BlockStore,
        clock: Clock,
        lock: SharedLock,
        count: Callable[..., None],
        *,
        keep_rounds: int | None,
        grace: float,
    ) -> None:
        if keep_rounds is not None and keep_rounds < 1:
            raise ValueError(f"keep_rounds must be at least 1 (or None), got {keep_rounds}")
        if grace < 0:
            raise ValueError(f"gc_grace must not be negative, got {grace}")
        self.keep_rounds = keep_rounds
        self.grace = grace
        self._tracker = tracker
        self._store = store
        self._clock = clock
        self._gc_lock = lock
        self._count = count
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._queued = False
        self._future: Future[None] | None = None
        self._closed = False
        self._ended: dict[RoundId, float] = {}  # clock.now() when a round turned terminal
        self._root_sources: list[Callable[[], list[Cid]]] = []
        self._runs = 0  # collections run, for the temp-file sweep

    def add_root_source(self, source: Callable[[], list[Cid]]) -> None:
        """Blocks ``source()`` names (and everything they link) are never collected."""
        with self._lock:
            self._root_sources.append(source)

    def mark_ended(self, round_id: RoundId) -> None:
        with self._lock:
            self._ended[round_id] = self._clock.now()

    def collect(
        self, keep_rounds: int, *, grace: float | None, dry_run: bool, walk: bool = True
    ) -> Retention:
        """See ``Coordinator.collect_garbage``. ``walk=False`` (a queued collection) takes the
        candidates from the store's account of what it holds (``BlockStore.inventory``)
        unless this is the first or a ``TEMP_SWEEP_EVERY``-th run."""
        if keep_rounds < 1:
            raise ValueError(f"keep_rounds must be at least 1, got {keep_rounds}")
        grace = self.grace if grace is None else grace
        tracker = self._tracker
        # Listed before the lock (while submits go on): a block put after this is never a
        # candidate; one listed and referenced by the time the lock is held is in the roots;
        # one listed, unreferenced and then offered is young (its age restarts), and the age
        # is checked again as it is deleted.
        rescan = walk or self._runs % TEMP_SWEEP_EVERY == 0
        listed = self._store.inventory(rescan=rescan)
        with self._gc_lock.exclusive():
            rounds = tracker.rounds()
            cutoff = max((info.round_id.round for info in rounds), default=0) - keep_rounds + 1
            now = self._clock.now()
            with self._lock:
                ended = dict(self._ended)
            doomed = [
                info.round_id
                for info in rounds
                if info.status.is_terminal
                and info.round_id.round < cutoff
                and now - ended.get(info.round_id, -math.inf) >= grace
            ]
            if dry_run:
                removed = len(doomed)
            else:
                removed = tracker.forget(doomed)
                with self._lock:
                    for rid in doomed:
                        self._ended.pop(rid, None)
            gone = set(doomed)
            roots: list[Cid] = []
            for info in rounds:
                if info.round_id in gone:
                    continue
                roots.extend(Cid.parse(c.update_cid) for c in tracker.contributions(info.round_id))
                if isinstance(info.status, Complete):
                    roots.append(Cid.parse(info.status.cid))
            with self._lock:
                sources = list(self._root_sources)
            for source in sources:  # e.g. the runs' global models and optimizer states
                roots.extend(source())
            blocks = collect_garbage(
                self._store, roots, dry_run=dry_run, min_age=grace, listed=listed,
                temp_file_age=None,
            )  # fmt: skip
        if not dry_run and self._runs % TEMP_SWEEP_EVERY == 0:  # another walk: not each time
            temps = self._sweep_temp_files()
            blocks = replace(blocks, temp_files_removed=temps)
        self._runs += 1
        if not dry_run:
            self._count(
                gc_runs=1,
                gc_rounds_removed=removed,
                gc_blocks_removed=blocks.removed,
                gc_bytes_removed=blocks.removed_bytes,
            )
        log.info(
            "collection%s: %d round(s) and %d block(s) (%d bytes) removed, %d spared as recent",
            " (dry run)" if dry_run else "",
            removed,
            blocks.removed,
            blocks.removed_bytes,
            blocks.spared,
        )
        return Retention(removed, blocks)

    def _sweep_temp_files(self) -> int:
        store = self._store
        if not isinstance(store, DirectoryStore):
            return 0
        return store.remove_temp_files(older_than=TEMP_FILE_AGE)

    def schedule(self) -> None:
        """Queue a collection (``keep_rounds`` set) unless one is already queued.

        Never raises: a collection that cannot be queued must not keep a round from ending.
        """
        if self.keep_rounds is None:
            return
        with self._lock:
            if self._closed or self._queued:
                return
            try:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(1, thread_name_prefix="tensorswap-gc")
                self._future = self._pool.submit(self._run)
            except Exception as exc:
                log.warning("cannot queue a collection: %s", exc)
                return
            self._queued = True  # _run clears it under this lock, held here

    def drain(self, timeout: float | None = None) -> None:
        """Wait until the collections queued so far have run (TimeoutError after ``timeout``)."""
        with self._lock:
            future = self._future
        if future is not None:
            future.result(timeout)

    def _run(self) -> None:
        with self._lock:
            self._queued = False
        keep = self.keep_rounds
        if keep is None:  # pragma: no cover - only queued when set
            return
        try:
            self.collect(keep, grace=None, dry_run=False, walk=False)
        except Exception as exc:  # a failed collection deletes nothing more; the next retries
            self._count(gc_failures=1)
            log.warning("collection failed: %s", exc, exc_info=True)

    def stop(self) -> None:
        """Queue no more collections (the coordinator is closing)."""
        with self._lock:
            self._closed = True

    def close(self) -> None:
        """Queue no more, and run the collections already queued to the end."""
        self.stop()
        with self._lock:
            pool = self._pool
        if pool is not None:
            pool.shutdown(wait=True)
