"""RoundTracker: every behaviour of seed 000's BackwardPassCoordinator tests, plus the fixes."""

from __future__ import annotations

import threading

import pytest

from tensorswap.errors import RoundsError
from tensorswap.rounds.core import (
    Aggregating,
    Collecting,
    Complete,
    Contribution,
    DuplicateContribution,
    Failed,
    InvalidRoundSpec,
    LayerSpec,
    Pending,
    RoundAlreadyTerminal,
    RoundClosed,
    RoundId,
    RoundNotFound,
    RoundSpec,
    RoundTimeout,
    RoundTracker,
    UpdateMismatch,
    layout_mismatch,
    status_from_dict,
)


def make_round_id(round: int) -> RoundId:
    return RoundId(round, f"peer-{round}")


def make_contribution(round_id: RoundId, peer: str) -> Contribution:
    return Contribution(round_id, peer, f"grad-cid-{peer}", num_samples=100)


# ── the seed's tests ─────────────────────────────────────────────────────────
def test_start_round() -> None:
    tracker = RoundTracker(2, 5.0)
    rid = make_round_id(1)
    assert tracker.start(rid)
    assert tracker.status(rid) == Pending()


def test_start_round_duplicate_returns_false() -> None:
    tracker = RoundTracker(2, 5.0)
    rid = make_round_id(1)
    assert tracker.start(rid)
    assert not tracker.start(rid)


def test_submit_contribution_updates_status() -> None:
    tracker = RoundTracker(2, 5.0)
    rid = make_round_id(2)
    tracker.start(rid)
    assert tracker.submit(make_contribution(rid, "peer-a")) == Collecting(1, 2)


def test_is_ready_after_all_peers() -> None:
    tracker = RoundTracker(2, 5.0)
    rid = make_round_id(3)
    tracker.start(rid)
    assert not tracker.is_ready(rid)
    tracker.submit(make_contribution(rid, "peer-a"))
    assert not tracker.is_ready(rid)
    tracker.submit(make_contribution(rid, "peer-b"))
    assert tracker.is_ready(rid)


def test_mark_complete() -> None:
    tracker = RoundTracker(1, 5.0)
    rid = make_round_id(4)
    tracker.start(rid)
    assert tracker.mark_complete(rid, "agg-cid-42")
    assert tracker.status(rid) == Complete("agg-cid-42")


def test_mark_failed() -> None:
    tracker = RoundTracker(1, 5.0)
    rid = make_round_id(5)
    tracker.start(rid)
    assert tracker.mark_failed(rid, "timeout")
    assert tracker.status(rid) == Failed("timeout")


def test_submit_to_terminal_round_is_an_error_naming_the_status() -> None:
    tracker = RoundTracker(1, 5.0)
    rid = make_round_id(6)
    tracker.start(rid)
    tracker.mark_failed(rid, "network error")
    with pytest.raises(RoundAlreadyTerminal) as info:
        tracker.submit(make_contribution(rid, "late-peer"))
    assert info.value.status == "Failed"
    assert "status: Failed" in str(info.value)
    assert isinstance(info.value, RoundsError)


def test_gc_before_round() -> None:
    tracker = RoundTracker(1, 5.0)
    p1, p5, p10 = make_round_id(1), make_round_id(5), make_round_id(10)
    tracker.start(p1)
    tracker.mark_complete(p1, "cid-1")
    tracker.start(p5)
    tracker.mark_complete(p5, "cid-5")
    tracker.start(p10)
    assert tracker.gc_before_round(5) == 1
    assert tracker.status(p1) is None
    assert tracker.status(p5) is not None
    assert tracker.status(p10) is not None


def test_gc_keeps_active_rounds_below_the_limit() -> None:
    tracker = RoundTracker(1)
    rid = make_round_id(1)
    tracker.start(rid)
    assert tracker.gc_before_round(100) == 0
    assert tracker.status(rid) == Pending()


def test_active_count() -> None:
    tracker = RoundTracker(1, 5.0)
    p1, p2, p3 = make_round_id(1), make_round_id(2), make_round_id(3)
    for rid in (p1, p2, p3):
        tracker.start(rid)
    assert tracker.active_count() == 3
    tracker.mark_complete(p1, "cid")
    assert tracker.active_count() == 2
    tracker.mark_failed(p2, "err")
    assert tracker.active_count() == 1


