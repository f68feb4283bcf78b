"""The processes of a demo run: the coordinator and the peers, their reports, their teardown."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import tensorswap
from tensorswap.demo.config import DemoError

__all__ = ["READY_TIMEOUT_S", "STOP_TIMEOUT_S", "Fleet", "Peer", "wait_ready"]

READY_TIMEOUT_S = 120.0  # imports of torch and scikit-learn on a loaded machine
STOP_TIMEOUT_S = 10.0
_LISTENING = re.compile(r"listening on (\S+):(\d+)")


def child_env() -> dict[str, str]:
    """The environment of the demo's processes: one thread each, tensorswap importable."""
    env = dict(os.environ)
    src = str(Path(tensorswap.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


@dataclass
class Peer:
    index: int
    proc: asyncio.subprocess.Process
    log: IO[bytes]
    reader: asyncio.Task[None] | None = None
    alive: bool = True
    ready: dict[str, Any] | None = None

    @property
    def name(self) -> str:
        return f"peer-{self.index}"


class Fleet:
    """The processes of one demo run; ``aclose`` stops and reaps every one of them."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.events: asyncio.Queue[tuple[int, dict[str, Any]]] = asyncio.Queue()
        self.peers: list[Peer] = []
        self.coordinator: asyncio.subprocess.Process | None = None
        self._coord_log: IO[bytes] | None = None
        self.env = child_env()

    # coordinator
    async def start_coordinator(
        self,
        data: Path,
        *,
        listen: str = "127.0.0.1:0",
        wrap: Sequence[str] = (),
        extra: Sequence[str] = (),
    ) -> tuple[str, int]:
        """`tensorswap serve` on ``listen``, its argv after ``wrap`` (e.g. `ip netns exec NS`),
        with ``extra`` options."""
        log_path = self.out / "coordinator.log"
        self._coord_log = open(log_path, "wb")  # noqa: SIM115 - closed in aclose
        self.coordinator = await asyncio.create_subprocess_exec(
            *wrap,
            sys.executable,
            "-m",
            "tensorswap.cli.serve_cmd",
            "--listen",
            listen,
            "--data",
            str(data),
            "--fast-commit",
            "--timeout",
            "120",
            *extra,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=self._coord_log,
            stderr=self._coord_log,
            env=self.env,
        )
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            text = log_path.read_text(errors="replace")
            if match := _LISTENING.search(text):
                return match.group(1), int(match.group(2))
            if self.coordinator.returncode is not None:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.coordinator.wait(), 0.05)
        tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
        raise DemoError("the coordinator did not start: " + (" | ".join(tail) or "no output"))

    # peers
    async def start_peer(self, index: int, args: list[str], wrap: Sequence[str] = ()) -> Peer:
        log = open(self.out / f"peer-{index}.log", "wb")  # noqa: SIM115 - closed in aclose
        proc = await asyncio.create_subprocess_exec(
            *wrap,
            sys.executable,
            "-m",
            "tensorswap.demo.peer",
            "--index",
            str(index),
            *args,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=log,
            env=self.env,
        )
        peer = Peer(index, proc, log)
        peer.reader = asyncio.create_task(self._read(peer))
        self.peers.append(peer)
        return peer

    async def _read(self, peer: Peer) -> None:
        stream = peer.proc.stdout
        assert stream is not None
        while line := await stream.readline():
            try:
                event = json.loads(line)
            except ValueError:
                continue  # not a report (a library printing to stdout): ignore
            if isinstance(event, dict):
                await self.events.put((peer.index, event))
        await self.events.put((peer.index, {"event": "exit"}))

    async def send(self, peer: Peer, command: Mapping[str, Any]) -> None:
        stdin = peer.proc.stdin
        if stdin is None or stdin.is_closing() or not peer.alive:
            return
        stdin.write((json.dumps(command) + "\n").encode())
        with contextlib.suppress(ConnectionError):
            await stdin.drain()

    async def kill(self, peer: Peer) -> None:
        peer.alive = False
        if peer.proc.returncode is None:
            peer.proc.kill()
        await peer.proc.wait()

    # teardown
    async def aclose(self) -> None:
        """Ask every peer to stop (end of input), then terminate, then kill; reap all."""
        for peer in self.peers:
            stdin = peer.proc.stdin
            if stdin is not None and not stdin.is_closing():
                stdin.close()
        await asyncio.gather(*(self._stop(p.proc, gentle=True) for p in self.peers))
        for peer in self.peers:
            if peer.reader is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(peer.reader, STOP_TIMEOUT_S)
            if peer.proc.stdin is not None:
                with contextlib.suppress(ConnectionError):
                    await peer.proc.stdin.wait_closed()
            peer.log.close()
        if self.coordinator is not None:
            await self._stop(self.coordinator, gentle=False)
        if self._coord_log is not None:
            self._coord_log.close()

    @staticmethod
    async def _stop(proc: asyncio.subprocess.Process, *, gentle: bool) -> None:
        if proc.returncode is None and gentle:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(proc.wait()), STOP_TIMEOUT_S / 2)
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(proc.wait()), STOP_TIMEOUT_S)
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        await proc.wait()


async def wait_ready(fleet: Fleet) -> None:
    """Until every peer has reported ``ready`` (kept on its `Peer`); DemoError when one fails."""
    waiting = {p.index for p in fleet.peers}
    deadline = time.monotonic() + READY_TIMEOUT_S
    while waiting:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            names = ", ".join(f"peer-{i}" for i in sorted(waiting))
            raise DemoError(f"peers not ready after {READY_TIMEOUT_S:.0f}s: {names}")
        try:
            index, event = await asyncio.wait_for(fleet.events.get(), remaining)
        except TimeoutError:
            continue
        kind = event.get("event")
        if kind == "ready":
            fleet.peers[index].ready = event
            waiting.discard(index)
        elif kind == "error":
            raise DemoError(str(event.get("message")))
        elif kind == "exit":
            log = fleet.out / f"peer-{index}.log"
            tail = log.read_text(errors="replace").strip().splitlines()[-3:]
            raise DemoError(f"peer-{index} exited before it was ready: " + " | ".join(tail))
