"""Coordinator hooks: asked in order; the first refusal wins, caps and releases fold, the
first finisher takes the round, roots are kept together; ``via`` reaches ``admit``."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from tensorswap.cid import Cid
from tensorswap.errors import RoundsError
from tensorswap.rounds import (
    Admission,
    Aggregating,
    Complete,
    Coordinator,
    CoordinatorHooks,
    HookList,
    RoundId,
    RoundSpec,
    TooManySamples,
)
from tensorswap.store import MemoryStore, ModelUpdate, put_update

RID = RoundId(1, "hooks")


class Recording(CoordinatorHooks):
    """Records what it is asked; refuses, caps, releases or finishes as told."""

    def __init__(self, name: str, log: list[str], *, refuse: bool = False) -> None:
        self.name, self.log, self.refuse = name, log, refuse
        self.cap: int | None = None
        self.released: Cid | None = None
        self.takes = False
        self.admitted: list[Admission] = []
        self.finished = threading.Event()

    def admit(self, admission: Admission) -> None:
        self.log.append(f"admit {self.name}")
        self.admitted.append(admission)
        if self.refuse:
            raise RoundsError(f"{self.name} refuses")

    def sample_cap(self, round_id: RoundId, peer: str, cap: int | None) -> int | None:
        self.log.append(f"cap {self.name} {cap}")
        return cap if self.cap is None else self.cap

    def release(self, round_id: RoundId, aggregate: Cid) -> Cid:
        self.log.append(f"release {self.name}")
        return aggregate if self.released is None else self.released

    def finish(self, round_id: RoundId, aggregate: Cid) -> bool:
        self.log.append(f"finish {self.name}")
        self.finished.set()
        return self.takes


def _update(store: MemoryStore, value: float, samples: int = 4) -> Cid:
    return put_update(store, ModelUpdate({"w": np.full(3, value, np.float32)}, samples))


def test_the_first_refusal_wins_and_leaves_no_trace() -> None:
    log: list[str] = []
    first, second = Recording("a", log, refuse=True), Recording("b", log)
    with Coordinator(MemoryStore(), run_timer=False, hooks=[first, second]) as coord:
        coord.start_round(RID, RoundSpec(1))
        with pytest.raises(RoundsError, match="a refuses"):
            coord.submit(RID, "p", _update(coord.store, 1.0))
        assert log == ["admit a"] and coord.contributions(RID) == []


def test_via_and_scale_reach_every_admit_in_order() -> None:
    log: list[str] = []
    given, added = Recording("given", log), Recording("added", log)
    with Coordinator(MemoryStore(), run_timer=False, hooks=[given]) as coord:
        coord.hooks.add(added)
        coord.start_round(RID, RoundSpec(2))
        coord.submit(RID, "p", _update(coord.store, 1.0), scale=0.5, via=added)
        assert [e for e in log if e.startswith("admit")] == ["admit given", "admit added"]
        assert added.admitted == [Admission(RID, "p", 0.5, added)] == given.admitted
        coord.submit(RID, "q", _update(coord.store, 2.0))
        assert given.admitted[-1].via is None


def test_sample_caps_fold_from_the_coordinators_limit() -> None:
    log: list[str] = []
    loose, tight = Recording("loose", log), Recording("tight", log)
    loose.cap, tight.cap = 10, 3
    with Coordinator(MemoryStore(), run_timer=False, hooks=[loose, tight]) as coord:
        coord.samples.limit = 100
        coord.start_round(RID, RoundSpec(1))
        with pytest.raises(TooManySamples):
            coord.submit(RID, "p", _update(coord.store, 1.0, samples=4))
        assert [e for e in log if e.startswith("cap")] == ["cap loose 100", "cap tight 10"]


def test_releases_fold_and_complete_names_the_last() -> None:
    log: list[str] = []
    first, second = Recording("a", log), Recording("b", log)
    with Coordinator(MemoryStore(), run_timer=False, hooks=[first, second]) as coord:
        released = _update(coord.store, 9.0)
        second.released = released
        coord.start_round(RID, RoundSpec(1))
        coord.submit(RID, "p", _update(coord.store, 1.0))
        assert coord.wait(RID, 5) == Complete(str(released))
        assert [e for e in log if not e.startswith(("admit", "cap"))] == [
            "release a",
            "release b",
            "finish a",
            "finish b",
        ]


def test_the_first_finisher_takes_the_round() -> None:
    log: list[str] = []
    taker, later = Recording("taker", log), Recording("later", log)
    taker.takes = True
    with Coordinator(MemoryStore(), run_timer=False, hooks=[taker, later]) as coord:
        coord.start_round(RID, RoundSpec(1))
        coord.submit(RID, "p", _update(coord.store, 1.0))
        assert taker.finished.wait(5)
        coord.close()  # the aggregation has run to its end
        assert isinstance(coord.status(RID), Aggregating)
        assert "finish taker" in log and "finish later" not in log


def test_roots_are_every_hooks_together() -> None:
    store = MemoryStore()
    a, b = _update(store, 1.0), _update(store, 2.0)

    class Roots(CoordinatorHooks):
        def __init__(self, cid: Cid) -> None:
            self.cid = cid

        def roots(self) -> list[Cid]:
            return [self.cid]

    hooks = HookList([Roots(a), CoordinatorHooks(), Roots(b)])
    assert hooks.roots() == [a, b] and len(hooks) == 3
    with pytest.raises(TypeError):
        hooks.add(object())  # type: ignore[arg-type]