# ── what the seed left loose ─────────────────────────────────────────────────
def test_submit_to_unknown_round_is_round_not_found() -> None:
    tracker = RoundTracker(2)
    with pytest.raises(RoundNotFound, match="Round not found: 9-peer-9") as info:
        tracker.submit(make_contribution(make_round_id(9), "a"))
    assert info.value.key == "9-peer-9"
    assert isinstance(info.value, KeyError)


def test_same_peer_twice_is_refused_and_counted_once() -> None:
    tracker = RoundTracker(3)
    rid = make_round_id(1)
    tracker.start(rid)
    tracker.submit(make_contribution(rid, "a"))
    with pytest.raises(DuplicateContribution) as info:
        tracker.submit(Contribution(rid, "a", "other-cid", 5))
    assert (info.value.peer, info.value.key) == ("a", "1-peer-1")
    assert tracker.status(rid) == Collecting(1, 3)
    assert [c.update_cid for c in tracker.contributions(rid)] == ["grad-cid-a"]


def test_full_round_refuses_more_contributions() -> None:
    tracker = RoundTracker(1)
    rid = make_round_id(1)
    tracker.start(rid)
    tracker.submit(make_contribution(rid, "a"))
    with pytest.raises(RoundClosed) as info:
        tracker.submit(make_contribution(rid, "b"))
    assert (info.value.received, info.value.expected) == (1, 1)


def test_aggregating_round_refuses_contributions() -> None:
    tracker = RoundTracker(3)
    rid = make_round_id(1)
    tracker.start(rid)
    tracker.submit(make_contribution(rid, "a"))
    assert tracker.begin_aggregation(rid)
    assert not tracker.begin_aggregation(rid)
    assert tracker.status(rid) == Aggregating()
    with pytest.raises(RoundClosed, match="Aggregating"):
        tracker.submit(make_contribution(rid, "b"))


def test_terminal_status_never_changes() -> None:
    tracker = RoundTracker(1)
    rid = make_round_id(1)
    tracker.start(rid)
    tracker.mark_complete(rid, "cid")
    with pytest.raises(RoundAlreadyTerminal, match="Complete"):
        tracker.mark_failed(rid, "late")
    with pytest.raises(RoundAlreadyTerminal):
        tracker.mark_complete(rid, "other")
    assert tracker.status(rid) == Complete("cid")
    assert not tracker.begin_aggregation(rid)


def test_mark_on_unknown_round_returns_false() -> None:
    tracker = RoundTracker(1)
    assert not tracker.mark_complete(make_round_id(1), "cid")
    assert not tracker.mark_failed(make_round_id(1), "x")
    assert tracker.contributions(make_round_id(1)) == []
    assert not tracker.is_ready(make_round_id(1))


def test_per_round_spec_overrides_the_default() -> None:
    tracker = RoundTracker(2)
    rid = make_round_id(1)
    tracker.start(rid, RoundSpec(3, quorum=2, timeout_s=10.0, strategy="median"))
    assert tracker.submit(make_contribution(rid, "a")) == Collecting(1, 3)
    info = tracker.info(rid)
    assert info is not None and info.spec.strategy == "median" and info.spec.quorum == 2


def test_first_layout_fixes_the_round_and_others_must_match() -> None:
    tracker = RoundTracker(3)
    rid = make_round_id(1)
    tracker.start(rid)
    layout = (LayerSpec("w", "float32", (2, 3)), LayerSpec("b", "float32", (3,)))
    tracker.submit(make_contribution(rid, "a"), layout=layout)
    bad = (LayerSpec("w", "float32", (2, 4)), LayerSpec("b", "float32", (3,)))
    with pytest.raises(UpdateMismatch, match=r"'w': expected shape \[2, 3\], got \[2, 4\]"):
        tracker.submit(make_contribution(rid, "b"), layout=bad)
    tracker.submit(make_contribution(rid, "c"), layout=tuple(reversed(layout)))
    assert tracker.status(rid) == Collecting(2, 3)


def test_layout_mismatch_names_missing_and_extra_layers() -> None:
    a = (LayerSpec("w", "float32", (2,)),)
    b = (LayerSpec("v", "float32", (2,)),)
    assert layout_mismatch(a, a) is None
    assert layout_mismatch(a, b) == "layer names differ: missing ['w'], unexpected ['v']"
    c = (LayerSpec("w", "float16", (2,)),)
    assert layout_mismatch(a, c) == "layer 'w': expected dtype float32, got float16"


