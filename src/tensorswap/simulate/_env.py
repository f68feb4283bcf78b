"""The environment of a simulation's processes: its coordinator and its workers.

Each round, every process of a simulation allocates and frees model-sized buffers (updates
encoded and decoded, blocks received, sums). glibc's malloc hands freed memory above its trim
threshold back to the system and serves large requests with fresh mappings (the threshold
rises with use, up to 32 MiB), so by default a round keeps touching new pages; on this VM a
page touched for the first time costs far more than one reused (writing 100 x 1 MiB: 350 ms
into fresh memory, 33 ms into freed pages). ``sim_env`` fixes the two thresholds, so what a
round frees stays in the heap for the next one: in one run, 3 simulations each way (1,000
clients, 100 a round, 1 MiB), 0.49-0.72 s per round against 0.53-0.85 s, for 20-30 MiB more
peak memory of the whole simulation (~4%). A value set in the environment already is kept.
The coordinator, ``tensorswap serve``, then sets its own mmap threshold (1 MiB,
``serve_cmd.release_large_frees``: its resident memory stays near what is live), so there only
the trim threshold holds; the workers keep both.
"""

from __future__ import annotations

from tensorswap.demo.fleet import child_env

__all__ = ["MALLOC_SETTINGS", "sim_env"]

MALLOC_SETTINGS = {
    "MALLOC_TRIM_THRESHOLD_": str(256 << 20),  # freed memory kept up to this much at the top
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),  # blocks below this come from the heap
}
"""glibc's malloc tunables for a simulation's processes (other C libraries ignore them)."""


def sim_env() -> dict[str, str]:
    """``demo.fleet.child_env()`` (one thread each, tensorswap importable) with
    ``MALLOC_SETTINGS`` where the environment sets none."""
    env = child_env()
    for name, value in MALLOC_SETTINGS.items():
        env.setdefault(name, value)
    return env
