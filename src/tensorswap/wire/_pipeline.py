"""Bounded prefetch: CPU work for item i+1.. runs in worker threads while item i is sent."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncGenerator, Callable, Iterable
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

__all__ = ["prefetched"]


async def prefetched(
    items: Iterable[T], work: Callable[[T], R], depth: int = 2
) -> AsyncGenerator[R, None]:
    """Yield ``work(item)`` for each item, in order, computing at most ``depth`` ahead.

    ``work`` runs in the default thread pool (it should release the GIL for large inputs:
    hashing, checksums, compression, copies). Memory stays bounded by ``depth`` results.
    Close it with ``contextlib.aclosing``: closing early (break, error, cancel) cancels the
    pending results; a thread already running finishes in the background and is discarded.
    """
    if depth < 1:
        raise ValueError(f"depth must be at least 1, got {depth}")
    pending: deque[asyncio.Future[R]] = deque()
    iterator = iter(items)
    exhausted = False
    try:
        while True:
            while not exhausted and len(pending) < depth:
                try:
                    item = next(iterator)
                except StopIteration:
                    exhausted = True
                    break
                pending.append(asyncio.ensure_future(asyncio.to_thread(work, item)))
            if not pending:
                return
            yield await pending.popleft()
    finally:
        for future in pending:
            future.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
