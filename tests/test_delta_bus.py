"""The broadcast bus: 4 listeners over loopback, drops, reconnect with backoff, close."""

from __future__ import annotations

import asyncio
import socket

import numpy as np
import pytest

from tensorswap.delta import (
    BusClosed,
    DweBus,
    DweConfig,
    DweFragment,
    DweLayerDelta,
    DweListener,
    DweTelemetry,
    FleetKeys,
    FragmentTooLarge,
    SendMode,
    apply_fragment,
    encode_frame,
    extract_delta_fragment,
    make_fragment,
)

SHAPES = [(3, 4), (5,)]


def _fragments(count: int, session: str = "sess") -> list[DweFragment]:
    rng = np.random.default_rng(1)
    base = [np.zeros(s, np.float32) for s in SHAPES]
    return [
        extract_delta_fragment(
            session, seq, [rng.standard_normal(s).astype(np.float32) for s in SHAPES], base
        )
        for seq in range(count)
    ]


class Peer:
    """A listener that applies to its own copy of the state and signals after ``expected``."""

    def __init__(self, expected: int, config: DweConfig | None = None) -> None:
        self.state = [np.zeros(s, np.float32) for s in SHAPES]
        self.expected = expected
        self.sequences: list[int] = []
        self.done = asyncio.Event()
        self.listener = DweListener(self.apply, config=config)

    def apply(self, fragment: DweFragment) -> None:
        apply_fragment(self.state, fragment)
        self.sequences.append(fragment.sequence)
        if len(self.sequences) >= self.expected:
            self.done.set()


def _expected_state(fragments: list[DweFragment]) -> list[np.ndarray]:
    state = [np.zeros(s, np.float32) for s in SHAPES]
    for fragment in fragments:
        apply_fragment(state, fragment)
    return state


@pytest.mark.parametrize("mode", [SendMode.PERSISTENT, SendMode.PER_FRAGMENT])
@pytest.mark.parametrize("signed", [False, True], ids=["plain", "hmac"])
async def test_four_listeners_apply_every_fragment_exactly_once(mode, signed) -> None:
    fragments = _fragments(12)
    keys = FleetKeys(b"fleet") if signed else None
    peers = [Peer(len(fragments), DweConfig(keys=keys)) for _ in range(4)]
    for peer in peers:
        await peer.listener.start()
    try:
        config = DweConfig(peers=tuple(p.listener.endpoint for p in peers), mode=mode, keys=keys)
        async with DweBus(config=config) as bus:
            for fragment in fragments:
                assert bus.broadcast(fragment)
            async with asyncio.timeout(10):
                await bus.flush()
                for peer in peers:
                    await peer.done.wait()
            stats = bus.telemetry()
    finally:
        for peer in peers:
            await peer.listener.aclose()
    expected = _expected_state(fragments)
    for peer in peers:
        assert peer.sequences == list(range(len(fragments)))
        for got, want in zip(peer.state, expected, strict=True):
            assert got.tobytes() == want.tobytes()
        lstats = peer.listener.telemetry()
        assert (lstats.received, lstats.applied, lstats.rejected) == (12, 12, 0)
    assert (stats.sent, stats.dropped, stats.send_failures, stats.queued) == (48, 0, 0, 0)
    assert stats.enqueued == 12
    connections = 4 if mode is SendMode.PERSISTENT else 48
    assert stats.reconnects == connections


