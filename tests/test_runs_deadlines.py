"""Adaptive ("auto") round deadlines: the pure rule, the spec, and a run that uses them
(FakeClock arrivals), across a timeout and a restart."""

from __future__ import annotations

import io
import json
from pathlib import Path

import click
import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console

from tensorswap.cli._run_options import _Timeout
from tensorswap.cli.run_cmd import render_runs, run_json
from tensorswap.rounds import Coordinator, FakeClock
from tensorswap.rounds.core import Failed, RoundId
from tensorswap.runs import InvalidRunSpec, RunManager, RunSpec
from tensorswap.runs.deadlines import BACKOFF, RoundArrivals, auto_deadline
from tensorswap.runs.messages import RunAnswer, decode_answer, encode
from tensorswap.runs.views import row_of
from tensorswap.store import ModelUpdate, put_update
from test_runs import _model, _register_all, _train, federation


def _auto(history: list[RoundArrivals], quorum: int = 3, **kw: float) -> tuple[float, str]:
    opts = {"k": 3.0, "floor": 1.0, "cap": 600.0} | kw
    got = auto_deadline(history, quorum, **opts)  # type: ignore[arg-type]
    return got.seconds, got.reason


def _r(*delays: float, expected: int = 3, deadline: float | None = 100.0) -> RoundArrivals:
    return RoundArrivals(delays, expected, deadline)


# ── the pure rule ────────────────────────────────────────────────────────────
def test_median_plus_k_mad_of_the_quorum_th_arrival() -> None:
    history = [_r(1, 2, 4.0), _r(0.5, 4.2, 9), _r(4.4, 1, 3), _r(3.8, 4.6, 0), _r(4.2, 2, 1)]
    seconds, reason = _auto(history)
    # 3rd arrivals: 4, 9, 4.4, 4.6, 4.2 -> median 4.4, MAD median(.4,4.6,0,.2,.2) = 0.2
    assert seconds == pytest.approx(4.4 + 3 * 0.44)  # spread: max(MAD 0.2, 0.1 x 4.4)
    assert "median 4.4 s of the 3rd arrival over 5 rounds" in reason
    assert "(floor 1 s, cap 600 s)" in reason
    wide = [_r(1, 2, 4), _r(1, 2, 6), _r(1, 2, 5)]  # MAD 1 > 0.1 x 5
    assert _auto(wide) == (pytest.approx(5 + 3 * 1.0), pytest.approx(_auto(wide)[1]))
    assert "3 x MAD 1 s = 8 s" in _auto(wide)[1]


def test_no_history_gives_the_cap_or_the_initial_value() -> None:
    assert _auto([])[0] == 600.0
    assert "no arrivals yet, the cap" in _auto([])[1]
    assert auto_deadline([], 2, k=3, floor=1, cap=600, initial=30).seconds == 30
    assert auto_deadline([], 2, k=3, floor=1, cap=20, initial=30).seconds == 20  # clamped
    assert _auto([RoundArrivals((), 3, None)])[0] == 600.0  # a round that tells nothing


def test_a_mad_of_zero_still_leaves_a_tenth_of_the_median() -> None:
    seconds, reason = _auto([_r(1, 2, 10), _r(1, 2, 10)], k=2)
    assert seconds == pytest.approx(10 + 2 * 1.0)
    assert "0.1 x median 1 s" in reason
    assert _auto([_r(0, 0, 0)])[0] == 1.0  # all at once: the floor


def test_a_timed_out_round_counts_as_its_deadline_and_doubles_the_next() -> None:
    ok = [_r(1, 2, 3), _r(1, 2, 3.2)]
    timed_out = _r(1, 2, expected=3, deadline=3.5)  # 2 of 3 by its 3.5 s deadline
    seconds, reason = _auto([*ok, timed_out], k=1)
    assert seconds == pytest.approx(BACKOFF * 3.5)  # backoff beats 3.2 + 1 x 0.3
    assert "(1 timed out)" in reason and "last round timed out: 2 x 3.5 s = 7 s" in reason
    # once a round succeeds again, the timed-out one is one observation among others (3.5)
    seconds, _ = _auto([*ok, timed_out, _r(1, 2, 3.1)], k=1)
    assert seconds == pytest.approx(3.15 + 1 * 0.315)
    # consecutive timeouts at the cap stay at the cap
    assert _auto([_r(1, deadline=500.0)] * 3)[0] == 600.0


