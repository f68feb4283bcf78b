"""Where a simulation's workers run: local processes (here) or Ray actors (``ray_backend``).

A backend starts one worker per spec (``SimWorker`` specs), hands each worker its round
commands and returns their reports, and stops every worker in ``aclose``, also after a
failure. The process backend speaks JSON lines over each worker's stdin / stdout (no
pickle); its workers' stderr goes to ``OUT/worker-<i>.log``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Protocol, TypeVar

from tensorswap.simulate._env import sim_env
from tensorswap.simulate.errors import SimulationError

__all__ = ["READY_TIMEOUT_S", "Backend", "ProcessBackend", "gather_or_cancel", "make_backend"]

READY_TIMEOUT_S = 300.0  # registering thousands of clients on a loaded machine
STOP_TIMEOUT_S = 10.0
MAX_LINE = 1 << 20
T = TypeVar("T")


async def gather_or_cancel(aws: Iterable[Awaitable[T]]) -> list[T]:
    """Every result of ``aws``; on the first failure the others are cancelled (and awaited)
    before it is raised, so nothing is left running behind a failed step."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


class Backend(Protocol):
    async def start(self, specs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]: ...

    async def round(self, worker: int, cmd: Mapping[str, Any]) -> dict[str, Any]: ...

    def pids(self) -> list[int]: ...

    async def aclose(self) -> None: ...


class _Proc:
    def __init__(self, index: int, proc: asyncio.subprocess.Process, log: IO[bytes]) -> None:
        self.index, self.proc, self.log = index, proc, log
        self.lock = asyncio.Lock()


class ProcessBackend:
    """Workers as local processes: ``python -m tensorswap.simulate.worker``."""

    def __init__(self, out: Path, timeout_s: float) -> None:
        self.out = out
        self.timeout_s = timeout_s
        self.procs: list[_Proc] = []

    async def start(self, specs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        env = sim_env()
        for index in range(len(specs)):
            log = open(self.out / f"worker-{index}.log", "wb")  # noqa: SIM115 - closed in aclose
            try:
                proc = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "tensorswap.simulate.worker",
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=log,
                    env=env,
                    limit=MAX_LINE,
                )
            except BaseException:
                log.close()
                raise
            self.procs.append(_Proc(index, proc, log))
        return await gather_or_cancel(
            self._call(p, {"cmd": "start", "spec": dict(s)}, READY_TIMEOUT_S)
            for p, s in zip(self.procs, specs, strict=True)
        )

    async def round(self, worker: int, cmd: Mapping[str, Any]) -> dict[str, Any]:
        return await self._call(self.procs[worker], {"cmd": "round", **cmd}, self.timeout_s)

    def pids(self) -> list[int]:
        return [p.proc.pid for p in self.procs]

    async def _call(self, p: _Proc, cmd: Mapping[str, Any], timeout: float) -> dict[str, Any]:
        stdin, stdout = p.proc.stdin, p.proc.stdout
        assert stdin is not None and stdout is not None
        async with p.lock:
            try:
                stdin.write((json.dumps(cmd) + "\n").encode())
                await stdin.drain()
                line = await asyncio.wait_for(stdout.readline(), timeout)
            except ConnectionError as exc:  # its stdin is closed: it has exited
                raise SimulationError(f"worker {p.index} exited ({exc}); {self._tail(p)}") from None
            except ValueError as exc:  # an answer longer than MAX_LINE
                raise SimulationError(f"worker {p.index}: {exc}; {self._tail(p)}") from None
            except TimeoutError:
                raise SimulationError(
                    f"worker {p.index} gave no answer to {cmd.get('cmd')!r} in {timeout:g}s"
                ) from None
        if not line:
            raise SimulationError(f"worker {p.index} exited; {self._tail(p)}")
        try:
            answer = json.loads(line)
        except ValueError:
            raise SimulationError(f"worker {p.index} answered {line[:200]!r}") from None
        if not isinstance(answer, dict) or answer.get("event") == "error":
            message = answer.get("message") if isinstance(answer, dict) else answer
            raise SimulationError(f"worker {p.index}: {message}")
        return answer

    def _tail(self, p: _Proc) -> str:
        p.log.flush()
        path = self.out / f"worker-{p.index}.log"
        lines = path.read_text(errors="replace").strip().splitlines()[-3:]
        return "log: " + (" | ".join(lines) or "empty")

    async def aclose(self) -> None:
        """Ask each worker to stop (end of input), then SIGTERM, then SIGKILL; reap all."""
        for p in self.procs:
            stdin = p.proc.stdin
            if stdin is not None and not stdin.is_closing():
                with contextlib.suppress(Exception):
                    stdin.write(b'{"cmd": "stop"}\n')
                stdin.close()
        await asyncio.gather(*(_stop(p.proc) for p in self.procs))
        for p in self.procs:
            p.log.close()


async def _stop(proc: asyncio.subprocess.Process) -> None:
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        if proc.returncode is not None:
            break
        if sig is not None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(proc.wait()), STOP_TIMEOUT_S / 2)
    await proc.wait()


def make_backend(kind: str, out: Path, timeout_s: float, ray_address: str | None) -> Backend:
    if kind == "process":
        return ProcessBackend(out, timeout_s)
    from tensorswap.simulate.ray_backend import RayBackend

    return RayBackend(timeout_s, ray_address)
