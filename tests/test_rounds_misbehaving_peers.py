"""RoundServer / RoundClient against hostile or careless peers: bad timeouts, abandoned
waits, deep msgpack, hostile error facts, oversized names and layouts, oversized status."""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from helpers.net import running
from tensorswap.rounds.client import BlockingRoundClient, RoundClient
from tensorswap.rounds.core import (
    Complete,
    DuplicateContribution,
    InvalidRoundSpec,
    LayerSpec,
    Pending,
    RoundId,
    RoundNotFound,
    RoundSpec,
    RoundStatus,
    RoundTimeout,
)
from tensorswap.rounds.engine import Coordinator
from tensorswap.rounds.protocol.codec import (
    APP,
    MAX_NAME_BYTES,
    ErrorInfo,
    RoundCall,
    SpecWire,
    decode_answer,
    decode_call,
    encode_call,
    raise_remote,
)
from tensorswap.rounds.server import RoundServer
from tensorswap.wire import Transport, WireLimits
from tensorswap.wire.client import BlockClient
from tensorswap.wire.errors import ProtocolViolation, RemoteError
from tensorswap.wire.messages import Request

RID = RoundId(1, "lead")
NESTED = b"\x91" * 10_000 + b"\xc0"  # 10,000 nested one-element arrays


class WatchedServer(RoundServer):
    """A RoundServer that reports wait requests starting and connections ending."""

    def __init__(self, coordinator: Coordinator, **options: Any) -> None:
        super().__init__(coordinator, **options)
        self.waits = 0
        self.wait_started = asyncio.Condition()
        self.ended = asyncio.Condition()
        self.connections_ended = 0

    async def _wait(self, rid: RoundId, timeout: float | None) -> RoundStatus:
        async with self.wait_started:
            self.waits += 1
            self.wait_started.notify_all()
        return await super()._wait(rid, timeout)

    async def handle(self, transport: Transport) -> None:
        try:
            await super().handle(transport)
        finally:
            async with self.ended:
                self.connections_ended += 1
                self.ended.notify_all()

    async def until_waits(self, n: int) -> None:
        async with self.wait_started:
            await self.wait_started.wait_for(lambda: self.waits >= n)


@pytest.fixture
async def coordinator(tmp_path: Path) -> AsyncIterator[Coordinator]:
    with Coordinator.open(tmp_path, run_timer=False, durable=False) as coord:
        yield coord


@pytest.fixture
async def server(coordinator: Coordinator) -> AsyncIterator[WatchedServer]:
    async with running(WatchedServer(coordinator, max_wait=0.05)) as srv:
        yield srv


async def raw(server: RoundServer, call: RoundCall | bytes) -> bytes:
    """One rounds request on a fresh plain connection; the raw answer body."""
    body = call if isinstance(call, bytes) else encode_call(call)
    async with await BlockClient.connect("127.0.0.1", server.port) as client:
        return await client.request(APP, body)


# ── wait timeouts ─────────────────────────────────────────────────────────
@pytest.mark.parametrize("timeout", [math.nan, math.inf, -1.0])
async def test_a_wait_timeout_that_is_not_finite_and_non_negative_is_refused(
    server: WatchedServer, timeout: float
) -> None:
    server.coordinator.start_round(RID, RoundSpec(2))
    async with asyncio.timeout(10):
        with pytest.raises(RemoteError) as refused:
            await raw(server, RoundCall("wait", 1, "lead", timeout=timeout))
        assert refused.value.code == "protocol_violation"
        # the event loop's timers still work for every other connection
        async with await RoundClient.connect("127.0.0.1", server.port, peer="p") as client:
            with pytest.raises(RoundTimeout):
                await client.wait(RID, timeout=0.01)


async def test_every_wait_request_is_capped_at_max_wait(server: WatchedServer) -> None:
    server.coordinator.start_round(RID, RoundSpec(2))
    async with asyncio.timeout(10):
        answer = decode_answer(await raw(server, RoundCall("wait", 1, "lead", timeout=None)))
        assert answer.error is not None and answer.error.code == "RoundTimeout"
        assert answer.error.facts["timeout"] == server.max_wait


def test_max_wait_must_be_a_positive_number(coordinator: Coordinator) -> None:
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="max_wait"):
            RoundServer(coordinator, max_wait=bad)


