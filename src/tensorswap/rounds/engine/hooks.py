"""Coordinator hooks: how runs, regions and DP plug into the coordinator's decisions.

A hook is a ``CoordinatorHooks`` (override only what it decides; the defaults decide
nothing). A coordinator holds its hooks in one ordered ``HookList``: first those given as
``Coordinator(hooks=[...])`` (needed before a restart's rounds are recovered, as a regional
tier's ``finish``), then those added by ``coordinator.hooks.add(hook)``, in that order.
How the coordinator combines them, per method:

- ``admit``: asked in order before a submit is screened; the first that raises refuses the
  submit (later hooks are not asked, nothing is recorded).
- ``sample_cap``: the most samples a contribution may claim, folded in order: each hook is
  given the cap so far (first ``Coordinator.samples.limit``) and returns the new one.
- ``release``: folded in order once a round's aggregate is stored: each is given the CID
  the previous returned; Complete names the last one. What one raises fails the attempt
  (retried when transient).
- ``finish``: asked in order after the release; the first that returns True takes the
  round over (it stays Aggregating until that hook calls ``complete_round`` or
  ``fail_round``) and later hooks are not asked; when none does, the coordinator completes
  the round itself.
- ``roots``: every hook's roots together are kept through collections.
- ``may_stream``: a round cuts through only if every hook agrees.

Every method is called on whatever thread submits or aggregates, without the coordinator's
locks held, so a hook may call the coordinator back.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from tensorswap.cid import Cid
from tensorswap.rounds.core.state import RoundId

__all__ = ["Admission", "CoordinatorHooks", "HookList"]


@dataclass(frozen=True, slots=True)
class Admission:
    """One submit the hooks are asked to admit, before it is screened.

    ``via`` is the hook that submits on the peer's behalf, having made its own checks (a
    ``RunManager`` passes itself from ``RunManager.submit``), or None when the peer
    submitted directly (``Coordinator.submit`` from a ``RoundServer``, a batch)."""

    round_id: RoundId
    peer: str
    scale: float
    via: CoordinatorHooks | None = None


class CoordinatorHooks:
    """What a run manager, a region or a DP release decides for a coordinator's rounds; the
    defaults decide nothing (see the module docstring for how several combine)."""

    def admit(self, admission: Admission) -> None:
        """Raise a typed error to refuse the submit (NotSelected, a RunsError); return to
        leave it to the next hook and then the coordinator's own checks."""

    def sample_cap(self, round_id: RoundId, peer: str, cap: int | None) -> int | None:
        """The most samples ``peer``'s contribution to the round may claim, given ``cap``
        (None: any); a claim above it is refused with TooManySamples."""
        return cap

    def release(self, round_id: RoundId, aggregate: Cid) -> Cid:
        """The CID the round's Complete names instead of ``aggregate`` (stored already): a
        DP run releases the noised aggregate, so the clean one is never published. Must be
        idempotent: a restart may release the same round again."""
        return aggregate

    def finish(self, round_id: RoundId, aggregate: Cid) -> bool:
        """True to take over completing the round (a regional tier forwards its partial
        upstream, then calls ``complete_round`` or ``fail_round``); False to leave it."""
        return False

    def roots(self) -> list[Cid]:
        """Blocks to keep (with all they link) through the coordinator's collections; store
        what it will name under ``Coordinator.no_collection``."""
        return []

    def may_stream(self, round_id: RoundId) -> bool:
        """Whether the round's aggregate may reach peers chunk by chunk before it is released
        (a cut-through round, ``rounds.engine.cut``). By default only when this hook
        transforms no result: one that overrides ``release`` or ``finish`` (a DP release,
        a regional tier) must not have the aggregate it releases instead streamed."""
        cls = type(self)
        return cls.release is CoordinatorHooks.release and cls.finish is CoordinatorHooks.finish


class HookList:
    """A coordinator's hooks in order, combined as the module docstring says; thread-safe
    (a hook added while submits run is asked from the next one on)."""

    def __init__(self, hooks: Iterable[CoordinatorHooks] = ()) -> None:
        self._lock = threading.Lock()
        self._hooks: tuple[CoordinatorHooks, ...] = ()
        for hook in hooks:
            self.add(hook)

    def add(self, hook: CoordinatorHooks) -> None:
        """Ask ``hook`` after those added before it; TypeError if it is not a hook."""
        if not isinstance(hook, CoordinatorHooks):
            raise TypeError(f"not a CoordinatorHooks: {hook!r}")
        with self._lock:
            self._hooks = (*self._hooks, hook)

    def __iter__(self) -> Iterator[CoordinatorHooks]:
        return iter(self._hooks)

    def __contains__(self, hook: object) -> bool:
        return any(h is hook for h in self._hooks)

    def __len__(self) -> int:
        return len(self._hooks)

    def admit(self, admission: Admission) -> None:
        for hook in self._hooks:
            hook.admit(admission)

    def sample_cap(self, round_id: RoundId, peer: str, cap: int | None) -> int | None:
        for hook in self._hooks:
            cap = hook.sample_cap(round_id, peer, cap)
        return cap

    def release(self, round_id: RoundId, aggregate: Cid) -> Cid:
        for hook in self._hooks:
            aggregate = hook.release(round_id, aggregate)
        return aggregate

    def finish(self, round_id: RoundId, aggregate: Cid) -> bool:
        return any(hook.finish(round_id, aggregate) for hook in self._hooks)

    def roots(self) -> list[Cid]:
        return [cid for hook in self._hooks for cid in hook.roots()]

    def may_stream(self, round_id: RoundId) -> bool:
        return all(hook.may_stream(round_id) for hook in self._hooks)