def test_a_quorum_larger_than_the_arrivals_seen() -> None:
    # the round expected 2 and both came: its last arrival is the best lower bound
    assert _auto([_r(1, 2, expected=2)], quorum=3, k=0)[0] == 2.0
    # it expected 4, got 2 before its deadline: the 3rd arrival is >= its deadline
    assert _auto([_r(1, 2, expected=4, deadline=5.0)], quorum=3, k=0)[0] == 10.0
    assert "4th arrival" in _auto([_r(1, 2, 3, 4, expected=4)], quorum=4)[1]


def test_bad_arguments_are_refused() -> None:
    for kw in ({"k": -1.0}, {"floor": 0.0}, {"floor": 5.0, "cap": 4.0}, {"cap": float("inf")}):
        with pytest.raises(ValueError):
            _auto([], **kw)
    with pytest.raises(ValueError):
        auto_deadline([], 0, k=1, floor=1, cap=2)
    with pytest.raises(ValueError):
        RoundArrivals((float("nan"),), 1, None)


_delays = st.lists(st.floats(0, 1e4, allow_nan=False), max_size=6)
_rounds = st.lists(
    st.builds(
        RoundArrivals,
        _delays.map(tuple),
        st.integers(1, 6),
        st.one_of(st.none(), st.floats(0.01, 1e4)),
    ),
    max_size=6,
)


@given(
    _rounds,
    st.integers(1, 6),
    st.floats(0, 10),
    st.floats(0, 10),
    st.floats(0.01, 100),
    st.floats(0, 1e4),
)
def test_properties_bounds_monotone_in_k_deterministic(
    history: list[RoundArrivals], quorum: int, k1: float, k2: float, floor: float, extra: float
) -> None:
    cap = floor + extra
    lo, hi = sorted((k1, k2))
    a = auto_deadline(history, quorum, k=lo, floor=floor, cap=cap)
    b = auto_deadline(history, quorum, k=hi, floor=floor, cap=cap)
    assert floor <= a.seconds <= cap and floor <= b.seconds <= cap
    assert a.seconds <= b.seconds
    assert auto_deadline(list(history), quorum, k=lo, floor=floor, cap=cap) == a


# ── the spec, the wire, the CLI ──────────────────────────────────────────────
def test_auto_specs_validate_and_round_trip() -> None:
    spec = RunSpec(round_timeout_s="auto", deadline_k=2.0, deadline_window=3)
    assert spec.auto_deadline and RunSpec.from_json(spec.to_json()) == spec
    assert not RunSpec(round_timeout_s=5.0).auto_deadline
    old = json.loads(RunSpec(round_timeout_s=5.0).to_json())
    for key in ("deadline_floor_s", "deadline_cap_s", "deadline_k", "deadline_window"):
        del old[key]  # a spec journaled before this feature
    assert RunSpec.from_json(json.dumps(old)) == RunSpec(round_timeout_s=5.0)
    for bad in (
        {"round_timeout_s": "soon"},
        {"round_timeout_s": 0},
        {"deadline_floor_s": 0},
        {"deadline_floor_s": 10, "deadline_cap_s": 5},
        {"deadline_k": -1},
        {"deadline_k": True},
        {"deadline_window": 0},
        {"deadline_initial_s": -1},
    ):
        with pytest.raises(InvalidRunSpec):
            RunSpec(**bad)  # type: ignore[arg-type]


def test_round_timeout_option_accepts_auto_or_seconds() -> None:
    kind = _Timeout()
    assert kind.convert("auto", None, None) == "auto"
    assert kind.convert("AUTO", None, None) == "auto"
    assert kind.convert("2.5", None, None) == 2.5
    for bad in ("0", "soon", "inf"):
        with pytest.raises(click.BadParameter):
            kind.convert(bad, None, None)


# ── a run with auto deadlines ────────────────────────────────────────────────
SPEC = RunSpec(
    per_round=3,
    round_timeout_s="auto",
    deadline_k=2.0,
    deadline_floor_s=0.5,
    deadline_cap_s=100.0,
    seed=5,
)


def _spaced(coord: Coordinator, manager: RunManager, clock: FakeClock, gaps: list[float]) -> None:
    """The sampled peers submit in order, the clock moved by ``gaps[i]`` before the i-th."""
    info = manager.run("auto")
    for peer, gap in zip(info.selected, gaps, strict=False):
        clock.advance(gap)
        task = manager.task("auto", peer)
        assert task is not None
        manager.submit(task.round_id, peer, _train(coord, task.global_cid, peer))


