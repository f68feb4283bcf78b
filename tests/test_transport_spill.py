"""A connection's read-ahead buffer starts small and grows as reads fill it (bounded)."""

from __future__ import annotations

from tensorswap.transport._stream import _SPILL_BYTES, _SPILL_FIRST, StreamProtocol


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
