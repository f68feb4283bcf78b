"""Deterministic client sampling: the same seed, round and active peers give the same sample."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["sample_peers"]


def sample_peers(active: Sequence[str], k: int, seed: int, round: int) -> tuple[str, ...]:
    """``k`` distinct peers of ``active``, chosen uniformly by a PCG64 generator seeded with
    ``(seed, round)`` over the sorted names; returned sorted. The same inputs always give the
    same sample (numpy's SeedSequence and PCG64 are stable across versions and platforms)."""
    names = sorted(set(active))
    if not 0 <= k <= len(names):
        raise ValueError(f"cannot sample {k} of {len(names)} active peers")
    if k == len(names):
        return tuple(names)
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, round])))
    picked = rng.choice(len(names), size=k, replace=False)
    return tuple(sorted(names[int(i)] for i in picked))
