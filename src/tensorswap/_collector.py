"""Garbage-collector settings for a long-lived server: start-up objects frozen, rarer young passes.

CPython's cyclic collector runs a young-generation pass every 700 net container allocations
and, every 100 of those, a full pass over every tracked object. A coordinator serving 3,000
connections holds several hundred thousand tracked objects (each connection's transport,
protocol, task, frames and buffers, besides the modules and restored state), and each request
allocates dozens more: in ``bench_scale --part peers`` (3,000 one-request peers) the collector
took ~0.26 ms of every tiny contribution's ~0.7 ms of coordinator CPU, 1.7 s of it in eleven
full passes of ~155 ms each, and found almost nothing to free (reference counting frees what
these paths make; ~800 objects collected in 4 rounds). ``settle_heap`` freezes what exists
once the server is up (``gc.freeze``: never scanned again) and makes young passes rarer
(``YOUNG_THRESHOLD``: ~28x fewer, and full passes, counted in middle passes, as much rarer;
in that benchmark 11 full passes became 2, one of them ``settle_heap``'s own). Cycles are
still collected.
"""

from __future__ import annotations

import gc

__all__ = ["YOUNG_THRESHOLD", "settle_heap"]

YOUNG_THRESHOLD = 20_000
"""Net container allocations between young-generation passes (CPython's default: 700). At
most this many young objects (a few MiB) wait for a pass."""


def settle_heap(young: int = YOUNG_THRESHOLD) -> None:
    """Collect once, freeze every surviving object (``gc.freeze``: moved to the permanent
    generation, never scanned or freed by the collector, still freed by reference counting),
    and run young passes every ``young`` net allocations (the older generations' thresholds
    are kept). For a process that starts, then serves for long: call it once it is up."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(young, middle, old)
