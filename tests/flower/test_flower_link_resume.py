"""A link whose connection drops mid-upload pushes again on a fresh one, sending only the blocks
the service still lacks (no Flower needed)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from proxy import CuttingProxy

from tensorswap.flower import BlockLink, BlockService
from tensorswap.store import MemoryStore, ModelUpdate, put_update


@pytest.fixture
def service() -> Iterator[BlockService]:
    with BlockService() as running:
        yield running


def test_a_dropped_upload_resumes_with_only_the_missing_blocks(service: BlockService) -> None:
    rng = np.random.default_rng(3)
    arrays = {"w": rng.standard_normal(4_000_000).astype(np.float32)}  # 16 MB: 4 chunks
    local = MemoryStore()
    root = put_update(local, ModelUpdate(arrays))
    blocks = len(list(local))
    proxy = CuttingProxy(service.port, cut=10_000_000)  # inside the third chunk
    try:
        with BlockLink(f"127.0.0.1:{proxy.port}") as link:
            assert link.push(arrays) == root
            counters = link.counters
    finally:
        proxy.close()
    assert counters.retries == 1 and proxy.connections == 2
    assert 0 < counters.sent_blocks < blocks - 1  # the blocks stored before the cut not again
    assert service.store.missing(list(local)) == []
    with BlockLink(service.address) as reader:
        np.testing.assert_array_equal(reader.fetch(root)["w"], arrays["w"])
