"""Peak memory of a whole simulation: the summed RSS of a process and all its descendants.

Sampled from ``/proc`` (Linux) by a thread every ``interval`` seconds; the coordinator, the
worker processes and, with a local Ray instance, Ray's own processes (GCS, raylet, actors)
are all descendants of the driver, so one sampler covers them. The benchmark measures
tensorswap's and Flower's simulations with the same sampler, from outside.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

__all__ = ["PeakMemory", "descendants", "rss_bytes", "tree_rss"]

_PROC = Path("/proc")


def rss_bytes(pid: int) -> int:
    """The resident set size of ``pid`` in bytes (0 when it is gone or unreadable)."""
    try:
        with open(_PROC / str(pid) / "status", "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _parents() -> dict[int, int]:
    out: dict[int, int] = {}
    try:
        entries = os.listdir(_PROC)
    except OSError:
        return out
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            stat = (_PROC / entry / "stat").read_bytes()
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses
            out[int(entry)] = int(stat[stat.rindex(b")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return out


def descendants(root: int) -> list[int]:
    """``root`` and every process below it."""
    children: dict[int, list[int]] = {}
    for pid, ppid in _parents().items():
        children.setdefault(ppid, []).append(pid)
    found, todo = [root], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def tree_rss(root: int, extra: tuple[int, ...] = ()) -> tuple[int, int]:
    """The summed RSS of ``root``'s process tree (and of ``extra`` pids not in it), and how
    many processes that is."""
    pids = set(descendants(root)) | set(extra)
    sizes = [rss_bytes(pid) for pid in pids]
    return sum(sizes), sum(1 for s in sizes if s)


class PeakMemory:
    """The peak of ``tree_rss(root)`` while it runs, and the most processes its tree had
    (a daemon thread; ``stop`` ends it)."""

    def __init__(self, root: int | None = None, interval: float = 0.1) -> None:
        self.root = os.getpid() if root is None else root
        self.interval = interval
        self.peak_bytes = 0
        self.peak_processes = 0
        self.extra: tuple[int, ...] = ()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-memory", daemon=True)

    def start(self) -> PeakMemory:
        self._thread.start()
        return self

    def sample(self) -> int:
        total, count = tree_rss(self.root, self.extra)
        # each peak on its own: the most bytes may be held before every worker is up
        self.peak_bytes = max(self.peak_bytes, total)
        self.peak_processes = max(self.peak_processes, count)
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def stop(self) -> int:
        """Stop sampling; the peak in bytes."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        return self.peak_bytes
