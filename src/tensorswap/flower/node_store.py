"""NodeStore: a Flower node's blocks on disk, kept across the processes that handle its messages.

In deployment (``flower-supernode``, isolation ``subprocess``) each message starts a fresh
``flwr-clientapp`` process: a store in that process's memory lasts one message, so the next
round fetches every tensor again, changed or not. ``blocks_mod(address, store=DIR)`` gives
the node a ``DirectoryStore`` at ``DIR`` instead, which every process of that node opens: a
fetch asks only for the blocks none of them has held yet (a frozen layer, the tensors a
round left unchanged).

What the directory keeps: the blocks of the last ``keep`` roots the node fetched or held
(named in ``DIR/flower-roots``, updated under an exclusive ``flock`` of
``DIR/flower-roots.lock`` so processes handling messages at once do not lose each other's),
and any block stored or touched in the last ``grace`` seconds (a process handling a message
at that moment may be pushing one that no root lists yet). Everything else is collected when a
root falls out of the list, under an exclusive lock that waits for every fetch in progress
(each holds the lock shared from checking what the store lacks to reading the arrays). The
roots file is not synced: after a crash it may be lost, which costs only fetches again.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from tensorswap.cid import Cid
from tensorswap.errors import InvalidCid, TensorSwapError
from tensorswap.store import DirectoryStore
from tensorswap.store.gc import collect_garbage

__all__ = ["GRACE_SECONDS", "NodeStore"]

GRACE_SECONDS = 600.0
"""Blocks stored or touched this recently are never collected (another process may be using
them)."""

_ROOTS, _LOCK = "flower-roots", "flower-roots.lock"
log = logging.getLogger("tensorswap.flower")


class NodeStore:
    """The blocks of one Flower node in ``path`` (a ``DirectoryStore``, made if missing)."""

    def __init__(
        self, path: str | os.PathLike[str], *, keep: int = 4, grace: float = GRACE_SECONDS
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.path = Path(path)
        self.store = DirectoryStore(self.path)
        self.keep = keep
        self.grace = grace
        self.collected = 0
        """Blocks this object's collections deleted so far."""

    def roots(self) -> list[Cid]:
        """The roots kept, oldest first (lines that are no CID are skipped)."""
        try:
            text = (self.path / _ROOTS).read_text()
        except FileNotFoundError:
            return []
        roots = []
        for line in text.split():
            with contextlib.suppress(InvalidCid):
                roots.append(Cid.parse(line))
        return roots

    def remember(self, root: Cid) -> None:
        """Keep ``root`` (as the newest); collect what only the roots it pushes out held."""
        with self._locked():
            roots = [r for r in self.roots() if r != root] + [root]
            kept = roots[-self.keep :]
            tmp = self.path / f".{_ROOTS}.{os.getpid()}.tmp"
            tmp.write_text("".join(f"{r}\n" for r in kept))
            os.replace(tmp, self.path / _ROOTS)
            if len(roots) > len(kept):
                # under the exclusive lock: no process of the node is between a fetch's
                # check of what the store holds and its reading the arrays (``reading``)
                try:
                    result = collect_garbage(self.store, kept, min_age=self.grace)
                except TensorSwapError as exc:  # a kept root's manifest unreadable: next time
                    log.warning("node store %s: collection skipped: %s", self.path, exc)
                else:
                    self.collected += result.removed

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Hold off the node's collections (a shared ``flock``) while a fetch decides what it
        lacks and reads the arrays: a block it found held must not go before it is read."""
        with self._locked(fcntl.LOCK_SH):
            yield

    @contextlib.contextmanager
    def _locked(self, how: int = fcntl.LOCK_EX) -> Iterator[None]:
        fd = os.open(self.path / _LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, how)
            yield
        finally:
            os.close(fd)  # releases the lock
