"""The file-system pieces a DirectoryStore is made of: directory listings, shard names,
file identities, and syncing a directory or a whole file system."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from collections.abc import Callable

from tensorswap.errors import StoreError

__all__ = ["fsync_dir", "identity", "is_shard", "list_dir", "syncfs"]

_HEX = frozenset("0123456789abcdef")


def _find_syncfs() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).syncfs
    except (OSError, AttributeError):
        return None


syncfs = _find_syncfs()
"""Linux's syncfs(2) (flush one file system), where libc has it; else None."""


def identity(stat: os.stat_result) -> tuple[int, int, int, int]:
    """What must stay the same for a file to count as the one this store wrote. The status
    change time is in it because no process can set it back: a file written in place and
    given its old modification time again (``os.utime``) is no longer trusted."""
    return (stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)


def list_dir(path: str) -> list[os.DirEntry[str]]:
    """Entries of a directory, the scandir handle closed before returning (no ResourceWarning)."""
    try:
        with os.scandir(path) as it:
            return sorted(it, key=lambda e: e.name)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise StoreError(f"cannot list {path}: {exc}") from exc


def is_shard(entry: os.DirEntry[str]) -> bool:
    name = entry.name
    return len(name) == 2 and _HEX.issuperset(name) and entry.is_dir(follow_symlinks=False)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
