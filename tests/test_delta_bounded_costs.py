"""Hostile input to the delta layer: what it costs stays about the size of what a peer sent."""

from __future__ import annotations

import asyncio
import socket
import struct

import numpy as np
import pytest

from helpers.memory import peak_of, traced
from tensorswap.delta import DweConfig, DweListener, reassemble, split_fragment
from tensorswap.delta.apply import StateMismatch, apply_fragment
from tensorswap.delta.bincode import (
    MAX_DWE_FRAGMENT_BYTES,
    MAX_DWE_LAYERS,
    MalformedFragment,
    decode_fragment,
    decode_fragment_signed,
    encode_frame,
)
from tensorswap.delta.config import DeltaConfigError
from tensorswap.delta.fragment import (
    DWE_SCHEMA,
    SLICE_SCHEMA,
    DweFragment,
    DweLayerDelta,
    compute_state_hash,
    make_fragment,
)
from tensorswap.delta.listener import Verdict
from tensorswap.delta.verify import (
    FleetKeys,
    FragmentRejected,
    FragmentVerifier,
    RejectReason,
    SequenceRejected,
    SequenceTracker,
)


# ── delta: a fragment of many empty layers ───────────────────────────────────────────────────
def _empty_layers_frame(count: int) -> bytes:
    def text(raw: bytes) -> bytes:
        return struct.pack("<Q", len(raw)) + raw

    head = text(b"axiom.dwe.v1") + text(b"s") + struct.pack("<QQ", 1, count)
    return head + struct.pack("<QQQ", 0, 0, 0) * count + text(b"0" * 64)


