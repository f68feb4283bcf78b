"""rounds.client.reconnect: an operation run again on a fresh connection (with backoff)
after failures."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest

from helpers.net import running
from tensorswap.rounds import Backoff, Coordinator, RoundClient, RoundServer, retrying
from tensorswap.rounds.client import retryable
from tensorswap.rounds.core import DuplicateContribution, RoundId, RoundNotFound, RoundSpec
from tensorswap.transport import ConnectionFailed, PeerTimeout, UnexpectedEof
from tensorswap.wire.errors import (
    AuthenticationFailed,
    ProtocolViolation,
    RemoteError,
    RemoteOverBudget,
)


class FakeClient:
    """What ``retrying`` touches of a RoundClient: close and abort."""

    def __init__(self) -> None:
        self.closed = self.aborted = False
        self.blocks = SimpleNamespace(transport=SimpleNamespace(abort=self._abort))

    def _abort(self) -> None:
        self.aborted = True

    async def aclose(self) -> None:
        self.closed = True


class Script:
    """connect() fails with the given errors first, then hands out FakeClients."""

    def __init__(self, *failures: BaseException) -> None:
        self.failures = list(failures)
        self.clients: list[FakeClient] = []

    async def connect(self) -> RoundClient:
        if self.failures:
            raise self.failures.pop(0)
        client = FakeClient()
        self.clients.append(client)
        return cast(RoundClient, client)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.waits: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.waits.append(seconds)
        self.now += seconds


NO_JITTER = Backoff(first=0.5, factor=2.0, cap=1.5, jitter=0.0, give_up_after=10.0)


async def _ok(client: RoundClient) -> str:
    return "done"


async def test_connect_failures_are_retried_with_growing_capped_waits() -> None:
    script, clock = Script(*[ConnectionFailed("c:1", "refused")] * 3), Clock()
    got = await retrying(script.connect, _ok, NO_JITTER, sleep=clock.sleep, clock=clock)
    assert got == "done"
    assert clock.waits == [0.5, 1.0, 1.5]
    assert [c.closed for c in script.clients] == [True]


async def test_an_operation_failure_aborts_its_client_and_runs_again_on_a_new_one() -> None:
    script, clock = Script(), Clock()
    calls: list[FakeClient] = []

    async def flaky(client: RoundClient) -> int:
        calls.append(cast(FakeClient, client))
        if len(calls) == 1:
            raise PeerTimeout("sending a BLOCK frame", 3.0, "c:1")
        return len(calls)

    assert await retrying(script.connect, flaky, NO_JITTER, sleep=clock.sleep, clock=clock) == 2
    first, second = script.clients
    assert first.aborted and not first.closed and second.closed
    assert clock.waits == [0.5]


async def test_it_gives_up_after_the_window_with_the_last_error() -> None:
    clock = Clock()
    script = Script(*[ConnectionFailed("c:1", f"refused {i}") for i in range(100)])
    with pytest.raises(ConnectionFailed, match="refused"):
        await retrying(script.connect, _ok, NO_JITTER, sleep=clock.sleep, clock=clock)
    assert sum(clock.waits) == pytest.approx(10.0)  # the last wait is cut to the window
    assert max(clock.waits) <= 1.5


def closed_in_handshake() -> AuthenticationFailed:
    try:
        try:
            raise UnexpectedEof("the welcome", 0, 32)
        except UnexpectedEof as exc:
            raise AuthenticationFailed("c:1", "server closed before its welcome") from exc
    except AuthenticationFailed as exc:
        return exc


async def test_a_handshake_cut_by_the_connection_is_retried_a_wrong_key_is_not() -> None:
    script, clock = Script(closed_in_handshake()), Clock()
    assert await retrying(script.connect, _ok, NO_JITTER, sleep=clock.sleep, clock=clock)
    assert clock.waits == [0.5]
    script = Script(AuthenticationFailed("c:1", "the server's proof does not verify"))
    with pytest.raises(AuthenticationFailed, match="proof"):
        await retrying(script.connect, _ok, NO_JITTER, sleep=clock.sleep, clock=clock)
    assert clock.waits == [0.5]


@pytest.mark.parametrize(
    ("error", "again"),
    [
        (RemoteError("timeout", "idle too long"), True),
        (RemoteError("busy", "at its cap"), True),
        (RemoteOverBudget("over_budget", "a 9 GiB block"), False),
        (ProtocolViolation("Want names CIDs that were not offered"), False),
    ],
)
def test_which_remote_and_protocol_failures_are_retried(error: Exception, again: bool) -> None:
    assert retryable(error) is again


async def test_refusals_of_the_coordinator_are_not_retried() -> None:
    script, clock = Script(), Clock()

    async def refused(client: RoundClient) -> None:
        raise RoundNotFound("r1/lead")

    with pytest.raises(RoundNotFound):
        await retrying(script.connect, refused, NO_JITTER, sleep=clock.sleep, clock=clock)
    assert clock.waits == [] and len(script.clients) == 1


async def test_a_duplicate_after_a_retry_means_the_first_attempt_was_accepted() -> None:
    script, clock = Script(), Clock()
    attempts = 0

    async def submit(client: RoundClient) -> str:
        nonlocal attempts
        attempts += 1
        if attempts == 1:
            raise ConnectionFailed("c:1", "reset after the coordinator journaled it")
        raise DuplicateContribution("r1/lead", "a")

    got = await retrying(
        script.connect, submit, NO_JITTER, on_duplicate=lambda: "accepted before",
        sleep=clock.sleep, clock=clock,
    )  # fmt: skip
    assert got == "accepted before"


def test_jitter_only_shortens_waits_and_the_schedule_is_bounded() -> None:
    waits = Backoff(first=1.0, factor=3.0, cap=4.0, jitter=0.5).delays(random.Random(7))
    firsts = [next(waits) for _ in range(6)]
    assert all(0.5 * b <= w <= b for w, b in zip(firsts, [1, 3, 4, 4, 4, 4], strict=True))


@pytest.mark.parametrize(
    "options", [{"first": -1.0}, {"factor": 0.5}, {"jitter": 2.0}, {"give_up_after": -1.0}]
)
def test_bad_backoff_options_are_refused(options: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        Backoff(**options)


async def test_a_submit_is_retried_across_a_server_restart_on_the_same_port(
    tmp_path: Path,
) -> None:
    rid = RoundId(1, "lead")
    coordinator = Coordinator.open(tmp_path / "c")
    server = RoundServer(coordinator)
    port = 0
    async with running(server):
        port = server.port
        lead = await RoundClient.connect("127.0.0.1", port, peer="lead")
        async with lead:
            await lead.start_round(rid, RoundSpec(1))
    coordinator.close()  # the server is gone: the first connects are refused

    restarted: list[RoundServer] = []
    opened: list[Coordinator] = []

    async def connect() -> RoundClient:
        return await RoundClient.connect("127.0.0.1", port, peer="a")

    def restart(attempt: int, error: BaseException, wait: float) -> None:
        if attempt == 2:  # the coordinator comes back on the same data and port
            opened.append(Coordinator.open(tmp_path / "c"))
            restarted.append(RoundServer(opened[0]))

    async def restarted_connect() -> RoundClient:
        if restarted and restarted[0].listener is None:
            await restarted[0].start("127.0.0.1", port)
        return await connect()

    async def submit(client: RoundClient) -> int:
        await client.submit(rid, {"w": np.ones(4, np.float32)}, 1)
        return len((await client.fetch_result(rid, timeout=30))["w"])

    try:
        got = await retrying(
            restarted_connect, submit, Backoff(first=0.01, jitter=0.0), on_retry=restart
        )
        assert got == 4
    finally:
        for s in restarted:
            await s.aclose()
        for c in opened:
            c.close()
