"""Receive buffers: recycled slabs come back only when nothing uses them any more."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading

import numpy as np
import pytest

from tensorswap import _pool
from tensorswap.store import MemoryStore
from tensorswap.wire._buffers import ReceiveBuffers


def test_small_payloads_are_plain_buffers() -> None:
    pool = ReceiveBuffers(min_bytes=1024)
    view = pool.take(100)
    assert view.nbytes == 100 and not view.readonly
    assert pool.allocated == pool.reused == 0


def test_a_slab_is_reused_once_every_view_of_it_is_gone() -> None:
    pool = ReceiveBuffers(keep_bytes=8 << 20, min_bytes=1024)
    first = pool.take((3 << 20) + 5)
    first[:4] = b"abcd"
    kept = first[1:3].toreadonly()  # a derived view keeps the slab in use
    del first
    gc.collect()
    assert pool.idle_bytes == 0
    assert bytes(kept) == b"bc"
    del kept
    gc.collect()
    assert pool.idle_bytes == (3 << 20) + (64 << 10)  # rounded up to whole 64 KiB
    again = pool.take((3 << 20) + 1000)  # the same size class
    assert again.nbytes == (3 << 20) + 1000
    assert (pool.allocated, pool.reused) == (1, 1)


def test_an_adopted_block_holds_its_slab_until_the_store_lets_go() -> None:
    pool = ReceiveBuffers(keep_bytes=8 << 20, min_bytes=1024)
    view = pool.take(1 << 20)
    view[:] = np.arange(1 << 18, dtype=np.uint32).tobytes()
    store = MemoryStore()
    cid = store.put(view, adopt=True)
    del view
    gc.collect()
    assert pool.idle_bytes == 0
    assert store.get(cid, verify=True).nbytes == 1 << 20
    del store
    gc.collect()
    assert pool.idle_bytes == 1 << 20


def test_idle_slabs_are_bounded_by_the_working_set() -> None:
    pool = ReceiveBuffers(keep_bytes=1 << 20, min_bytes=1024)
    views = [pool.take(1 << 20) for _ in range(4)]  # 4 MiB in use at once
    assert pool.in_use_bytes == pool.working_set_bytes == 4 << 20
    del views
    gc.collect()
    assert pool.idle_bytes == 4 << 20 and pool.in_use_bytes == 0  # all were in use at once
    # a burst of another size class: beyond the 4 MiB working set, freed, not kept
    big = pool.take(2 << 20)
    assert pool.working_set_bytes == 4 << 20  # 2 MiB in use, the idle 4 MiB not counted
    del big
    gc.collect()
    assert pool.idle_bytes == 4 << 20
    pool.clear()
    assert pool.idle_bytes == 0
    assert pool.working_set_bytes == 0  # forgotten once nothing is idle or in use


def test_the_working_set_kept_is_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_pool, "WORKING_SET_CAP", 2 << 20)
    pool = ReceiveBuffers(keep_bytes=1 << 20, min_bytes=1024)
    views = [pool.take(1 << 20) for _ in range(4)]
    del views
    gc.collect()
    assert pool.idle_bytes == 2 << 20


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_idle_slabs_go_back_to_the_os_only_after_idle_seconds() -> None:
    clock = _Clock()
    pool = ReceiveBuffers(keep_bytes=8 << 20, min_bytes=1024, idle_seconds=10, clock=clock)
    try:
        first, second = pool.take(1 << 20), pool.take(1 << 20)
        del first
        gc.collect()
        clock.now += 6
        del second
        gc.collect()
        assert pool.idle_bytes == 2 << 20
        assert pool.expire() == 0  # 6 s and 0 s idle: both kept
        clock.now += 5
        assert pool.expire() == 1 << 20  # the first, idle for 11 s
        assert pool.idle_bytes == 1 << 20 and pool.expired == 1
        again = pool.take(1 << 20)  # the second, reused: warm memory
        assert (pool.allocated, pool.reused) == (2, 1)
        del again
        gc.collect()
        clock.now += 10
        assert pool.expire() == 1 << 20 and pool.idle_bytes == 0
    finally:
        pool.clear()


def test_a_server_lets_the_pool_keep_what_its_budget_allows() -> None:
    pool = ReceiveBuffers(keep_bytes=1 << 20, idle_seconds=None)
    pool.allow(8 << 20)
    pool.allow(2 << 20)  # a smaller ask never lowers the bound
    assert pool.keep_bytes == 8 << 20
    views = [pool.take(1 << 20) for _ in range(6)]
    del views
    gc.collect()
    assert pool.idle_bytes == 6 << 20
    assert pool.expire() == 0  # idle_seconds None: kept until cleared
    pool.clear()


def test_a_slab_finalized_by_a_collection_inside_the_pool_does_not_deadlock() -> None:
    # A garbage collection can start at any allocation, also one the pool makes while it holds
    # its lock; a view only the cyclic collector frees is then finalized on that thread, and
    # its slab comes back through the same lock. The clock (called under the lock when a slab
    # is given back) runs that collection here, deterministically.
    armed = threading.Event()

    def clock() -> float:
        if armed.is_set():
            armed.clear()
            gc.collect()
        return 100.0

    pool = ReceiveBuffers(keep_bytes=8 << 20, min_bytes=1024, idle_seconds=None, clock=clock)
    done = threading.Event()

    def run() -> None:
        cycle: list[object] = [pool.take(1 << 20)]
        cycle.append(cycle)  # freed by the cyclic collector only
        del cycle
        view = pool.take(1 << 20)
        armed.set()
        del view  # given back: the clock collects the cycle, under the pool's lock
        done.set()

    gc.disable()  # no collection before the one the clock runs
    try:
        threading.Thread(target=run, daemon=True).start()
        assert done.wait(10), "the pool deadlocked on its own lock"
    finally:
        gc.enable()
    assert pool.in_use_bytes == 0 and pool.idle_bytes == 2 << 20


def test_idle_slabs_stay_within_the_working_set_whatever_their_sizes() -> None:
    pool = ReceiveBuffers(keep_bytes=1 << 20, min_bytes=1024)
    small = [pool.take(1 << 20) for _ in range(16)]  # a 16 MiB working set
    del small
    gc.collect()
    assert pool.idle_bytes == 16 << 20
    other = [pool.take((1 << 20) + 1) for _ in range(8)]  # another size class: new slabs
    assert pool.working_set_bytes == 16 << 20
    del other
    gc.collect()
    assert pool.idle_bytes <= pool.working_set_bytes  # the other size's slabs were not kept


def test_views_alive_at_exit_are_not_handed_out_again() -> None:
    # weakref runs pending finalizers at exit while the objects still live: an atexit handler
    # registered before the pool's first slab would otherwise get a slab an array still uses
    code = (
        "import atexit\n"
        "import numpy as np\n"
        "from tensorswap._pool import receive_buffers\n"
        "def late():\n"
        "    fresh = np.frombuffer(receive_buffers().take(1 << 20), np.uint8)\n"
        "    fresh[:] = 0\n"
        "    print('intact' if (keep == 7).all() else 'overwritten', flush=True)\n"
        "atexit.register(late)\n"
        "keep = np.frombuffer(receive_buffers().take(1 << 20), np.uint8)\n"
        "keep[:] = 7\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "intact", done.stdout + done.stderr
