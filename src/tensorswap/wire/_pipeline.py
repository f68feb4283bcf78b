"""Bounded prefetch: CPU work for item i+1.. runs in worker threads while item i is sent."""

from __future__ import annotations

import asyncio
import os
import threading
from collections import deque
from collections.abc import AsyncGenerator, Callable, Iterable
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

__all__ = ["cpu_workers", "prefetched"]

_WORKERS: ThreadPoolExecutor | None = None
_WORKERS_LOCK = threading.Lock()


def cpu_workers() -> ThreadPoolExecutor:
    """The process-wide pool for the wire's CPU work (hashing, checksums, encoding).

    As many threads as cores (at most 4): more only adds switching, since the work
    releases the GIL and is bound by the CPU.
    """
    global _WORKERS
    with _WORKERS_LOCK:
        if _WORKERS is None:
            count = max(1, min(4, os.cpu_count() or 1))
            _WORKERS = ThreadPoolExecutor(count, thread_name_prefix="tensorswap-cpu")
        return _WORKERS


async def prefetched(
    items: Iterable[T],
    work: Callable[[T], R],
    depth: int = 2,
    executor: Executor | None = None,
) -> AsyncGenerator[R, None]:
    """Yield ``work(item)`` for each item, in order, computing at most ``depth`` ahead.

    ``work`` runs in ``executor`` (default: asyncio's default thread pool); it should
    release the GIL for large inputs: hashing, checksums, compression, copies. Memory stays
    bounded by ``depth`` results. Close it with ``contextlib.aclosing``: closing early
    (break, error, cancel) cancels the pending results; a thread already running finishes
    in the background and is discarded.
    """
    if depth < 1:
        raise ValueError(f"depth must be at least 1, got {depth}")
    loop = asyncio.get_running_loop()
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
                pending.append(loop.run_in_executor(executor, work, item))
            if not pending:
                return
            yield await pending.popleft()
    finally:
        for future in pending:
            future.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
