"""The memory a piece of code allocates, measured with tracemalloc."""

from __future__ import annotations

import contextlib
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass


@dataclass
class Traced:
    """What tracemalloc saw inside a ``traced()`` block: bytes held at its end, and the peak."""

    current: int = 0
    peak: int = 0


@contextlib.contextmanager
def traced() -> Iterator[Traced]:
    """Trace allocations inside the block; the result is filled in when it ends (raising too)."""
    result = Traced()
    tracemalloc.start()
    try:
        yield result
    finally:
        result.current, result.peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()


def peak_of(call: Callable[..., object], *args: object) -> tuple[BaseException | None, int]:
    """Run ``call(*args)``: the exception it raised (or None) and the peak bytes it allocated."""
    with traced() as memory:
        try:
            call(*args)
        except Exception as exc:
            error: BaseException | None = exc
        else:
            error = None
    return error, memory.peak
