"""A delay relay: a TCP forwarder that holds each direction's bytes for RTT/2 (no netem here).

Every accepted connection is forwarded to one target. Each direction is a pipe: bytes read
from one side are written to the other ``delay`` seconds later, and at most ``cap`` bytes
(rate x delay: what a link of that rate holds in flight) are inside the pipe at once; past
that the relay stops reading, so TCP backpressure reaches the sender as it would on a long
link. Run as a process inside a lab host::

    python -m tensorswap.netlab.relay --listen 198.18.0.9:0 --target 198.18.0.1:7000 \\
        --delay 0.02 --cap 125000

It prints ``listening on HOST:PORT`` to stderr once ready and runs until SIGTERM / SIGKILL.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import time
from collections import deque

__all__ = ["DelayPipe", "main", "serve"]

_READ = 64 * 1024


class DelayPipe:
    """One direction: what is read at t is written at t + ``delay``; ``cap`` bytes at most held."""

    def __init__(self, delay: float, cap: int) -> None:
        if delay < 0 or cap < 1:
            raise ValueError(f"delay must be >= 0 and cap >= 1, got {delay}, {cap}")
        self.delay = delay
        self.cap = cap
        self.held = 0
        self._queue: deque[tuple[float, bytes]] = deque()
        self._changed = asyncio.Condition()

    async def room(self) -> int:
        """Wait until the pipe has room; how many bytes it takes now (``cap`` - held)."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.held < self.cap)
            return self.cap - self.held

    async def put(self, data: bytes) -> None:
        """Hold ``data`` (b"" marks the end); waits while it does not fit.

        A read sized by ``room`` always fits, so the pipe fills up to ``cap`` exactly:
        reads of a fixed size would leave up to one read's worth of it unused (and the
        relay slower than rate x delay / delay).
        """
        async with self._changed:
            await self._changed.wait_for(lambda: self._fits(len(data)))
            self._queue.append((time.monotonic() + self.delay, data))
            self.held += len(data)
            self._changed.notify_all()

    def _fits(self, n: int) -> bool:
        return self.held == 0 or self.held + n <= self.cap

    async def get(self) -> bytes:
        """The oldest held bytes once they are due (b"": the end)."""
        async with self._changed:
            await self._changed.wait_for(lambda: bool(self._queue))
            due, data = self._queue[0]
        wait = due - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        async with self._changed:
            self._queue.popleft()
            self.held -= len(data)
            self._changed.notify_all()
        return data


async def _read_side(reader: asyncio.StreamReader, pipe: DelayPipe) -> None:
    try:
        while data := await reader.read(min(_READ, await pipe.room())):
            await pipe.put(data)
    finally:
        await pipe.put(b"")


async def _write_side(writer: asyncio.StreamWriter, pipe: DelayPipe) -> None:
    while data := await pipe.get():
        writer.write(data)
        await writer.drain()
    if writer.can_write_eof():
        writer.write_eof()


async def _direction(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float, cap: int
) -> None:
    pipe = DelayPipe(delay, cap)
    async with asyncio.TaskGroup() as group:
        group.create_task(_read_side(reader, pipe))
        group.create_task(_write_side(writer, pipe))


async def _forward(
    client_r: asyncio.StreamReader,
    client_w: asyncio.StreamWriter,
    target: tuple[str, int],
    delay: float,
    cap: int,
) -> None:
    try:
        up_r, up_w = await asyncio.open_connection(*target)
    except OSError:
        client_w.transport.abort()
        return
    try:
        async with asyncio.TaskGroup() as group:
            group.create_task(_direction(client_r, up_w, delay, cap))
            group.create_task(_direction(up_r, client_w, delay, cap))
    except* (OSError, asyncio.IncompleteReadError):
        pass  # one side broke: both are closed below, as a cut cable would leave them
    finally:
        for writer in (up_w, client_w):
            writer.transport.abort()


async def serve(listen: tuple[str, int], target: tuple[str, int], delay: float, cap: int) -> None:
    """Relay connections on ``listen`` to ``target`` until cancelled or signalled."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _forward(reader, writer, target, delay, cap)

    server = await asyncio.start_server(handle, *listen)
    async with server:
        host, port = server.sockets[0].getsockname()[:2]
        print(f"listening on {host}:{port}", file=sys.stderr, flush=True)
        await stop.wait()


def _host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tensorswap.netlab.relay")
    parser.add_argument("--listen", type=_host_port, required=True)
    parser.add_argument("--target", type=_host_port, required=True)
    parser.add_argument("--delay", type=float, required=True, help="seconds, each direction")
    parser.add_argument("--cap", type=int, required=True, help="bytes in flight per direction")
    args = parser.parse_args(argv)
    asyncio.run(serve(args.listen, args.target, args.delay, args.cap))


if __name__ == "__main__":
    main()
