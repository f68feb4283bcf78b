"""SecAggSession: one round's server side by peer name: phases close when every expected peer
answered or at their deadline (a fake clock), dropped peers are told so, failures are typed."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("cryptography")

from tensorswap.privacy.secagg import (
    OutOfPhase,
    PeerDropped,
    ReplayedMessage,
    SecAggClient,
    SecureRoundFailed,
    UnknownParticipant,
    decode,
    make_config,
)
from tensorswap.privacy.secagg.coordinator import SecAggSession, SecAggSessions
from tensorswap.rounds import FakeClock

NAMES = ("ann", "bob", "cat", "dan")


def _session(clock: FakeClock, changes: list[str], **kw: object) -> SecAggSession:
    config = make_config(range(4), 8, clip=1.0, max_weight=10)
    options = {"quorum": 3, "phase_timeout_s": 5.0, "first_deadline": None, **kw}
    return SecAggSession(
        "1-fl",
        config,
        NAMES,
        clock=clock,
        on_change=lambda s: changes.append(s.phase),
        **options,  # type: ignore[arg-type]
    )


def _clients(session: SecAggSession) -> dict[str, SecAggClient]:
    out = {}
    for name in NAMES:
        index, setup = session.setup(name)
        out[name] = SecAggClient(index, np.full(8, 0.25, np.float32), 2)
        out[name]._pending = decode(setup)  # type: ignore[attr-defined]
    return out


def _step(
    session: SecAggSession, clients: dict[str, SecAggClient], names: tuple[str, ...], after: int
) -> None:
    for name in names:
        message = (
            clients[name]._pending
            if after == 0
            else decode(session.message_for(name, after) or b"")
        )  # type: ignore[attr-defined]
        session.post(name, clients[name].handle(message))


def test_phases_close_when_all_answered_and_the_sum_comes_out() -> None:
    clock, changes = FakeClock(), []
    session = _session(clock, changes)
    clients = _clients(session)
    for after in range(4):
        assert session.message_for("ann", after) is not None or after == 0
        _step(session, clients, NAMES, after)
    assert changes == ["share", "masked input", "unmask", "done"]
    outcome = session.outcome
    assert outcome is not None and outcome.survivors == NAMES and outcome.weight_sum == 8
    np.testing.assert_allclose(outcome.mean, 0.25, atol=1e-6)


def test_a_phase_closes_at_its_deadline_and_a_late_peer_is_dropped() -> None:
    clock, changes = FakeClock(), []
    session = _session(clock, changes, first_deadline=clock.now() + 10)
    clients = _clients(session)
    _step(session, clients, NAMES[:3], 0)
    assert session.message_for("ann", 1) is None  # still open: dan has not advertised
    clock.advance(9)
    assert not session.close_due(clock.now())
    clock.advance(1)
    assert session.close_due(clock.now()) and changes == ["share"]
    with pytest.raises(PeerDropped, match="dan"):
        session.message_for("dan", 1)
    with pytest.raises(PeerDropped):
        session.setup("dan")
    _step(session, clients, NAMES[:3], 1)
    _step(session, clients, NAMES[:3], 2)
    _step(session, clients, NAMES[:3], 3)
    assert session.outcome is not None and session.outcome.survivors == NAMES[:3]
    with pytest.raises(OutOfPhase):  # the round is unmasked: nothing more is taken
        session.setup("ann")


def test_the_masked_input_phase_lasts_until_the_rounds_deadline_at_least() -> None:
    """Peers train in the masked-input phase (their key phases ran as they took their tasks):
    it closes at the round's deadline, not ``phase_timeout_s`` after the shares, when that
    is later; never sooner than ``phase_timeout_s`` either; with no round deadline, when
    every peer answered."""
    clock, changes = FakeClock(), []
    start = clock.now()
    session = _session(clock, changes, first_deadline=start + 60)
    clients = _clients(session)
    _step(session, clients, NAMES, 0)
    _step(session, clients, NAMES, 1)
    assert changes == ["share", "masked input"] and session.deadline == start + 60
    _step(session, clients, NAMES[:3], 2)
    clock.advance(30)  # well past phase_timeout_s (5): dan is still training
    assert not session.close_due(clock.now())
    clock.advance(30)
    assert session.close_due(clock.now()) and changes[-1] == "unmask"
    with pytest.raises(PeerDropped, match="dan"):
        session.message_for("dan", 3)
    # no round deadline: it waits for every peer, as the first phase does
    open_ended, changed = FakeClock(), []
    session = _session(open_ended, changed)
    clients = _clients(session)
    _step(session, clients, NAMES, 0)
    _step(session, clients, NAMES, 1)
    assert changed[-1] == "masked input" and session.deadline is None
    open_ended.advance(3600)
    assert not session.close_due(open_ended.now())
    # past the round's deadline already: the phase timeout applies
    late, later = FakeClock(), []
    start = late.now()
    session = _session(late, later, first_deadline=start + 1)
    clients = _clients(session)
    _step(session, clients, NAMES, 0)
    late.advance(3)
    _step(session, clients, NAMES, 1)
    assert session.deadline == start + 3 + 5


def test_refusals_leave_the_session_as_it_was() -> None:
    clock, changes = FakeClock(), []
    session = _session(clock, changes)
    clients = _clients(session)
    advert = clients["ann"].handle(clients["ann"]._pending)  # type: ignore[attr-defined]
    with pytest.raises(UnknownParticipant):
        session.post("bob", advert)  # ann's message posted by bob
    with pytest.raises(UnknownParticipant):
        session.setup("eve")
    session.post("ann", advert)
    with pytest.raises(ReplayedMessage):
        session.post("ann", advert)
    assert session.phase == "advertise" and changes == []


def test_below_the_quorum_of_masked_inputs_the_session_fails_typed() -> None:
    clock, changes = FakeClock(), []
    session = _session(clock, changes, quorum=4, first_deadline=clock.now() + 1)
    clients = _clients(session)
    _step(session, clients, NAMES, 0)
    _step(session, clients, NAMES, 1)
    _step(session, clients, NAMES[:3], 2)
    clock.advance(5)  # the phase timeout, the round's deadline being past
    assert session.close_due(clock.now())
    assert session.phase == "failed" and "quorum 4" in (session.failure or "")
    with pytest.raises(SecureRoundFailed, match="quorum 4"):
        session.message_for("ann", 3)


def test_sessions_close_phases_on_their_timer_and_fail_what_is_left() -> None:
    clock, changes = FakeClock(), []
    sessions = SecAggSessions(clock, run_timer=False)
    session = _session(clock, changes, first_deadline=clock.now() + 1)
    sessions.add(session)
    clients = _clients(session)
    _step(session, clients, NAMES[:3], 0)
    clock.advance(1)
    assert sessions.check_deadlines() == 1 and changes == ["share"]
    sessions.close()
    assert session.phase == "failed" and changes[-1] == "failed"