# ── waits longer than the server's cap ───────────────────────────────────
async def test_an_abandoned_wait_frees_its_connection_after_max_wait(
    server: WatchedServer,
) -> None:
    server.coordinator.start_round(RID, RoundSpec(2))
    async with asyncio.timeout(10):
        client = await BlockClient.connect("127.0.0.1", server.port)
        body = encode_call(RoundCall("wait", 1, "lead", timeout=None))
        await client.conn.send_message(Request(app=APP, body=body), 1)
        await server.until_waits(1)
        client.transport.abort()
        async with server.ended:
            await server.ended.wait_for(lambda: server.connections_ended >= 1)
        assert server.traffic().open_connections == 0


async def test_client_wait_outlasts_the_server_cap(server: WatchedServer) -> None:
    server.coordinator.start_round(RID, RoundSpec(1))
    async with asyncio.timeout(10):
        async with await RoundClient.connect("127.0.0.1", server.port, peer="a") as a:
            waiting = asyncio.create_task(a.wait(RID))
            await server.until_waits(3)  # the client asked again after two capped waits
            async with await RoundClient.connect("127.0.0.1", server.port, peer="b") as b:
                await b.submit(RID, {"w": np.ones(3, np.float32)}, 1)
            assert isinstance(await waiting, Complete)


async def test_client_wait_with_a_timeout_above_the_cap_times_out_as_asked(
    server: WatchedServer,
) -> None:
    server.coordinator.start_round(RID, RoundSpec(2))
    async with asyncio.timeout(10):
        async with await RoundClient.connect("127.0.0.1", server.port, peer="a") as a:
            loop = asyncio.get_running_loop()
            began = loop.time()
            with pytest.raises(RoundTimeout) as timed_out:
                await a.wait(RID, timeout=0.2)
            assert loop.time() - began >= 0.19  # (clock rounding)
            assert timed_out.value.timeout == 0.2 and timed_out.value.status == "Pending"
            assert server.waits >= 3
            with pytest.raises(ValueError, match="nan"):
                await a.wait(RID, timeout=math.nan)
            assert await a.status(RID) == Pending()  # the connection is still usable


async def test_blocking_client_wait_outlasts_the_server_cap(server: WatchedServer) -> None:
    server.coordinator.start_round(RID, RoundSpec(1))
    got: list[RoundStatus] = []

    def wait_blocking() -> None:
        with BlockingRoundClient("127.0.0.1", server.port, peer="a") as client:
            got.append(client.wait(RID, timeout=10))  # far above the cap

    thread = threading.Thread(target=wait_blocking)
    thread.start()
    try:
        async with asyncio.timeout(10):
            await server.until_waits(3)
            async with await RoundClient.connect("127.0.0.1", server.port, peer="b") as b:
                await b.submit(RID, {"w": np.ones(3, np.float32)}, 1)
    finally:
        await asyncio.to_thread(thread.join, 15)
    assert len(got) == 1 and isinstance(got[0], Complete)


# ── deeply nested msgpack ────────────────────────────────────────────────
def test_deeply_nested_msgpack_is_a_protocol_violation() -> None:
    body = b"\x82\xa2op\xa4wait\xa1z" + NESTED
    with pytest.raises(ProtocolViolation, match="rounds request"):
        decode_call(body)
    with pytest.raises(ProtocolViolation, match="rounds answer"):
        decode_answer(body)


async def test_a_deeply_nested_request_gets_a_protocol_violation_answer(
    server: WatchedServer,
) -> None:
    async with asyncio.timeout(10):
        with pytest.raises(RemoteError) as refused:
            await raw(server, b"\x82\xa2op\xa4wait\xa1z" + NESTED)
        assert refused.value.code == "protocol_violation"
        assert isinstance(server.errors[-1], ProtocolViolation)


# ── hostile facts in a refusal ───────────────────────────────────────────
@pytest.mark.parametrize(
    "facts",
    [{"args": 1}, {"__traceback__": 1}, {"with_traceback": 1}, {"_private": "x"}],
)
def test_facts_cannot_break_the_raised_error(facts: dict[str, int | str]) -> None:
    info = ErrorInfo("DuplicateContribution", "refused", {"peer": "a", **facts})
    with pytest.raises(DuplicateContribution) as raised:
        raise_remote(info, "server")
    exc = raised.value
    assert exc.peer == "a" and str(exc) == "refused" and exc.args == ("refused",)
    assert exc.__traceback__ is not None and callable(exc.with_traceback)
    assert not hasattr(exc, "_private")


