"""Group commit: writes that arrive together share one SQLite transaction (one fsync).

Leader/follower, no thread of its own: the first caller to find no commit running becomes the
leader, takes every write queued so far, runs them in one ``BEGIN IMMEDIATE`` ... ``COMMIT``
(each under a savepoint, so one write that fails is rolled back alone and raised to its
caller only) and wakes the others. Callers that queued while it committed form the next
batch. Every ``write`` call returns only once the transaction holding it has committed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager

from tensorswap.rounds.journal.wal import Tx

__all__ = ["GroupCommit", "Write"]

Write = Callable[[Tx], object]
"""One write: statements run on the connection inside the shared transaction."""


class _Slot:
    __slots__ = ("done", "error", "write")

    def __init__(self, write: Write) -> None:
        self.write = write
        self.done = False
        self.error: BaseException | None = None


class GroupCommit:
    """Runs writes from many threads in shared transactions, in the order they were queued.

    ``transaction()`` opens the one transaction a batch runs in (it commits on exit, rolls
    back and raises its own error on failure). ``grouped=False`` runs each write in its own
    transaction (the behaviour before group commit; kept for comparison). ``max_batch``
    bounds how many writes one transaction holds. Counters: ``commits``, ``writes``.
    """

    def __init__(
        self,
        transaction: Callable[[], AbstractContextManager[Tx]],
        *,
        grouped: bool = True,
        max_batch: int = 4096,
        before: Callable[[], None] | None = None,
    ) -> None:
        self._transaction = transaction
        self.before = before
        """Run by the leader before each transaction (e.g. flush the blocks the batch's
        writes name); what it raises fails the whole batch."""
        self.grouped = grouped
        self.max_batch = max_batch
        self._cond = threading.Condition(threading.Lock())
        self._queue: list[_Slot] = []
        self._leading = False
        self.commits = 0
        self.writes = 0
        self.on_queue: Callable[[int], None] | None = None
        """Called (under the queue's lock) with the queue's length after each enqueue."""

    def write(self, write: Write) -> None:
        """Run ``write`` in a transaction that commits before this returns; raise its error
        (or the commit's) if it failed, in which case nothing of it was kept."""
        (error,) = self.write_many([write])
        if error is not None:
            raise error

    def write_many(self, writes: list[Write]) -> list[BaseException | None]:
        """Queue ``writes`` (in order) and wait until each has committed or failed; per
        write its error, None for those kept. They may share transactions with others'."""
        slots = [_Slot(w) for w in writes]
        if not self.grouped:
            for slot in slots:
                self._run([slot])
            return [slot.error for slot in slots]
        last = slots[-1] if slots else None
        with self._cond:
            self._queue.extend(slots)
            if self.on_queue is not None:
                self.on_queue(len(self._queue))
            while last is not None and not last.done:
                if self._leading:
                    self._cond.wait()
                    continue
                self._leading = True
                batch = self._queue[: self.max_batch]
                del self._queue[: self.max_batch]
                self._cond.release()
                try:
                    self._run(batch)
                finally:
                    self._cond.acquire()
                    self._leading = False
                    self._cond.notify_all()
        return [slot.error for slot in slots]

    def _run(self, batch: list[_Slot]) -> None:
        """One transaction for ``batch``; marks each slot done with its error (if any)."""
        try:
            if self.before is not None:
                self.before()
            with self._transaction() as db:
                for slot in batch:
                    db.execute("SAVEPOINT w")
                    try:
                        slot.write(db)
                    except BaseException as exc:
                        db.execute("ROLLBACK TO w")
                        slot.error = exc
                    db.execute("RELEASE w")
        except BaseException as exc:  # the commit (or BEGIN) failed: nothing was kept
            for slot in batch:
                if slot.error is None:
                    slot.error = exc
        finally:
            self.commits += 1
            self.writes += len(batch)
            for slot in batch:
                slot.done = True