def test_a_fragment_of_many_empty_layers_is_refused_before_decoding_them() -> None:
    # 8 MiB of 24-byte empty layers used to become 349,520 layer objects: 140 MB, 2-3 s.
    body = _empty_layers_frame((MAX_DWE_FRAGMENT_BYTES - 120) // 24)
    error, peak = peak_of(decode_fragment_signed, body)
    assert isinstance(error, MalformedFragment), error
    assert "more than the 4096 allowed" in str(error)
    assert peak < 1 << 20
    assert len(decode_fragment(_empty_layers_frame(MAX_DWE_LAYERS)).layers) == MAX_DWE_LAYERS
    with pytest.raises(MalformedFragment):
        decode_fragment(_empty_layers_frame(11), max_layers=10)


async def test_the_listener_refuses_too_many_layers_and_serves_the_next_frame() -> None:
    verdicts: list[Verdict] = []
    got = asyncio.Event()

    def on_verdict(verdict: Verdict) -> None:
        verdicts.append(verdict)
        if len(verdicts) == 2:
            got.set()

    config = DweConfig(max_layers=3)
    async with DweListener(lambda f: None, config=config, on_verdict=on_verdict) as listener:
        assert listener.endpoint is not None
        _, writer = await asyncio.open_connection("127.0.0.1", listener.endpoint.port)
        try:
            body = _empty_layers_frame(4)
            good = make_fragment("s", 2, [DweLayerDelta(0, (1,), np.ones(1, np.float32))])
            writer.write(struct.pack("<I", len(body)) + body)
            writer.write(bytes(encode_frame(good)))
            await writer.drain()
            await got.wait()
        finally:
            writer.close()
            await writer.wait_closed()
    assert [v.reason for v in verdicts] == [RejectReason.MALFORMED, None]


def test_split_never_packs_more_layers_than_a_listener_decodes() -> None:
    layers = [DweLayerDelta(i, (1,), np.full(1, i, np.float32)) for i in range(10)]
    fragment = make_fragment("s", 5, layers)
    parts = split_fragment(fragment, max_layers=4)
    assert [len(p.layers) for p in parts] == [4, 4, 2]
    assert [p.sequence for p in parts] == [5, 6, 7]
    assert reassemble(parts) == fragment
    assert split_fragment(fragment) == [fragment]
    with pytest.raises(DeltaConfigError):
        DweConfig(max_layers=0)


# ── delta: entries that add to the same values twice ─────────────────────────────────────────
def _twice(schema: str) -> tuple[list[np.ndarray], DweFragment]:
    big = np.full(3, 60_000, np.float32)
    if schema == SLICE_SCHEMA:  # [0, 3) and [1, 4) of one layer of 4 values
        entries = [DweLayerDelta(0, (4, 0), big), DweLayerDelta(0, (4, 1), big)]
        return [np.zeros(4, np.float16)], make_fragment("s", 1, entries, schema=schema)
    entries = [DweLayerDelta(0, (3,), big), DweLayerDelta(0, (3,), big)]
    return [np.zeros(3, np.float16)], make_fragment("s", 1, entries, schema=schema)


@pytest.mark.parametrize("schema", [DWE_SCHEMA, SLICE_SCHEMA])
def test_two_entries_on_the_same_values_are_refused_before_any_addition(schema: str) -> None:
    # Each entry's overflow check saw the state before the other: 60,000 + 60,000 in float16
    # passed and the verified fragment turned the state into inf.
    states, fragment = _twice(schema)
    FragmentVerifier().verify(fragment)
    with pytest.raises(StateMismatch, match="same values"):
        apply_fragment(states, fragment)
    assert not states[0].any()


def test_disjoint_slices_of_one_layer_in_one_fragment_still_apply() -> None:
    entries = [
        DweLayerDelta(0, (4, 2), np.ones(2, np.float32)),
        DweLayerDelta(0, (4, 2), np.zeros(0, np.float32)),
        DweLayerDelta(0, (4, 0), np.full(2, 2, np.float32)),
    ]
    states = [np.zeros(4, np.float32)]
    assert apply_fragment(states, make_fragment("s", 1, entries, schema=SLICE_SCHEMA)) == 3
    assert states[0].tolist() == [2, 2, 1, 1]


# ── delta: a peer's long strings are quoted short ────────────────────────────────────────────
async def test_long_schema_and_session_strings_are_quoted_short() -> None:
    # repr() of 4 MiB of NUL bytes is 16 MiB: it went into the verdict, the exception and
    # telemetry's last_error (kept until the next error).
    huge = "\x00" * (4 << 20)
    odd = DweFragment(huge, huge, 1, (), compute_state_hash(()))
    weird = make_fragment(huge, 1, [])
    with pytest.raises(FragmentRejected) as info:
        FragmentVerifier().check_integrity(odd)
    assert len(str(info.value)) < 2000
    assert "4194304 characters" in str(info.value)
    with pytest.raises(FragmentRejected) as info:  # hmac_missing names the session
        FragmentVerifier(keys=FleetKeys(b"k")).check_integrity(weird)
    assert len(str(info.value)) < 2000

    verdicts: list[Verdict] = []
    got = asyncio.Event()

    def on_verdict(verdict: Verdict) -> None:
        verdicts.append(verdict)
        got.set()

    config = DweConfig(max_fragment_bytes=16 << 20)
    async with DweListener(lambda f: None, config=config, on_verdict=on_verdict) as listener:
        assert listener.endpoint is not None
        _, writer = await asyncio.open_connection("127.0.0.1", listener.endpoint.port)
        try:
            writer.write(bytes(encode_frame(odd, max_bytes=16 << 20)))
            await writer.drain()
            await got.wait()
        finally:
            writer.close()
            await writer.wait_closed()
        error = listener.telemetry().last_error
    assert verdicts[0].reason is RejectReason.UNKNOWN_SCHEMA
    assert len(verdicts[0].detail) < 2000
    assert len(verdicts[0].describe()) < 2000
    assert error is not None and len(error) < 2000


# ── delta: what the sequence tracker keeps per session ───────────────────────────────────────
def test_the_tracker_keeps_a_digest_of_long_session_ids() -> None:
    # Up to 65,536 sessions are remembered: with 8 MiB session ids, each accepted fragment
    # used to keep its 8 MiB alive (512 GiB at the cap), long after the frame was gone.
    tracker = SequenceTracker(max_sessions=4)
    long_id = "s" * (1 << 20)
    with traced() as memory:
        for i in range(4):
            tracker.commit(long_id + str(i), 5)
    assert (
        memory.current < 1 << 16
    )  # the digests, not the 4 MiB of ids built in the loop and dropped
    assert tracker.last(long_id + "0") == 5
    assert tracker.last(long_id + "9") is None
    with pytest.raises(SequenceRejected):
        tracker.check(long_id + "1", 5)
    assert tracker.check(long_id + "1", 7) == 1
    tracker.commit("short", 1)  # a fifth session evicts the oldest
    assert tracker.last(long_id + "0") is None
    assert tracker.last("short") == 1


def test_a_layer_with_more_dims_than_any_state_is_refused_before_decoding_them() -> None:
    # 1,000,000 dims (7.6 MiB) decoded into a tuple of Python ints: 45 MB, kept with the
    # fragment, for a shape no numpy array or torch tensor can have.
    def frame(ndim: int) -> bytes:
        def text(raw: bytes) -> bytes:
            return struct.pack("<Q", len(raw)) + raw

        head = text(b"axiom.dwe.v1") + text(b"s") + struct.pack("<QQQQ", 1, 1, 0, ndim)
        return head + struct.pack("<Q", 1) * ndim + struct.pack("<Q", 0) + text(b"0" * 64)

    error, peak = peak_of(decode_fragment_signed, frame(1_000_000))
    assert isinstance(error, MalformedFragment), error
    assert "more than the 65 allowed" in str(error)
    assert peak < 1 << 20
    assert decode_fragment(frame(65)).layers[0].shape == (1,) * 65


# ── delta: a flood of tiny frames on one connection ──────────────────────────────────────────
async def test_a_flood_of_tiny_frames_does_not_hold_the_listener_for_everyone() -> None:
    # Frames already buffered are read without waiting, so one connection's 60,000 empty
    # frames kept the event loop (2.3 s) and every other connection waited behind them.
    flood = 20_000
    order: list[str] = []
    done = asyncio.Event()
    other: list[socket.socket] = []
    good = make_fragment("s", 1, [DweLayerDelta(0, (1,), np.ones(1, np.float32))])

    def on_verdict(verdict: Verdict) -> None:
        order.append("good" if verdict.accepted else "flood")
        if len(order) == 1:  # the flood is being read: the other peer's frame is sent now
            assert listener.endpoint is not None
            peer = socket.create_connection(("127.0.0.1", listener.endpoint.port))
            other.append(peer)
            peer.sendall(bytes(encode_frame(good)))
        if len(order) == flood + 1:
            done.set()

    async with DweListener(lambda f: None, on_verdict=on_verdict) as listener:
        assert listener.endpoint is not None
        _, writer = await asyncio.open_connection("127.0.0.1", listener.endpoint.port)
        try:
            writer.write(struct.pack("<I", 0) * flood)
            await writer.drain()
            await done.wait()
        finally:
            writer.close()
            await writer.wait_closed()
            for peer in other:
                peer.close()
    assert order.count("good") == 1
    assert order.index("good") < flood  # served while the flood was still being read
