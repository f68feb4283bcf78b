"""tensorswap benchmarks: each module prints ratios against baselines measured in the same run."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TypeVar

_T = TypeVar("_T")


def best_pass_seconds(fn: Callable[[_T], object], items: Iterable[_T], repeats: int = 3) -> float:
    """The fastest of ``repeats`` passes of ``fn`` over ``items``, in seconds."""
    pieces = list(items)
    seconds = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for item in pieces:
            fn(item)
        seconds = min(seconds, time.perf_counter() - start)
    return seconds
