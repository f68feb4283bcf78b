"""`tensorswap serve` as a child process on a free loopback port, for end-to-end tests."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tensorswap.netlab.lab import read_line

SECRET = "restart-test-secret"
"""The key every test server is started with."""


class Server:
    """A `tensorswap serve` child process on a free loopback port.

    ``listen`` and ``popen`` place it elsewhere: a network-lab host passes its address and
    ``Host.popen`` (the process then runs inside that host's namespace).
    """

    def __init__(
        self,
        data: Path,
        *extra: str,
        listen: str = "127.0.0.1:0",
        popen: Callable[..., subprocess.Popen[Any]] = subprocess.Popen,
    ) -> None:
        self.proc = popen(
            [
                sys.executable,
                "-m",
                "tensorswap.cli.serve_cmd",
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

    def stop(self) -> int:
        """SIGTERM, reap, the exit code."""
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=30)
        if self.proc.stderr is not None:
            self.proc.stderr.close()
        return code
