"""An exclusive lock on a coordinator's data directory, held while one process serves it."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from types import TracebackType

from tensorswap.rounds.core.errors import DataDirInUse, RoundsError

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no lock (tensorswap serves on Linux)
    fcntl = None  # type: ignore[assignment]

__all__ = ["LOCK_FILENAME", "DataDirLock"]

LOCK_FILENAME = "serve.lock"
"""The lock file in a data directory; it holds the pid of the process that locked it."""


class DataDirLock:
    """``flock(LOCK_EX | LOCK_NB)`` on ``<data_dir>/serve.lock``, from ``acquire`` until
    ``release`` (or the process's end: the kernel drops a dead process's lock, so a server
    killed with SIGKILL never leaves a stale one). A second holder, in another process or
    this one (the lock belongs to the open file, not the process), gets DataDirInUse naming
    the directory and the holder's pid. The file is never deleted (deleting it would let two
    processes lock two different files). The directory is created if it is missing."""

    def __init__(self, data_dir: str | os.PathLike[str]) -> None:
        self.data_dir = Path(data_dir)
        self.path = self.data_dir / LOCK_FILENAME
        self._fd: int | None = None

    def acquire(self) -> DataDirLock:
        if self._fd is not None or fcntl is None:
            return self
        try:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise RoundsError(f"cannot open the lock {self.path}: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _pid_in(fd)
            os.close(fd)
            raise DataDirInUse(self.data_dir, self.path, pid) from None
        except OSError as exc:
            os.close(fd)
            raise RoundsError(f"cannot lock {self.path}: {exc}") from exc
        with contextlib.suppress(OSError):  # the pid is for the refusal's message only
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        """Drop the lock (idempotent)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the only descriptor of the open file releases the flock

    def __enter__(self) -> DataDirLock:
        return self.acquire()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


def _pid_in(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
