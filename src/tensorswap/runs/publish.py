"""A run's next version is made when its round is released, before Complete names anything:
the step computed and checked finite, then held until the manager records it; or refused
(journaled), so the round fails with the reason and the run stays on its last version."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from tensorswap.cid import Cid
from tensorswap.errors import RoundsError
from tensorswap.rounds.core import (
    Aggregating,
    Collecting,
    Contribution,
    Failed,
    RoundId,
    RoundStatus,
)
from tensorswap.rounds.engine import Coordinator
from tensorswap.runs.dp import RunPrivacy, is_private
from tensorswap.runs.errors import NonFiniteStep
from tensorswap.runs.journal import RunDatabase
from tensorswap.runs.model import RunInfo, VersionRecord
from tensorswap.runs.secure import is_secure
from tensorswap.runs.step import apply_step
from tensorswap.store import BlockStore

__all__ = ["RELEASE_WAIT_S", "Publisher", "await_release", "step_kind"]

log = logging.getLogger("tensorswap.runs.manager")

RELEASE_WAIT_S = 300.0
"""How long the asynchronous submit that fills a buffer waits for that buffer's step (to
hear of a refusal); past it, the submit answers as before (its contribution's status)."""


def step_kind(info: RunInfo) -> tuple[bool, str]:
    """How a run's step reads its aggregate: as a delta (DP, secure runs) or a model, and
    what released it (the stage a refusal names)."""
    private, secure = is_private(info.spec), is_secure(info.spec)
    source = "DP release" if private else "SecAgg release" if secure else "aggregate"
    return private or secure, source


class Publisher:
    """The steps of a manager's runs, computed at release and held until recorded.

    ``release`` noises a DP run's aggregate (``RunPrivacy.noised_aggregate``: journaled,
    drawn once) and steps round ``info.round`` (``apply_step``: every chunk checked as it
    is made); a step (or noised release) that would publish NaN or Inf is journaled
    (``RunDatabase.add_refusal``) and raises NonFiniteStep, which the coordinator's release
    hook turns into the round's failure. The held versions' blocks are ``roots`` for
    retention until ``take`` hands them over (the manager records them under
    ``no_collection``). Thread-safe.
    """

    def __init__(self, store: BlockStore, journal: RunDatabase, privacy: RunPrivacy) -> None:
        self.store = store
        self.journal = journal
        self.privacy = privacy
        self._lock = threading.Lock()
        self._held: dict[tuple[str, int], tuple[str, VersionRecord]] = {}

    def release(
        self,
        info: RunInfo,
        aggregate: Cid,
        contributions: Sequence[Contribution],
        trained_on: dict[str, int],
    ) -> Cid:
        """The CID round ``info.round`` is Complete with (a DP run's noised aggregate), its
        version made and held for ``take``; NonFiniteStep (journaled) instead of NaN or Inf."""
        released = self._noised(info, aggregate, contributions)
        self._prepare(info, released, contributions, trained_on)
        return released

    def take(
        self,
        info: RunInfo,
        completed: Cid,
        contributions: Sequence[Contribution],
        trained_on: dict[str, int],
    ) -> VersionRecord:
        """The version held for round ``info.round``, Complete with ``completed``; or (a
        restart after the release: nothing held) the same step made now, from the same
        journaled noise. NonFiniteStep as ``release``."""
        aggregate = self._noised(info, completed, contributions)
        key = (info.name, info.round)
        with self._lock:
            held = self._held.get(key)
        if held is None or held[0] != str(aggregate) or held[1].version != info.version + 1:
            self._prepare(info, aggregate, contributions, trained_on)
        with self._lock:
            return self._held.pop(key)[1]

    def _noised(self, info: RunInfo, aggregate: Cid, contributions: Sequence[Contribution]) -> Cid:
        if not is_private(info.spec):
            return aggregate
        try:
            return self.privacy.noised_aggregate(self.store, info, aggregate, contributions)
        except NonFiniteStep as exc:
            self.refuse(exc)
            raise

    def _prepare(
        self,
        info: RunInfo,
        aggregate: Cid,
        contributions: Sequence[Contribution],
        trained_on: dict[str, int],
    ) -> None:
        delta, source = step_kind(info)
        try:
            record = apply_step(
                self.store, info, aggregate, contributions, trained_on, delta=delta, source=source
            )
        except NonFiniteStep as exc:
            self.refuse(exc)
            raise
        with self._lock:  # an earlier round's held version was never taken: its round ended
            for key in [k for k in self._held if k[0] == info.name and k[1] < info.round]:
                del self._held[key]  # otherwise (failed after its release): let it go
            self._held[(info.name, info.round)] = (str(aggregate), record)

    def refuse(self, refused: NonFiniteStep) -> None:
        """Journal a refused step (once per round) and log it."""
        if not self.journal.refusals(refused.run, refused.round):
            self.journal.add_refusal(refused, time.time())
        log.warning("%s", refused)

    def roots(self) -> list[Cid]:
        """The held versions' models and states (not yet a run's root, kept all the same)."""
        with self._lock:
            records = [record for _, record in self._held.values()]
        cids = [r.global_cid for r in records]
        return cids + [r.state_cid for r in records if r.state_cid is not None]


def await_release(
    coordinator: Coordinator,
    journal: RunDatabase,
    rid: RoundId,
    status: RoundStatus,
    timeout: float = RELEASE_WAIT_S,
) -> RoundStatus:
    """``status`` (a submit's answer to round ``rid`` of an asynchronous run); when that
    submit filled the buffer, only once the buffer's step is done: NonFiniteStep if it was
    refused, so the peer whose delta set the step off hears why."""
    full = isinstance(status, Aggregating) or (
        isinstance(status, Collecting) and status.received >= status.expected
    )
    if not full:
        return status
    try:
        end = coordinator.wait(rid, timeout)
    except RoundsError:  # still stepping after the timeout, or collected: answer as before
        return status
    if isinstance(end, Failed):
        for refused in journal.refusals(rid.initiator, rid.round):
            raise refused
    return status
