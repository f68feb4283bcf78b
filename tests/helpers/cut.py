"""Cut-through rounds in tests: every peer announces before any submits."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from tensorswap.rounds import RoundClient, RoundId
from tensorswap.store import ModelUpdate, put_update


async def announce_all(
    clients: Sequence[RoundClient],
    round_id: RoundId,
    values: Sequence[Mapping[str, np.ndarray]],
    samples: Sequence[int],
    chunk_bytes: int,
) -> None:
    """Each client stores its update cut in ``chunk_bytes`` and announces it (its later
    ``submit`` of the same values then pushes that update): a tiny update uploads faster than
    another peer announces, and a submit before the last announcement makes a barrier."""
    for client, v, n in zip(clients, values, samples, strict=True):
        client.cut.chunk_bytes = chunk_bytes
        cid = put_update(client.store, ModelUpdate(dict(v), n), chunk_bytes=chunk_bytes)
        await client.cut.begin(round_id, cid, None)
