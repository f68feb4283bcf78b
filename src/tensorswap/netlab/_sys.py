"""What the lab asks of the system: `ip` / `tc` commands, and threads inside a namespace."""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import os
import shutil
import subprocess
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from tensorswap.netlab.errors import LabCommandFailed, NamespacesUnavailable

__all__ = ["check_available", "enter_namespace", "in_namespace", "run", "start_in_namespace"]

T = TypeVar("T")

_CLONE_NEWNET = 0x40000000
_NETNS_DIR = "/run/netns"


def run(*argv: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """Run one command (no shell); LabCommandFailed when it exits non-zero and ``check``."""
    try:
        done = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LabCommandFailed(argv, -1, str(exc)) from exc
    if check and done.returncode != 0:
        raise LabCommandFailed(argv, done.returncode, done.stderr)
    return done


def check_available() -> None:
    """Raise NamespacesUnavailable unless this process can make network namespaces."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        raise NamespacesUnavailable("not running as root (network namespaces need CAP_SYS_ADMIN)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise NamespacesUnavailable(f"the `{tool}` command (iproute2) is not installed")


def _setns(name: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(os.path.join(_NETNS_DIR, name), os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


def enter_namespace(name: str) -> None:
    """Move the calling thread (only it) into the network namespace ``name``.

    Sockets it creates from then on, and threads it starts, live in that namespace.
    Only for threads the lab starts: never call it on a thread that must come back.
    """
    try:
        _setns(name)
    except OSError as exc:
        raise NamespacesUnavailable(f"cannot enter namespace {name}: {exc}") from exc


def in_namespace(name: str, fn: Callable[[], T]) -> T:
    """``fn()`` run in a fresh thread inside namespace ``name``; its result or its exception."""
    future = start_in_namespace(name, fn)
    return future.result()


def start_in_namespace(
    name: str, fn: Callable[[], T], *, thread_name: str | None = None
) -> concurrent.futures.Future[T]:
    """Start ``fn()`` in a fresh daemon thread inside namespace ``name``; a Future of it."""
    future: concurrent.futures.Future[T] = concurrent.futures.Future()

    def body() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            enter_namespace(name)
            result = fn()
        except BaseException as exc:  # handed to whoever waits on the future
            future.set_exception(exc)
        else:
            future.set_result(result)

    threading.Thread(target=body, name=thread_name or f"netns:{name}", daemon=True).start()
    return future


def run_coroutine(factory: Callable[[], Awaitable[T]]) -> Callable[[], T]:
    """A function that runs ``factory()`` to completion on an event loop of its own."""

    def body() -> T:
        async def main() -> T:
            return await factory()

        return asyncio.run(main())

    return body


def quiet(argv: Sequence[str]) -> None:
    """Run a teardown command, ignoring failure (what it removes may be gone already)."""
    run(*argv, check=False)
