"""10,000 contributions in one round: per-contribution state stays small and bounded, no
thread per peer, and the paged status lists them a page at a time."""

from __future__ import annotations

import threading
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from tensorswap.rounds.core import Collecting, RoundId, RoundSpec
from tensorswap.rounds.engine import Coordinator
from tensorswap.store import ModelUpdate, put_update

RID = RoundId(1, "scale")
PEERS = 10_000


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ten_thousand_contributions_keep_a_few_hundred_bytes_each(tmp_path: Path) -> None:
    with Coordinator.open(tmp_path, run_timer=False, durable=False) as coord:
        coord.start_round(RID, RoundSpec(PEERS + 1))  # stays open: nothing is aggregated
        cids = [  # peers may submit equal updates: 100 distinct ones keep the setup short
            put_update(coord.store, ModelUpdate({"w": np.full(8, float(i), np.float32)}, 1))
            for i in range(100)
        ]
        threads = threading.active_count()
        tracemalloc.start()
        try:
            before, _ = tracemalloc.get_traced_memory()
            for start in range(0, PEERS, 1000):
                part = [(f"client-{i:05}", cids[i % 100]) for i in range(start, start + 1000)]
                outcomes = coord.submit_many(RID, part)
                assert all(isinstance(o, Collecting) for o in outcomes)
            after, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        per_contribution = (after - before) / PEERS
        assert per_contribution < 2048, f"{per_contribution:.0f} bytes per contribution"
        assert threading.active_count() <= threads + 1  # no thread per peer
        assert len(coord.contributions(RID)) == PEERS
        settled = threading.Thread(target=coord.tracker.settle, args=(RID,))
        settled.start()  # returns at once only if no contribution is left pending
        settled.join(30)
        assert not settled.is_alive()
        info, total = coord.tracker.page(0, 10, 3)
        assert total == 1 and info[0].received == PEERS and len(info[0].peers) == 3
        names, count = coord.tracker.peers_page(RID, 9_990, 1000)
        assert count == PEERS and names == [f"client-{i:05}" for i in range(9_990, PEERS)]