@pytest.mark.parametrize("mode", [SendMode.PERSISTENT, SendMode.PER_FRAGMENT])
async def test_the_bytes_on_the_wire_are_the_dwe_frames_and_nothing_else(mode) -> None:
    """What a plain socket receives is exactly the frames' encodings, back to back."""
    fragments = _fragments(3)
    expected = b"".join(bytes(encode_frame(f)) for f in fragments)
    received = bytearray()
    got_all = asyncio.Event()

    async def capture(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while chunk := await reader.read(1 << 16):
            received.extend(chunk)
            if len(received) >= len(expected):
                got_all.set()
        writer.close()
        await writer.wait_closed()

    server = await asyncio.start_server(capture, "127.0.0.1", 0)
    async with server:
        port = server.sockets[0].getsockname()[1]
        async with DweBus(config=DweConfig(peers=(f"127.0.0.1:{port}",), mode=mode)) as bus:
            for fragment in fragments:
                assert bus.broadcast(fragment)
            async with asyncio.timeout(10):
                await bus.flush()
                await got_all.wait()
    assert bytes(received) == expected


async def test_queue_full_drops_are_counted_and_never_block() -> None:
    bus = DweBus(["127.0.0.1:9"], config=DweConfig(queue_size=2))  # never started: nobody drains
    results = [bus.broadcast(f) for f in _fragments(5)]
    assert results == [True, True, False, False, False]
    stats = bus.telemetry()
    assert (stats.enqueued, stats.dropped, stats.queued) == (2, 3, 2)
    assert "queue full" in (stats.last_error or "")
    await bus.aclose()
    with pytest.raises(BusClosed):
        bus.broadcast(_fragments(1)[0])


async def test_put_waits_for_room_instead_of_dropping() -> None:
    fragments = _fragments(10)
    peer = Peer(len(fragments))
    await peer.listener.start()
    try:
        config = DweConfig(peers=(peer.listener.endpoint,), queue_size=2)
        async with DweBus(config=config) as bus:
            async with asyncio.timeout(10):
                for fragment in fragments:
                    await bus.put(fragment)
                    assert bus.telemetry().queued <= 2
                await peer.done.wait()
            stats = bus.telemetry()
    finally:
        await peer.listener.aclose()
    assert (stats.sent, stats.dropped) == (10, 0)
    assert peer.sequences == list(range(10))
    with pytest.raises(BusClosed):
        await bus.put(fragments[0])


async def test_broadcast_from_another_thread() -> None:
    fragments = _fragments(3)
    peer = Peer(len(fragments))
    await peer.listener.start()
    try:
        async with DweBus([peer.listener.endpoint]) as bus:

            def produce() -> None:
                for fragment in fragments:
                    bus.broadcast_threadsafe(fragment)

            await asyncio.to_thread(produce)
            async with asyncio.timeout(10):
                await peer.done.wait()
    finally:
        await peer.listener.aclose()
    assert peer.sequences == [0, 1, 2]
    with pytest.raises(BusClosed):
        bus.broadcast_threadsafe(fragments[0])


async def test_oversized_fragment_refused_at_broadcast() -> None:
    bus = DweBus(["127.0.0.1:9"], config=DweConfig(max_fragment_bytes=200))
    with pytest.raises(FragmentTooLarge):
        bus.broadcast(_fragments(1)[0])
    assert bus.telemetry().enqueued == 0


async def test_disabled_bus_accepts_and_discards() -> None:
    async with DweBus.disabled() as bus:
        assert bus.broadcast(_fragments(1)[0])
        await bus.flush()
    assert bus.telemetry().sent == 0


class ErrorWatch(DweTelemetry):
    def __init__(self) -> None:
        super().__init__()
        self.errors = asyncio.Event()

    def record_error(self, error: str) -> None:
        super().record_error(error)
        self.errors.set()


async def test_reconnects_with_backoff_once_the_peer_comes_up() -> None:
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
    port = blocker.getsockname()[1]
    watch = ErrorWatch()
    config = DweConfig(
        peers=(f"127.0.0.1:{port}",), max_attempts=1000, backoff_initial=0.001, backoff_max=0.02
    )
    peer = Peer(1)
    try:
        async with DweBus(config=config, telemetry=watch) as bus:
            bus.broadcast(_fragments(1)[0])
            async with asyncio.timeout(5):
                await watch.errors.wait()  # the first attempt was refused
            blocker.close()
            await peer.listener.start("127.0.0.1", port)
            async with asyncio.timeout(10):
                await peer.done.wait()
                await bus.flush()
            stats = bus.telemetry()
    finally:
        blocker.close()
        await peer.listener.aclose()
    assert stats.sent == 1 and stats.reconnects == 1 and stats.send_failures == 0
    assert "127.0.0.1" in (stats.last_error or "")


async def test_unreachable_peer_gives_up_and_counts_a_failure() -> None:
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    try:
        config = DweConfig(
            peers=(f"127.0.0.1:{blocker.getsockname()[1]}",),
            max_attempts=2,
            backoff_initial=0.001,
            backoff_max=0.001,
        )
        async with DweBus(config=config) as bus:
            bus.broadcast(_fragments(1)[0])
            async with asyncio.timeout(5):
                await bus.flush()
            stats = bus.telemetry()
    finally:
        blocker.close()
    assert (stats.sent, stats.send_failures, stats.queued) == (0, 1, 0)
    assert "gave up after 2 attempts" in (stats.last_error or "")


async def test_a_peer_whose_name_cannot_resolve_fails_alone() -> None:
    bad = "a" * 64 + ".invalid:9000"  # a DNS label over 63 characters: IDNA refuses to encode it
    peer = Peer(1)
    await peer.listener.start()
    try:
        config = DweConfig(
            peers=(bad, str(peer.listener.endpoint)),
            max_attempts=2,
            backoff_initial=0.001,
            backoff_max=0.001,
        )
        async with DweBus(config=config) as bus:
            bus.broadcast(_fragments(1)[0])
            async with asyncio.timeout(5):
                await peer.done.wait()
                await bus.flush()
            stats = bus.telemetry()
    finally:
        await peer.listener.aclose()
    assert (stats.sent, stats.send_failures, stats.queued) == (1, 1, 0)
    assert "gave up after 2 attempts" in (stats.last_error or "")


async def test_from_env_reads_axiom_peers(monkeypatch) -> None:
    monkeypatch.delenv("TENSORSWAP_DWE_PEERS", raising=False)
    monkeypatch.setenv("AXIOM_DWE_PEERS", "127.0.0.1:7001, ,127.0.0.1:7002")
    bus = DweBus.from_env()
    assert [str(p) for p in bus.peers] == ["127.0.0.1:7001", "127.0.0.1:7002"]
    await bus.aclose()


async def test_an_unexpected_encode_error_fails_one_fragment_not_the_bus() -> None:
    fragments = _fragments(4)
    peer = Peer(3)
    await peer.listener.start()
    try:
        async with DweBus([peer.listener.endpoint]) as bus:

            def flaky(point: str, subject: object) -> None:
                if isinstance(subject, DweFragment) and subject.sequence == 1:
                    raise RuntimeError("encoder bug")  # point == "encode"

            bus.fault = flaky
            for fragment in fragments:
                assert bus.broadcast(fragment)
            async with asyncio.timeout(10):
                await bus.flush()
                await peer.done.wait()
            stats = bus.telemetry()  # (a failure escaping to the TaskGroup cancels this task)
    finally:
        await peer.listener.aclose()
    assert peer.sequences == [0, 2, 3]
    assert (stats.sent, stats.send_failures, stats.errors, stats.queued) == (3, 1, 1, 0)
    assert "encoder bug" in (stats.last_error or "")


async def test_one_peer_failing_unexpectedly_does_not_cancel_the_others() -> None:
    fragments = _fragments(3)
    good, bad = Peer(len(fragments)), Peer(len(fragments))
    await good.listener.start()
    await bad.listener.start()
    try:
        config = DweConfig(peers=(bad.listener.endpoint, good.listener.endpoint))
        async with DweBus(config=config) as bus:

            def broken_for_one(point: str, subject: object) -> None:
                if point == "send" and subject == bad.listener.endpoint:
                    raise RuntimeError("sender bug")

            bus.fault = broken_for_one
            for fragment in fragments:
                assert bus.broadcast(fragment)
            async with asyncio.timeout(10):
                await bus.flush()
                await good.done.wait()
            stats = bus.telemetry()
    finally:
        await good.listener.aclose()
        await bad.listener.aclose()
    assert good.sequences == [0, 1, 2] and bad.sequences == []
    assert (stats.sent, stats.send_failures, stats.errors, stats.queued) == (3, 3, 3, 0)
    assert "sender bug" in (stats.last_error or "")


@pytest.mark.parametrize("mode", [SendMode.PERSISTENT, SendMode.PER_FRAGMENT])
async def test_a_peer_that_stops_reading_is_given_up_on(mode: SendMode) -> None:
    """A peer that accepts but never reads: each fragment fails after its attempts (the
    write timeout), the bus does not wait for its unsent bytes to flush, and flush returns."""
    deaf = socket.socket()
    deaf.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    deaf.bind(("127.0.0.1", 0))
    deaf.listen(8)
    deaf.setblocking(False)
    held: list[socket.socket] = []
    loop = asyncio.get_running_loop()

    async def accept_forever() -> None:
        while True:
            conn, _ = await loop.sock_accept(deaf)
            held.append(conn)  # never read

    acceptor = asyncio.create_task(accept_forever())
    config = DweConfig(
        peers=(f"127.0.0.1:{deaf.getsockname()[1]}",),
        write_timeout=0.2,
        connect_timeout=1.0,
        max_attempts=1,
        backoff_initial=0.01,
        backoff_max=0.02,
        mode=mode,
    )
    n = 1_500_000  # a 6 MiB fragment: more than the socket buffers hold
    layer = [DweLayerDelta(0, (n,), np.ones(n, np.float32))]
    fragments = [make_fragment("deaf", i, layer) for i in range(2)]
    bus = DweBus(config=config, drain_timeout=5.0)
    await bus.start()
    try:
        for fragment in fragments:
            bus.broadcast(fragment)
        async with asyncio.timeout(30):
            await bus.flush()
        snapshot = bus.telemetry()
        assert (snapshot.sent, snapshot.send_failures) == (0, 2)
    finally:
        await bus.aclose()
        acceptor.cancel()
        for conn in held:
            conn.close()
        deaf.close()
