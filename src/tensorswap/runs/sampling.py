"""Client sampling: seeded (the same seed, round and active peers give the same sample), or
secret for DP runs (the OS's CSPRNG: a seeded sample is public to whoever knows the seed)."""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import numpy as np

__all__ = ["sample_peers"]


def sample_peers(
    active: Sequence[str], k: int, seed: int, round: int, *, secret: bool = False
) -> tuple[str, ...]:
    """``k`` distinct peers of ``active``, chosen uniformly by a PCG64 generator seeded with
    ``(seed, round)`` over the sorted names; returned sorted. The same inputs always give the
    same sample (numpy's SeedSequence and PCG64 are stable across versions and platforms).

    ``secret`` (a DP run, whose accounting assumes nobody outside the coordinator knows the
    sample): chosen by the OS's CSPRNG instead, ``seed`` unused; the run journals the sample
    before it is used, so a restart reads it back rather than draw it again."""
    names = sorted(set(active))
    if not 0 <= k <= len(names):
        raise ValueError(f"cannot sample {k} of {len(names)} active peers")
    if k == len(names):
        return tuple(names)
    if secret:
        return tuple(sorted(secrets.SystemRandom().sample(names, k)))
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, round])))
    picked = rng.choice(len(names), size=k, replace=False)
    return tuple(sorted(names[int(i)] for i in picked))