def test_a_round_not_found_keeps_its_message_and_key() -> None:
    info = ErrorInfo("RoundNotFound", "Round not found: 1-x", {"key": "1-x", "args": 3})
    with pytest.raises(RoundNotFound) as raised:
        raise_remote(info, "server")
    assert (raised.value.key, str(raised.value)) == ("1-x", "Round not found: 1-x")


# ── names and status size ───────────────────────────────────────────────
async def test_long_initiator_and_peer_names_are_refused(server: WatchedServer) -> None:
    long = "é" * (MAX_NAME_BYTES // 2 + 1)  # 2 bytes each in UTF-8: just over the limit
    ok = "é" * (MAX_NAME_BYTES // 2)
    async with asyncio.timeout(10):
        for call in (
            RoundCall("start", 1, long, spec=SpecWire(2)),
            RoundCall("status", 1, long),
            RoundCall("submit", 1, "lead", peer=long, update=b"\x01"),
            RoundCall("submit", 1, "lead", peer="", update=b"\x01"),
        ):
            with pytest.raises(RemoteError) as refused:
                await raw(server, call)
            assert refused.value.code == "protocol_violation"
        assert server.coordinator.rounds() == []
        async with await RoundClient.connect("127.0.0.1", server.port, peer=ok) as client:
            assert await client.start_round(RoundId(1, ok), RoundSpec(1))


async def test_long_names_in_a_spec_are_refused(server: WatchedServer) -> None:
    long = "x" * (MAX_NAME_BYTES + 1)
    specs = [
        RoundSpec(2, strategy=long),
        RoundSpec(2, params={long: 1}),
        RoundSpec(2, strategy="trimmed_mean", params={"trim_fraction": long}),
        RoundSpec(2, layout=(LayerSpec(long, "float32", (2,)),)),
        RoundSpec(2, layout=(LayerSpec("w", long, (2,)),)),
    ]
    async with asyncio.timeout(10):
        async with await RoundClient.connect("127.0.0.1", server.port, peer="a") as client:
            for i, spec in enumerate(specs):
                with pytest.raises(InvalidRoundSpec, match="at most 256"):
                    await client.start_round(RoundId(i, "lead"), spec)
            assert server.coordinator.rounds() == []


async def test_a_status_answer_stays_within_the_message_limit(
    coordinator: Coordinator,
) -> None:
    limits = WireLimits(max_message_bytes=8192)
    server = await RoundServer(coordinator, limits=limits).start("127.0.0.1", 0)
    name = "n" * MAX_NAME_BYTES
    async with server, asyncio.timeout(20):
        for i in range(60):
            coordinator.start_round(RoundId(i, name), RoundSpec(2))
        async with await RoundClient.connect(
            "127.0.0.1", server.port, peer="a", limits=limits
        ) as client:
            report = await client.server_status()
            assert report.omitted > 0 and len(report.rounds) + report.omitted == 60
            # the newest rounds are the ones listed, in their usual order
            listed = [row.round for row in report.rounds]
            assert listed == sorted(listed) and listed[-1] == 59
            assert await client.status(RoundId(0, name)) == Pending()


# ── layouts ──────────────────────────────────────────────────────────────────
@pytest.mark.parametrize(
    ("shape", "match"),
    [
        ((-1,), "negative dim"),
        ((2**62, 2**62), "elements"),
        ((1,) * 65, "dims"),
    ],
)
async def test_impossible_layouts_are_refused(
    server: WatchedServer, shape: tuple[int, ...], match: str
) -> None:
    spec = RoundSpec(2, layout=(LayerSpec("w", "float32", shape),))
    async with asyncio.timeout(10):
        async with await RoundClient.connect("127.0.0.1", server.port, peer="a") as client:
            with pytest.raises(InvalidRoundSpec, match=match):
                await client.start_round(RID, spec)
            assert server.coordinator.rounds() == []
            zero = RoundSpec(2, layout=(LayerSpec("w", "float32", (0, 3)),))
            assert await client.start_round(RID, zero)