def _deadline_of(coord: Coordinator, round: int) -> float:
    info = coord.info(RoundId(round, "auto"))
    assert info is not None and info.deadline is not None
    return info.deadline - info.created_at


def test_a_run_adapts_its_deadline_to_arrivals_timeouts_and_restarts(tmp_path: Path) -> None:
    clock = FakeClock()
    with federation(tmp_path, clock) as (coord, manager):
        _register_all(manager)
        manager.create_run("auto", SPEC, put_update(coord.store, ModelUpdate(_model(0.0))))
        manager.drain()
        assert manager.run("auto").deadline_s == 100.0  # no history: the cap
        assert _deadline_of(coord, 1) == 100.0
        _spaced(coord, manager, clock, [1, 1, 1])  # 3rd arrival at 3 s
        manager.wait_version("auto", 1, timeout=60)
        manager.drain()
        # round 2 from round 1: 3 + 2 x (0.1 x 3) = 3.6
        assert manager.run("auto").deadline_s == pytest.approx(3.6)
        assert _deadline_of(coord, 2) == pytest.approx(3.6)
        _spaced(coord, manager, clock, [1, 1, 1.4])  # 3rd arrival at 3.4 s
        manager.wait_version("auto", 2, timeout=60)
        manager.drain()
        # round 3 from 3 and 3.4: median 3.2, MAD 0.2 < 0.32 -> 3.2 + 2 x 0.32 = 3.84
        info = manager.run("auto")
        assert info.round == 3 and info.deadline_s == pytest.approx(3.84)
        assert _deadline_of(coord, 3) == pytest.approx(3.84)
        assert "median 3.2 s of the 3rd arrival over 2 rounds" in info.deadline_reason
        row = row_of(manager, info)
        assert row.deadline_s == info.deadline_s and row.deadline_reason == info.deadline_reason
        # round 3: two peers only, then the deadline passes below quorum
        _spaced(coord, manager, clock, [1, 1])
        clock.advance(2)
        assert coord.check_deadlines() == [RoundId(3, "auto")]
        assert isinstance(coord.status(RoundId(3, "auto")), Failed)
        manager.drain()
        manager.drain()
        info = manager.run("auto")
        # round 4: 3rd arrivals 3, 3.4, >= 3.84 (timed out): median 3.4 + 2 x MAD 0.4 = 4.2,
        # but the last round timed out: 2 x 3.84
        assert info.round == 4 and info.version == 2
        assert info.deadline_s == pytest.approx(2 * 3.84)
        assert "(1 timed out)" in info.deadline_reason
        assert _deadline_of(coord, 4) == pytest.approx(2 * 3.84)
        before = (info.deadline_s, info.deadline_reason)
    with federation(tmp_path, clock) as (coord, manager):  # a new process, the same files
        manager.drain()
        info = manager.run("auto")
        assert (info.round, info.deadline_s, info.deadline_reason) == (4, *before)
        assert row_of(manager, info).deadline_s == before[0]
        assert _deadline_of(coord, 4) == pytest.approx(before[0])


def test_the_status_row_shows_the_deadline_and_omits_it_when_unset(tmp_path: Path) -> None:
    clock = FakeClock()
    with federation(tmp_path, clock) as (coord, manager):
        _register_all(manager)
        initial = put_update(coord.store, ModelUpdate(_model(0.0)))
        manager.create_run("auto", SPEC, initial)
        manager.create_run("fixed", RunSpec(per_round=2, round_timeout_s=9.0), initial)
        manager.drain()
        rows = {r.name: row_of(manager, r) for r in manager.runs()}
    fixed = msgspec.msgpack.decode(encode(RunAnswer(runs=[rows["fixed"]])))["runs"][0]
    assert "deadline_s" not in fixed and "deadline_reason" not in fixed
    again = decode_answer(encode(RunAnswer(runs=[rows["auto"], rows["fixed"]]))).runs
    assert again is not None and again[0] == rows["auto"] and again[1].deadline_s is None
    assert run_json(rows["auto"])["deadline_s"] == 100.0
    out = io.StringIO()
    render_runs([rows["auto"], rows["fixed"]], Console(file=out, width=200))
    text = out.getvalue()
    assert "run auto round 1: deadline 100 s (auto: no arrivals yet, the cap" in text
    assert "run fixed" not in text
