"""Flow throughput: Spikes batches of 64 events over ipc:// PUB/SUB, against raw pyzmq.

Each round sends N batches (a pool of 256 distinct batches, cycled) twice through a PUB socket
in this process to a SUB socket in a child process: once as pre-encoded bytes with raw pyzmq (the
baseline), once through ``Publisher.send`` / ``Subscriber.recv`` (validate, encode, send;
receive, decode, validate).
Throughput is counted at the subscriber, first to last message. The figure of merit is the
flow rate as a ratio of the raw rate measured in the same run; the goal is >= 0.5x.

    python benchmarks/bench_flow.py [--messages N] [--rounds R] [--quick]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import statistics
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path

import zmq

from tensorswap.flow import (
    Ping,
    Publisher,
    SpikeBatch,
    SpikeEvent,
    Subscriber,
    TransportConfig,
    decode,
    encode,
    f32,
)

EVENTS = 64
POOL = 256
GOAL = 0.5
_WARMUP = b"warmup"


def make_batches(count: int, seed: int = 7) -> list[SpikeBatch]:
    """``count`` distinct Spikes batches of 64 events with f32 strengths."""
    rng = random.Random(seed)
    return [
        SpikeBatch(
            session_id="bench",
            batch_id=i,
            timestamp=1_700_000_000_000 + i,
            spikes=[
                SpikeEvent(
                    channel=rng.randrange(1 << 16),
                    time=rng.randrange(1 << 20),
                    strength=f32(rng.random()),
                )
                for _ in range(EVENTS)
            ],
        )
        for i in range(count)
    ]


def _options(endpoint: str) -> TransportConfig:
    # No high-water marks, so nothing is dropped; the queue absorbs a faster sender.
    return TransportConfig(endpoint, send_hwm=0, receive_hwm=0, linger_ms=0)


def _receive_raw(endpoint: str, count: int, conn: Connection) -> None:
    context = zmq.Context()
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.RCVHWM, 0)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    socket.connect(endpoint)
    synced = False
    while True:
        frame = socket.recv()
        if frame != _WARMUP:
            break
        if not synced:
            conn.send("synced")
            synced = True
    start = time.perf_counter()
    for _ in range(count - 1):
        socket.recv()
    conn.send(time.perf_counter() - start)
    socket.close()
    context.term()


def _receive_flow(endpoint: str, count: int, conn: Connection) -> None:
    subscriber = Subscriber.connect(_options(endpoint))
    synced = False
    while True:
        message = subscriber.recv()
        if not isinstance(message, Ping):
            break
        if not synced:
            conn.send("synced")
            synced = True
    start = time.perf_counter()
    for _ in range(count - 1):
        subscriber.recv()
    conn.send(time.perf_counter() - start)
    subscriber.close()


def _sync(conn: Connection, send_warmup: object) -> None:
    """Publish warm-up frames until the subscriber has seen one (the slow-joiner problem)."""
    deadline = time.monotonic() + 30
    while not conn.poll(0.001):
        if time.monotonic() > deadline:
            raise TimeoutError("the subscriber never received a warm-up message")
        send_warmup()  # type: ignore[operator]
    if conn.recv() != "synced":
        raise RuntimeError("unexpected reply from the subscriber")


def _run(mode: str, endpoint: str, batches: list[SpikeBatch], frames: list[bytes]) -> float:
    """Messages per second for one pass of ``mode`` ('raw' or 'flow')."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    target = _receive_raw if mode == "raw" else _receive_flow
    process = ctx.Process(target=target, args=(endpoint, len(batches), child))
    if mode == "raw":
        context = zmq.Context()
        socket = context.socket(zmq.PUB)
        socket.setsockopt(zmq.SNDHWM, 0)
        socket.setsockopt(zmq.LINGER, 0)
        socket.bind(endpoint)
        process.start()
        try:
            _sync(parent, lambda: socket.send(_WARMUP))
            for frame in frames:
                socket.send(frame)
            elapsed = parent.recv()
        finally:
            process.join()
            socket.close()
            context.term()
    else:
        with Publisher.bind(_options(endpoint)) as publisher:
            process.start()
            try:
                _sync(parent, lambda: publisher.send(Ping()))
                for batch in batches:
                    publisher.send(batch)
                elapsed = parent.recv()
            finally:
                process.join()
    return (len(batches) - 1) / elapsed


def _per_message(batches: list[SpikeBatch], frames: list[bytes]) -> tuple[float, float]:
    """In-process microseconds per message to encode (with validation) and to decode."""
    start = time.perf_counter()
    for batch in batches:
        encode(batch)
    encode_us = (time.perf_counter() - start) / len(batches) * 1e6
    start = time.perf_counter()
    for frame in frames:
        decode(frame)
    decode_us = (time.perf_counter() - start) / len(frames) * 1e6
    return encode_us, decode_us


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="2,000 messages, 1 round")
    args = parser.parse_args(argv)
    count, rounds = (2_000, 1) if args.quick else (args.messages, args.rounds)

    pool = make_batches(min(POOL, count))
    batches = [pool[i % len(pool)] for i in range(count)]
    frames = [encode(batch) for batch in batches]
    encode_us, decode_us = _per_message(batches, frames)
    raw_rates, flow_rates = [], []
    with tempfile.TemporaryDirectory(prefix="tensorswap-bench-") as tmp:
        endpoint = f"ipc://{Path(tmp) / 'flow.ipc'}"
        for _ in range(rounds):
            raw_rates.append(_run("raw", endpoint, batches, frames))
            flow_rates.append(_run("flow", endpoint, batches, frames))
    raw, flow = statistics.median(raw_rates), statistics.median(flow_rates)
    ratio = flow / raw
    size = statistics.mean(len(frame) for frame in frames)
    print(f"flow: Spikes batches of {EVENTS} events ({size:,.0f} B canonical JSON), ipc:// PUB/SUB")
    print(f"  {count:,} messages x {rounds} round(s), medians")
    print(f"  encode+validate {encode_us:8.1f} us/msg   decode+validate {decode_us:8.1f} us/msg")
    print(f"  raw pyzmq, same bytes  {raw:10,.0f} msg/s")
    print(f"  flow Publisher/Sub     {flow:10,.0f} msg/s")
    verdict = "meets" if ratio >= GOAL else "misses"
    print(f"  ratio                  {ratio:10.2f}x  ({verdict} the >= {GOAL}x goal)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
