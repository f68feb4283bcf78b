"""SecAgg+'s neighbour graph: a Harary graph H(k, n) over a seeded random permutation.

Bell et al. 2020 replace SecAgg's complete graph with a sparse one: each peer masks with
and shares its secrets among only its k neighbours, k = O(log n). We use their
construction: place the peers on a ring in a random order and join each to its k/2
nearest on either side (k even; for odd k and even n also to the peer opposite). The
graph is k-regular and k-connected. The order comes from numpy's PCG64 seeded with
SHA-256 of the round's public graph seed, so every peer and the server compute the same
graph from the seed the server announces; the seed is public (it is not a secret).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import numpy as np

from tensorswap.privacy.secagg.errors import SecAggConfigError


def default_degree(n: int) -> int:
    """``2 * ceil(log2 n)`` neighbours (even), capped at the complete graph's ``n - 1``."""
    if n < 2:
        raise SecAggConfigError("peers", n, "a secure aggregation needs at least 2 peers")
    return min(n - 1, 2 * math.ceil(math.log2(n)))


def check_degree(n: int, k: int) -> None:
    """Refuse a degree no k-regular graph on n vertices has."""
    if not 1 <= k <= n - 1:
        raise SecAggConfigError("neighbours", k, f"must be in 1..{n - 1} for {n} peers")
    if k % 2 == 1 and n % 2 == 1 and k != n - 1:
        raise SecAggConfigError("neighbours", k, f"no {k}-regular graph on {n} (odd) peers")


def neighbour_graph(peers: Sequence[int], k: int, seed: bytes) -> dict[int, frozenset[int]]:
    """Each peer's k neighbours, the same for every caller with the same peers and seed."""
    ordered = sorted(peers)
    n = len(ordered)
    if len(set(ordered)) != n:
        raise SecAggConfigError("peers", list(peers), "peer ids must be distinct")
    check_degree(n, k)
    digest = hashlib.sha256(b"tensorswap secagg+ graph" + seed).digest()
    rng = np.random.Generator(np.random.PCG64(int.from_bytes(digest, "big")))
    ring = [ordered[int(i)] for i in rng.permutation(n)]
    adjacency: dict[int, set[int]] = {p: set() for p in ordered}
    offsets = list(range(1, k // 2 + 1))
    if k == n - 1:
        offsets = list(range(1, n))
    elif k % 2 == 1:
        offsets.append(n // 2)
    for pos, peer in enumerate(ring):
        for off in offsets:
            other = ring[(pos + off) % n]
            adjacency[peer].add(other)
            adjacency[other].add(peer)
    return {p: frozenset(v) for p, v in adjacency.items()}