def test_check_submit_raises_what_submit_would() -> None:
    tracker = RoundTracker(2)
    rid = make_round_id(1)
    with pytest.raises(RoundNotFound):
        tracker.check_submit(rid, "a")
    tracker.start(rid)
    assert tracker.check_submit(rid, "a").received == 0
    tracker.submit(make_contribution(rid, "a"))
    with pytest.raises(DuplicateContribution):
        tracker.check_submit(rid, "a")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"expected_peers": 0},
        {"expected_peers": 2, "quorum": 3},
        {"expected_peers": 2, "quorum": 0},
        {"expected_peers": 2, "timeout_s": 0},
        {"expected_peers": 2, "timeout_s": float("inf")},
        {"expected_peers": 2, "strategy": ""},
    ],
)
def test_invalid_specs_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidRoundSpec):
        RoundSpec(**kwargs)  # type: ignore[arg-type]


def test_round_id_key_round_trip() -> None:
    rid = RoundId(12, "peer-with-dashes")
    assert rid.as_key() == "12-peer-with-dashes"
    assert RoundId.parse_key(rid.as_key()) == rid
    with pytest.raises(ValueError):
        RoundId.parse_key("x-y")
    with pytest.raises(ValueError):
        RoundId(-1, "a")
    with pytest.raises(ValueError):
        RoundId(1, "")


@pytest.mark.parametrize(
    "status", [Pending(), Collecting(1, 2), Aggregating(), Complete("cid"), Failed("why")]
)
def test_status_dict_round_trip(status: object) -> None:
    assert status_from_dict(status.to_dict()) == status  # type: ignore[attr-defined]


def test_status_from_dict_rejects_garbage() -> None:
    with pytest.raises(ValueError):
        status_from_dict({"status": "Nope"})
    with pytest.raises(ValueError):
        status_from_dict({"status": "Collecting", "received": 1})


def test_listeners_see_every_change_and_a_failing_one_is_contained() -> None:
    tracker = RoundTracker(1)
    seen: list[object] = []

    def broken(rid: RoundId, status: object) -> None:
        raise RuntimeError("listener bug")

    tracker.subscribe(broken)
    tracker.subscribe(lambda rid, status: seen.append(status))
    rid = make_round_id(1)
    tracker.start(rid)
    tracker.submit(make_contribution(rid, "a"))
    tracker.begin_aggregation(rid)
    tracker.mark_complete(rid, "cid")
    assert seen == [Pending(), Collecting(1, 1), Aggregating(), Complete("cid")]


def test_wait_returns_the_terminal_status_set_by_another_thread() -> None:
    tracker = RoundTracker(1)
    rid = make_round_id(1)
    tracker.start(rid)
    waiting = threading.Event()
    tracker.subscribe(lambda r, s: None)
    thread = threading.Thread(target=lambda: (waiting.wait(), tracker.mark_complete(rid, "c")))
    thread.start()
    waiting.set()
    assert tracker.wait(rid, timeout=10) == Complete("c")
    thread.join()


def test_wait_times_out_with_the_status() -> None:
    tracker = RoundTracker(1)
    rid = make_round_id(1)
    tracker.start(rid)
    with pytest.raises(RoundTimeout, match="Pending"):
        tracker.wait(rid, timeout=0.0)
    with pytest.raises(RoundNotFound):
        tracker.wait(make_round_id(2), timeout=0.0)


def test_concurrent_submits_are_each_counted_once() -> None:
    tracker = RoundTracker(64)
    rid = make_round_id(1)
    tracker.start(rid)
    errors: list[BaseException] = []

    def submit(peer: str) -> None:
        try:
            tracker.submit(make_contribution(rid, peer))
        except DuplicateContribution as exc:
            errors.append(exc)

    # 32 peers, each submitting from two threads at once: exactly one of each pair wins.
    threads = [threading.Thread(target=submit, args=(f"p{i % 32}",)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 32
    assert tracker.status(rid) == Collecting(32, 64)
    assert sorted(c.peer for c in tracker.contributions(rid)) == sorted(f"p{i}" for i in range(32))


def test_public_names_import() -> None:
    import tensorswap.rounds as rounds

    assert rounds.__all__ == sorted(rounds.__all__)
    for name in rounds.__all__:
        assert getattr(rounds, name) is not None
