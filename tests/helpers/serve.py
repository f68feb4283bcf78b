"""`tensorswap serve` as a child process on a free loopback port, for end-to-end tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tensorswap.netlab.lab import read_line

KILL_SERVE = Path(__file__).with_name("kill_serve.py")

SECRET = "restart-test-secret"
"""The key every test server is started with."""


class Server:
    """A `tensorswap serve` child process on a free loopback port.

    ``listen`` and ``popen`` place it elsewhere: a network-lab host passes its address and
    ``Host.popen`` (the process then runs inside that host's namespace). With ``env``
    it runs ``kill_serve.py`` under those extra environment variables instead: a server that
    SIGKILLs itself at a chosen point (see that module).
    """

    def __init__(
        self,
        data: Path,
        *extra: str,
        listen: str = "127.0.0.1:0",
        popen: Callable[..., subprocess.Popen[Any]] = subprocess.Popen,
        env: dict[str, str] | None = None,
    ) -> None:
        program = ["-m", "tensorswap.cli.serve_cmd"] if env is None else [str(KILL_SERVE)]
        self.proc = popen(
            [
                sys.executable,
                *program,
                "--listen",
                listen,
                "--data",
                str(data),
                "--key",
                SECRET,
                "--log-level",
                "warning",
                *extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            **({} if env is None else {"env": {**os.environ, **env}}),
        )
        self.port = self._wait_listening(timeout=60.0)

    def _wait_listening(self, timeout: float) -> int:
        assert self.proc.stderr is not None
        seen = []
        while True:
            line = read_line(self.proc.stderr, time.monotonic() + timeout)
            if not line:
                code = self.proc.poll()
                self.kill()
                raise AssertionError(f"server exited ({code}) or was silent: {seen}")
            seen.append(line)
            if line.startswith("listening on "):
                return int(line.rsplit(":", 1)[1])

    def kill(self) -> None:
        """SIGKILL, then reap."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        if self.proc.stderr is not None:
            self.proc.stderr.close()

    def died(self, timeout: float = 60.0) -> int:
        """Wait for the process to end by itself (a ``kill_serve`` kill), reap, its code."""
        code = self.proc.wait(timeout=timeout)
        if self.proc.stderr is not None:
            self.proc.stderr.close()
        return code

    def stop(self) -> int:
        """SIGTERM, reap, the exit code."""
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=30)
        if self.proc.stderr is not None:
            self.proc.stderr.close()
        return code
