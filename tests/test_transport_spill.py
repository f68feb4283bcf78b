"""A connection's read-ahead buffer starts small and grows as reads fill it (bounded)."""

from __future__ import annotations

import asyncio

from tensorswap.transport._stream import _SPILL_BYTES, _SPILL_FIRST, _SPILL_READ, StreamProtocol


def test_the_read_ahead_starts_small_grows_when_full_and_keeps_its_bytes() -> None:
    protocol = StreamProtocol(tls=False)
    first = protocol.get_buffer(-1)
    assert first.nbytes == _SPILL_FIRST  # not 256 KiB for a connection's first small read
    sent = bytes(range(256)) * (_SPILL_FIRST // 256)
    first[:] = sent
    protocol.buffer_updated(len(sent))
    grown = protocol.get_buffer(-1)
    assert grown.nbytes == _SPILL_FIRST  # the room left after the bytes already held
    grown[:4] = b"more"
    protocol.buffer_updated(4)
    out = memoryview(bytearray(len(sent) + 4))
    assert protocol.take_buffered(out) == len(sent) + 4
    assert bytes(out) == sent + b"more"


def test_the_read_ahead_never_grows_past_its_bound() -> None:
    protocol = StreamProtocol(tls=False)
    total = 0
    while True:
        view = protocol.get_buffer(-1)
        if not view.nbytes:
            break
        protocol.buffer_updated(view.nbytes)
        total += view.nbytes
        if total >= _SPILL_BYTES:
            break
    assert total == _SPILL_BYTES


async def test_one_read_puts_at_most_a_small_window_into_the_read_ahead() -> None:
    # after a large read is filled the next frame's header comes through read-ahead; taking
    # the whole free buffer would copy up to 256 KiB of that frame's payload once more
    protocol = StreamProtocol(tls=False)
    total = 0
    while total < _SPILL_BYTES:  # grown to its bound, small messages piling up unread
        view = protocol.get_buffer(-1)
        assert 0 < view.nbytes <= _SPILL_READ
        protocol.buffer_updated(view.nbytes)
        total += view.nbytes
    out = memoryview(bytearray(total))
    assert protocol.take_buffered(out) == total  # drained: the whole buffer is free again
    assert protocol.get_buffer(-1).nbytes == _SPILL_READ < _SPILL_BYTES
    target = memoryview(bytearray(512 * 1024))
    reading = asyncio.ensure_future(protocol.receive_into(target))  # a large read waits
    await asyncio.sleep(0)
    assert protocol.get_buffer(-1).nbytes == target.nbytes  # straight into the reader's buffer
    protocol.buffer_updated(target.nbytes)
    assert await reading == target.nbytes
