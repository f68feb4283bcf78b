"""The listener over loopback: verdicts, tampering, size cap, truncation, hand-off."""

from __future__ import annotations

import asyncio
import struct

import numpy as np
import pytest

from helpers.net import until
from tensorswap.delta import (
    DeltaConfigError,
    DweConfig,
    DweFragment,
    DweListener,
    FleetKeys,
    RejectReason,
    StateMismatch,
    Verdict,
    apply_fragment,
    encode_frame,
    extract_delta_fragment,
    sign_fragment,
)
from tensorswap.errors import DeltaError

KEY = b"fleet"


def _fragment(seq: int, fill: float = 1.0) -> DweFragment:
    return extract_delta_fragment(
        "sess", seq, [np.full((2, 3), fill, np.float32)], [np.zeros((2, 3))]
    )


class Verdicts:
    """An ``on_verdict`` that records; an event per verdict keeps the tests sleep-free."""

    def __init__(self) -> None:
        self.seen: list[Verdict] = []
        self._changed = asyncio.Event()

    def __call__(self, verdict: Verdict) -> None:
        self.seen.append(verdict)
        self._changed.set()

    async def until(self, count: int, seconds: float = 5.0) -> list[Verdict]:
        async with asyncio.timeout(seconds):
            while len(self.seen) < count:
                self._changed.clear()
                await self._changed.wait()
        return self.seen


class Harness:
    """A listener applying to its own state, its verdicts recorded."""

    def __init__(self, **kwargs) -> None:
        self.state = [np.zeros((2, 3), np.float32)]
        self.record = Verdicts()
        self.verdicts = self.record.seen
        self.listener = DweListener(
            lambda f: apply_fragment(self.state, f), on_verdict=self.record, **kwargs
        )

    async def until(self, count: int) -> list[Verdict]:
        return await self.record.until(count)


