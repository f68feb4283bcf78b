"""Real Flower processes for the deployment test: a SuperLink, SuperNodes and ``tensorswap
serve``, each in a session of its own on 127.0.0.1 (free ports), logs under a folder; every
process group is ended on ``close()``, also when the test fails."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

FLOWER_BIN = Path(sys.executable).parent
"""Where the running interpreter's venv keeps flower-superlink, flower-supernode, flwr."""
SRC = Path(__file__).resolve().parents[2] / "src"
HERE = Path(__file__).resolve().parent


class ProcessFailed(RuntimeError):
    """A process exited, or did not get ready in time; its log's tail is in the message."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def environment(flwr_home: Path) -> dict[str, str]:
    """The worktree's tensorswap and tests/flower's ``apps`` importable, Flower's scripts on
    PATH (the SuperLink and SuperNodes start flower-superexec, flwr-serverapp, flwr-clientapp
    by name), Flower's state under ``flwr_home``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), str(HERE)])
    env["PATH"] = os.pathsep.join([str(FLOWER_BIN), env.get("PATH", "")])
    env["FLWR_HOME"] = str(flwr_home)
    env["RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO"] = "0"
    return env


class Processes:
    """Started processes by name, each logging to ``logs/NAME.log``."""

    def __init__(self, logs: Path, env: dict[str, str]) -> None:
        self.logs = logs
        self.env = env
        self.started: dict[str, subprocess.Popen[bytes]] = {}
        logs.mkdir(parents=True, exist_ok=True)

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def start(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        with (self.logs / f"{name}.log").open("wb") as out:
            process = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,  # its children (superexec, the apps) in its group
            )
        self.started[name] = process
        return process

    def wait_for(self, name: str, pattern: str, timeout: float = 60.0) -> re.Match[str]:
        """Poll ``name``'s log until ``pattern`` matches (bounded: ``timeout`` s)."""
        deadline = time.monotonic() + timeout
        process = self.started[name]
        while time.monotonic() < deadline:
            found = re.search(pattern, self.log(name))
            if found:
                return found
            if process.poll() is not None:
                raise ProcessFailed(f"{name} exited ({process.returncode}):\n{self.tail(name)}")
            time.sleep(0.1)  # a readiness poll: the log is checked again, bounded by deadline
        raise ProcessFailed(f"{name}: no {pattern!r} in {timeout} s:\n{self.tail(name)}")

    def tail(self, name: str, lines: int = 30) -> str:
        return "\n".join(self.log(name).splitlines()[-lines:])

    def close(self) -> None:
        """SIGTERM to every started process group, SIGKILL to those still there after 10 s."""
        for process in self.started.values():
            _signal_group(process, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for process in self.started.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            _signal_group(process, signal.SIGKILL)  # the group's stragglers (superexec)
            process.wait(timeout=10)


def _signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, sig)
