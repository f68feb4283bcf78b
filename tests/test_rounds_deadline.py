"""Deadlines: the quorum rule at expiry, fake clocks, and the timer thread."""

from __future__ import annotations

import threading

import pytest

from tensorswap.rounds.core import (
    Contribution,
    DeadlineTimer,
    FakeClock,
    RoundId,
    RoundSpec,
    RoundTracker,
    SystemClock,
    due_rounds,
    expiry_verdict,
    next_deadline,
)


def test_expiry_verdict_aggregates_at_quorum_and_fails_below() -> None:
    assert expiry_verdict(5, 8, 5) is None
    assert expiry_verdict(8, 8, 5) is None
    assert expiry_verdict(3, 8, 5) == "timeout: 3 of 8 peers (quorum 5)"
    assert expiry_verdict(0, 8, 0) == "timeout: 0 of 8 peers (quorum 0)"


def test_fake_clock_moves_only_forward_and_notifies() -> None:
    clock = FakeClock(10.0)
    ticks: list[float] = []

    def on_tick() -> None:
        ticks.append(clock.now())

    clock.subscribe(on_tick)
    assert clock.advance(2.5) == 12.5
    clock.unsubscribe(on_tick)
    clock.advance(1)
    assert ticks == [12.5]
    with pytest.raises(ValueError):
        clock.advance(-1)
    assert abs(SystemClock().now() - FakeClock(SystemClock().now()).now()) < 60


def test_due_and_next_deadline_skip_rounds_without_one_or_already_closed() -> None:
    clock = FakeClock(0.0)
    tracker = RoundTracker(2, clock=clock.now)
    a, b, c, d = (RoundId(i, "x") for i in range(4))
    tracker.start(a, RoundSpec(2, timeout_s=5))
    tracker.start(b, RoundSpec(2, timeout_s=10))
    tracker.start(c)  # no deadline
    tracker.start(d, RoundSpec(2, timeout_s=1))
    tracker.begin_aggregation(d)  # aggregating: its deadline no longer matters
    assert next_deadline(tracker.rounds()) == 5.0
    assert due_rounds(tracker.rounds(), 4.9) == []
    assert [i.round_id for i in due_rounds(tracker.rounds(), 5.0)] == [a]
    tracker.submit(Contribution(a, "p", "cid"))
    tracker.mark_failed(a, "x")
    assert next_deadline(tracker.rounds()) == 10.0
    assert [i.round_id for i in due_rounds(tracker.rounds(), 100)] == [b]


def test_timer_fires_when_the_fake_clock_passes_the_deadline() -> None:
    clock = FakeClock(0.0)
    deadline = {"at": 5.0}
    fired = threading.Event()

    def fire() -> None:
        deadline["at"] = 1e18  # handled: the next one is far away
        fired.set()

    timer = DeadlineTimer(clock, lambda: deadline["at"], fire, max_wait=30.0)
    clock.subscribe(timer.poke)
    timer.start()
    try:
        clock.advance(4.0)
        assert not fired.wait(0.05)
        clock.advance(1.0)
        assert fired.wait(10.0)
    finally:
        timer.stop()
    timer.stop()  # idempotent


def test_timer_survives_a_failing_fire_and_does_not_spin() -> None:
    clock = FakeClock(0.0)
    calls: list[int] = []
    twice = threading.Event()

    def fire() -> None:
        calls.append(1)
        if len(calls) >= 2:
            twice.set()
        raise RuntimeError("boom")

    timer = DeadlineTimer(clock, lambda: 0.0, fire, max_wait=0.01)
    timer.start()
    try:
        assert twice.wait(10.0)
    finally:
        timer.stop()