async def _send_raw(endpoint, *frames: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection(endpoint.host, endpoint.port)
    for frame in frames:
        writer.write(frame)
    await writer.drain()
    return reader, writer


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    await writer.wait_closed()


async def test_frames_on_one_connection_are_verified_and_applied() -> None:
    h = Harness()
    async with h.listener:
        _, writer = await _send_raw(
            h.listener.endpoint, encode_frame(_fragment(1)), encode_frame(_fragment(2, 0.5))
        )
        verdicts = await h.until(2)
        await _close(writer)
    assert [v.accepted for v in verdicts] == [True, True]
    assert verdicts[0].session_id == "sess" and verdicts[1].sequence == 2
    assert h.state[0].tolist() == [[1.5] * 3] * 2
    stats = h.listener.telemetry()
    assert (stats.received, stats.accepted, stats.applied, stats.rejected) == (2, 2, 2, 0)
    assert stats.last_session_id == "sess"


def _flip_value_byte(frame: bytearray) -> bytearray:
    frame[-(8 + 64) - 3] ^= 0x40  # inside the last float value
    return frame


def _wrong_hash(frame: bytearray) -> bytearray:
    frame[-1:] = b"0" if frame[-1:] != b"0" else b"1"
    return frame


TAMPERING = {
    "flipped_value_byte": (lambda: _flip_value_byte(encode_frame(_fragment(2))), None),
    "wrong_hash": (lambda: _wrong_hash(encode_frame(_fragment(2))), None),
    "wrong_hmac": (lambda: encode_frame(sign_fragment(_fragment(2), b"intruder")), KEY),
    "missing_hmac": (lambda: encode_frame(_fragment(2)), KEY),
    "replayed_sequence": (lambda: encode_frame(_fragment(1)), None),
    "stale_sequence": (lambda: encode_frame(_fragment(0)), None),
}
REASONS = {
    "flipped_value_byte": RejectReason.STATE_HASH,
    "wrong_hash": RejectReason.STATE_HASH,
    "wrong_hmac": RejectReason.HMAC_MISMATCH,
    "missing_hmac": RejectReason.HMAC_MISSING,
    "replayed_sequence": RejectReason.REPLAY,
    "stale_sequence": RejectReason.STALE,
}


@pytest.mark.parametrize("kind", sorted(TAMPERING))
async def test_tampering_is_rejected_counted_and_leaves_state_untouched(kind: str) -> None:
    make_bad, key = TAMPERING[kind]
    config = DweConfig(keys=FleetKeys(key) if key else None)
    h = Harness(config=config)
    good = _fragment(1) if key is None else sign_fragment(_fragment(1), key)
    async with h.listener:
        _, writer = await _send_raw(h.listener.endpoint, encode_frame(good), make_bad())
        verdicts = await h.until(2)
        await _close(writer)
    assert verdicts[0].accepted
    assert not verdicts[1].accepted and verdicts[1].reason is REASONS[kind]
    assert h.state[0].tolist() == [[1.0] * 3] * 2  # only the good fragment landed
    stats = h.listener.telemetry()
    assert stats.rejected == 1 and stats.rejections == {REASONS[kind].value: 1}
    assert stats.applied == 1 and stats.last_error is not None


async def test_oversized_prefix_refused_before_reading_the_body() -> None:
    h = Harness(config=DweConfig(max_fragment_bytes=1024))
    async with h.listener:
        reader, writer = await _send_raw(h.listener.endpoint, struct.pack("<I", 0xFFFF_FFFF))
        async with asyncio.timeout(5):  # the listener hangs up without waiting for 4 GiB
            assert await reader.read() == b""
        await _close(writer)
        verdicts = await h.until(1)
    assert verdicts[0].reason is RejectReason.TOO_LARGE
    assert h.listener.telemetry().rejections == {"too_large": 1}
    assert h.listener.telemetry().received == 0


async def test_truncated_frame_is_counted() -> None:
    h = Harness()
    async with h.listener:
        _, writer = await _send_raw(h.listener.endpoint, struct.pack("<I", 100) + bytes(10))
        await _close(writer)
        verdicts = await h.until(1)
    assert verdicts[0].reason is RejectReason.TRUNCATED


async def test_malformed_body_keeps_the_connection_in_step() -> None:
    h = Harness()
    async with h.listener:
        junk = struct.pack("<I", 5) + b"\xff" * 5
        _, writer = await _send_raw(h.listener.endpoint, junk, encode_frame(_fragment(1)))
        verdicts = await h.until(2)
        await _close(writer)
    assert verdicts[0].reason is RejectReason.MALFORMED
    assert verdicts[1].accepted


async def test_failed_apply_leaves_the_sequence_free_for_a_retry() -> None:
    calls: list[int] = []

    def refuse_first(fragment: DweFragment) -> None:
        calls.append(fragment.sequence)
        if len(calls) == 1:
            raise StateMismatch(0, "not ready")

    verdicts: list[Verdict] = []
    got = asyncio.Event()

    def seen(v: Verdict) -> None:
        verdicts.append(v)
        if len(verdicts) == 2:
            got.set()

    async with DweListener(refuse_first, on_verdict=seen) as listener:
        frame = encode_frame(_fragment(1))
        _, writer = await _send_raw(listener.endpoint, frame, frame)
        async with asyncio.timeout(5):
            await got.wait()
        await _close(writer)
    assert [v.reason for v in verdicts] == [RejectReason.APPLY_FAILED, None]
    assert calls == [1, 1]


async def test_queue_hand_off() -> None:
    queue: asyncio.Queue[DweFragment] = asyncio.Queue(maxsize=4)
    async with DweListener(queue) as listener:
        _, writer = await _send_raw(listener.endpoint, encode_frame(_fragment(3)))
        async with asyncio.timeout(5):
            fragment = await queue.get()
        await _close(writer)
    assert fragment == _fragment(3)
    assert listener.telemetry().applied == 1


async def test_handler_bug_is_contained() -> None:
    def broken(fragment: DweFragment) -> None:
        raise RuntimeError("boom")

    record = Verdicts()
    async with DweListener(broken, on_verdict=record) as listener:
        _, writer = await _send_raw(listener.endpoint, encode_frame(_fragment(1)))
        verdicts = await record.until(1)
        await _close(writer)
    assert verdicts[0].reason is RejectReason.HANDLER_ERROR and "boom" in verdicts[0].detail


def test_require_key_refuses_to_start_without_one() -> None:
    with pytest.raises(DeltaConfigError):
        DweListener(require_key=True)
    DweListener(require_key=True, config=DweConfig(keys=FleetKeys(KEY)))


async def test_a_host_name_idna_refuses_is_a_delta_error() -> None:
    listener = DweListener()
    with pytest.raises(DeltaError, match="cannot listen"):
        await listener.start("a" * 64 + ".invalid", 0)  # a label over 63 characters
    await listener.aclose()


# ── containment: nothing a connection or a callback raises stops the listener ──
async def test_a_raising_on_verdict_is_contained_and_counted() -> None:
    state = [np.zeros((2, 3), np.float32)]
    applied = asyncio.Event()

    def apply(fragment: DweFragment) -> None:
        apply_fragment(state, fragment)
        if fragment.sequence == 2:
            applied.set()

    def broken(verdict: Verdict) -> None:
        raise RuntimeError("callback bug")

    async with DweListener(apply, on_verdict=broken) as listener:
        _, first = await _send_raw(listener.endpoint, encode_frame(_fragment(1)))
        _, second = await _send_raw(listener.endpoint, encode_frame(_fragment(2, 0.5)))
        async with asyncio.timeout(5):  # this task is cancelled if the failure escapes
            await applied.wait()
        await _close(first)
        await _close(second)
        stats = listener.telemetry()
    assert state[0].tolist() == [[1.5] * 3] * 2
    assert (stats.accepted, stats.applied, stats.errors) == (2, 2, 2)
    assert "callback bug" in (stats.last_error or "")


async def test_an_unexpected_error_rejects_the_frame_and_the_connection_goes_on() -> None:
    h = Harness()
    check = h.listener.verifier.check_integrity
    calls = 0

    def flaky(*args):
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("verifier bug")
        return check(*args)

    h.listener.verifier.check_integrity = flaky  # type: ignore[method-assign]
    async with h.listener:
        frames = encode_frame(_fragment(1)), encode_frame(_fragment(2))
        _, writer = await _send_raw(h.listener.endpoint, *frames)
        verdicts = await h.until(2)
        await _close(writer)
    assert verdicts[0].reason is RejectReason.INTERNAL_ERROR
    assert "verifier bug" in verdicts[0].detail
    assert verdicts[1].accepted and verdicts[1].sequence == 2
    stats = h.listener.telemetry()
    assert stats.rejections == {"internal_error": 1} and stats.applied == 1


# ── idle connections, stalled frames, the connection cap ───────────────────
async def _closed_by_listener(reader: asyncio.StreamReader) -> bool:
    async with asyncio.timeout(5):
        return await reader.read() == b""


async def test_an_idle_connection_is_closed_after_idle_timeout() -> None:
    h = Harness(config=DweConfig(idle_timeout=0.05))
    async with h.listener:
        reader, writer = await _send_raw(h.listener.endpoint)  # connects, never sends
        assert await _closed_by_listener(reader)
        await _close(writer)
        stats = h.listener.telemetry()
    assert stats.idle_closed == 1 and stats.rejected == 0 and h.verdicts == []


async def test_a_stalled_partial_prefix_is_dropped_after_frame_timeout() -> None:
    h = Harness(config=DweConfig(frame_timeout=0.05))
    async with h.listener:
        reader, writer = await _send_raw(h.listener.endpoint, b"\x10\x00")  # 2 of 4 bytes
        verdicts = await h.until(1)
        assert await _closed_by_listener(reader)
        await _close(writer)
    assert verdicts[0].reason is RejectReason.TIMEOUT and "prefix" in verdicts[0].detail


async def test_a_stalled_body_is_dropped_after_frame_timeout() -> None:
    h = Harness(config=DweConfig(frame_timeout=0.05))
    async with h.listener:
        reader, writer = await _send_raw(h.listener.endpoint, struct.pack("<I", 100) + bytes(10))
        verdicts = await h.until(1)
        assert await _closed_by_listener(reader)
        await _close(writer)
    assert verdicts[0].reason is RejectReason.TIMEOUT and "100 bytes" in verdicts[0].detail


async def test_at_the_cap_the_longest_idle_connection_makes_room() -> None:
    h = Harness(config=DweConfig(max_connections=2))
    async with h.listener:
        oldest, oldest_w = await _send_raw(h.listener.endpoint, encode_frame(_fragment(1)))
        await h.until(1)
        _, newer_w = await _send_raw(h.listener.endpoint, encode_frame(_fragment(2)))
        await h.until(2)  # both connections are idle now, `oldest` for longer
        _, third_w = await _send_raw(h.listener.endpoint, encode_frame(_fragment(3)))
        await h.until(3)  # the newcomer was served, not refused
        assert await _closed_by_listener(oldest)
        newer_w.write(encode_frame(_fragment(4)))  # the other idle connection still works
        verdicts = await h.until(4)
        for writer in (oldest_w, newer_w, third_w):
            await _close(writer)
        stats = h.listener.telemetry()
    assert [v.accepted for v in verdicts] == [True] * 4
    assert stats.idle_closed == 1


async def test_a_connection_in_the_middle_of_a_frame_is_not_evicted() -> None:
    h = Harness(config=DweConfig(max_connections=1))
    frame = encode_frame(_fragment(1))
    async with h.listener:
        _, busy = await _send_raw(h.listener.endpoint, frame[:10])
        tcp = h.listener.tcp_listener
        assert tcp is not None
        await until(  # the prefix has been read: a frame is in progress
            lambda: [(t.bytes_received, t.idle_since) for t in tcp.served()] == [(4, None)],
            step=0.001,
        )
        refused, refused_w = await _send_raw(h.listener.endpoint)
        assert await _closed_by_listener(refused)
        busy.write(frame[10:])
        verdicts = await h.until(1)
        await _close(busy)
        await _close(refused_w)
        stats = h.listener.telemetry()
    assert verdicts[0].accepted and stats.idle_closed == 0
    assert "refused a connection beyond 1" in (stats.last_error or "")


def test_idle_timeout_must_be_positive() -> None:
    with pytest.raises(DeltaConfigError, match="idle_timeout"):
        DweConfig(idle_timeout=0)


async def test_a_full_handler_queue_rejects_instead_of_stalling_every_connection() -> None:
    queue: asyncio.Queue[DweFragment] = asyncio.Queue(maxsize=1)
    record = Verdicts()
    async with DweListener(queue, on_verdict=record) as listener:
        _, writer = await _send_raw(listener.endpoint, encode_frame(_fragment(1)))
        _, other = await _send_raw(listener.endpoint, encode_frame(_fragment(2)))
        verdicts = await record.until(2)
        await _close(writer)
        await _close(other)
    assert sorted(v.accepted for v in verdicts) == [False, True]
    refused = next(v for v in verdicts if not v.accepted)
    assert refused.reason is RejectReason.HANDLER_ERROR and "queue is full" in refused.detail
    assert queue.qsize() == 1


async def test_an_async_handler_that_never_returns_is_given_up_on() -> None:
    never = asyncio.Event()
    calls: list[int] = []

    async def stuck(fragment: DweFragment) -> None:
        calls.append(fragment.sequence)
        if fragment.sequence == 1:
            await never.wait()  # the first one never finishes

    record = Verdicts()
    config = DweConfig(handler_timeout=0.2)
    async with DweListener(stuck, on_verdict=record, config=config) as listener:
        _, writer = await _send_raw(
            listener.endpoint, encode_frame(_fragment(1)), encode_frame(_fragment(2))
        )
        verdicts = await record.until(2, seconds=10)
        await _close(writer)
    assert [v.accepted for v in verdicts] == [False, True]
    assert "did not finish within 0.2 s" in verdicts[0].detail
    assert calls == [1, 2]
