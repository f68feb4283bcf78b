"""The simulation's coordinator: a real ``tensorswap serve`` process, as the demo starts one."""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import IO

from tensorswap.simulate._env import sim_env
from tensorswap.simulate.errors import SimulationError

__all__ = ["Coordinator"]

READY_TIMEOUT_S = 120.0
GC_GRACE_S = 0.25
"""Seconds an unreferenced block is spared after it was stored or offered (``--gc-grace``)."""
MARKER = ".tensorswap-simulate"
"""Marks a directory a simulation's coordinator used: only such a directory is emptied."""
_LISTENING = re.compile(r"listening on (\S+):(\d+)")


class Coordinator:
    """``tensorswap serve`` on ``listen`` with its data in ``data`` (default
    ``out/coordinator``; emptied first, when empty or a simulation's: each simulation starts
    from nothing), its log in
    ``out/coordinator.log``. Clients registered for runs stay active the whole simulation
    (virtual clients are idle for many rounds)."""

    def __init__(
        self,
        out: Path,
        listen: str = "127.0.0.1:0",
        data: Path | None = None,
        keep_rounds: int = 1,
    ) -> None:
        self.out = out
        self.listen = listen
        self.keep_rounds = keep_rounds
        self.data = data if data is not None else out / "coordinator"
        self.proc: asyncio.subprocess.Process | None = None
        self._log: IO[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    async def start(self) -> tuple[str, int]:
        """Start it; where it listens (host, port)."""
        data = self.data
        if data.exists():  # a fresh coordinator each simulation: no run, rounds, blocks
            if any(data.iterdir()) and not (data / MARKER).exists():
                raise SimulationError(
                    f"{data} holds files of something else than a simulation; not emptying it"
                )
            await asyncio.to_thread(shutil.rmtree, data)
        data.mkdir(parents=True)
        (data / MARKER).write_text("the data of a `tensorswap simulate` coordinator\n")
        log_path = self.out / "coordinator.log"
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in aclose
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tensorswap.cli.serve_cmd",
            "--listen",
            self.listen,
            "--data",
            str(data),
            "--fast-commit",
            "--timeout",
            "300",
            "--max-wait",
            "60",
            "--inactive-after",
            "86400",
            *self._retention(),
            "--log-level",
            "warning",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=self._log,
            stderr=self._log,
            env=sim_env(),
        )
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            text = log_path.read_text(errors="replace")
            if match := _LISTENING.search(text):
                return match.group(1), int(match.group(2))
            if self.proc.returncode is not None:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.proc.wait(), 0.05)
        tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
        raise SimulationError("the coordinator did not start: " + (" | ".join(tail) or "no output"))

    def _retention(self) -> list[str]:
        """A simulation runs its rounds one after another, and the driver reads each version
        before the next round's work starts: once a round is stepped, its contributions and
        the model before are of no use, so they go (a new block's page-cache pages then
        reuse freed ones, not fresh memory) after a short grace for updates pushed and not
        yet submitted (the clients push again what a submit finds gone)."""
        if self.keep_rounds == 0:
            return []
        return ["--keep-rounds", str(self.keep_rounds), "--gc-grace", str(GC_GRACE_S)]

    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def aclose(self) -> None:
        """SIGTERM (a clean stop), then SIGKILL; reaped."""
        proc = self.proc
        if proc is not None:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                if proc.returncode is not None:
                    break
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(sig)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(proc.wait()), 10.0)
            await proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
