"""ByteBudget: a shared bound on bytes in flight, FIFO-fair, leak-free under cancellation."""

from __future__ import annotations

import asyncio

import pytest

from tensorswap.wire._budget import ByteBudget, Reservation
from tensorswap.wire._buffers import HeapTrimmer, release_free_memory
from tensorswap.wire.errors import FrameTooLarge, OverBudget


async def settle() -> None:
    """Let every ready task run until it blocks again (no timing involved)."""
    for _ in range(5):
        await asyncio.sleep(0)


async def test_acquire_within_the_limit_is_immediate_and_counted() -> None:
    budget = ByteBudget(100)
    await budget.acquire(60)
    await budget.acquire(40)
    assert (budget.in_flight, budget.peak, budget.waits) == (100, 100, 0)
    budget.release(100)
    assert budget.in_flight == 0
    assert budget.peak == 100


async def test_over_the_limit_waits_until_released() -> None:
    budget = ByteBudget(100)
    await budget.acquire(80)
    waiter = asyncio.ensure_future(budget.acquire(30))
    await settle()
    assert not waiter.done()
    assert budget.waiting == 1
    budget.release(50)
    await settle()
    assert waiter.done()
    assert budget.in_flight == 60
    assert budget.waits == 1
    assert budget.peak == 80


async def test_a_request_larger_than_the_whole_limit_is_refused_at_once() -> None:
    budget = ByteBudget(100)
    with pytest.raises(OverBudget) as info:
        await budget.acquire(101, "BLOCK raw_len")
    assert isinstance(info.value, FrameTooLarge)
    assert (info.value.length, info.value.limit) == (101, 100)
    assert "BLOCK raw_len" in str(info.value)
    assert budget.refused == 1
    assert budget.in_flight == 0
    await budget.acquire(100)  # exactly the limit fits


async def test_waiters_are_served_in_order_so_a_large_request_is_not_starved() -> None:
    budget = ByteBudget(100)
    await budget.acquire(50)
    order: list[str] = []

    async def take(name: str, nbytes: int) -> None:
        await budget.acquire(nbytes)
        order.append(name)

    big = asyncio.ensure_future(take("big", 100))
    await settle()
    small = asyncio.ensure_future(take("small", 10))  # would fit now, but big came first
    await settle()
    assert order == []
    budget.release(50)
    await settle()
    assert order == ["big"]
    budget.release(100)
    await settle()
    assert order == ["big", "small"]
    await asyncio.gather(big, small)


async def test_a_release_wakes_every_waiter_that_fits() -> None:
    budget = ByteBudget(100)
    await budget.acquire(100)
    waiters = [asyncio.ensure_future(budget.acquire(30)) for _ in range(4)]
    await settle()
    budget.release(100)
    await settle()
    assert [w.done() for w in waiters] == [True, True, True, False]
    assert budget.in_flight == 90
    budget.release(30)
    await asyncio.gather(*waiters)
    assert budget.in_flight == 90


async def test_a_cancelled_waiter_leaves_the_queue_and_lets_the_next_one_in() -> None:
    budget = ByteBudget(100)
    await budget.acquire(60)
    blocked = asyncio.ensure_future(budget.acquire(80))
    await settle()
    behind = asyncio.ensure_future(budget.acquire(40))  # fits, but queued behind 80
    await settle()
    assert not behind.done()
    blocked.cancel()
    await settle()
    assert blocked.cancelled()
    assert behind.done()
    assert budget.in_flight == 100
    assert budget.waiting == 0


async def test_a_waiter_cancelled_after_being_granted_gives_its_bytes_back() -> None:
    budget = ByteBudget(100)
    await budget.acquire(100)
    waiter = asyncio.ensure_future(budget.acquire(70))
    await settle()
    budget.release(100)  # grants the waiter; it has not resumed yet
    waiter.cancel()
    await settle()
    assert waiter.cancelled()
    assert budget.in_flight == 0


async def test_release_refuses_more_than_is_in_flight() -> None:
    budget = ByteBudget(100)
    await budget.acquire(10)
    with pytest.raises(ValueError, match="release 11"):
        budget.release(11)
    with pytest.raises(ValueError, match="negative"):
        await budget.acquire(-1)
    with pytest.raises(ValueError, match="at least 1"):
        ByteBudget(0)


async def test_a_reservation_releases_in_parts_and_never_twice() -> None:
    budget = ByteBudget(100)
    reservation = await budget.reserve(70)
    assert isinstance(reservation, Reservation)
    reservation.release(20)
    assert (budget.in_flight, reservation.nbytes) == (50, 50)
    with reservation:
        pass
    assert budget.in_flight == 0
    reservation.release()
    reservation.release(5)
    assert budget.in_flight == 0
    stats = budget.stats()
    assert (stats.limit, stats.in_flight, stats.peak, stats.waits, stats.refused) == (
        100,
        0,
        70,
        0,
        0,
    )


async def test_many_tasks_never_push_the_peak_above_the_limit() -> None:
    budget = ByteBudget(1000)

    async def worker(seed: int) -> None:
        for i in range(20):
            nbytes = (seed * 37 + i * 101) % 600 + 1
            with await budget.reserve(nbytes):
                assert budget.in_flight <= budget.limit
                await asyncio.sleep(0)

    await asyncio.gather(*(worker(s) for s in range(12)))
    assert budget.peak <= 1000
    assert budget.in_flight == 0
    assert budget.waits > 0


async def test_on_idle_reports_the_bytes_granted_each_time_the_budget_empties() -> None:
    idle: list[int] = []
    budget = ByteBudget(100, on_idle=idle.append)
    first = await budget.reserve(30)
    second = await budget.reserve(50)
    first.release()
    third = await budget.reserve(40)
    second.release()
    assert idle == []
    third.release()
    assert idle == [120]
    with await budget.reserve(10):
        pass
    assert idle == [120, 10]
    budget.release(0)  # nothing was granted since: not reported again
    assert idle == [120, 10]


# ── heap trimming after bursts ───────────────────────────────────────────────
async def test_the_heap_is_trimmed_once_enough_bytes_went_by_and_not_while_busy() -> None:
    busy = False
    trimmer = HeapTrimmer(lambda: busy, after=100, interval=0, quiet=0)
    trimmer(60)
    await settle()
    assert trimmer.trims == 0  # 60 bytes: not worth it
    busy = True
    trimmer(60)
    await settle()
    assert trimmer.trims == 0  # due, but a new burst began: put off
    busy = False
    trimmer(1)
    async with asyncio.timeout(10):
        while trimmer.trims == 0:
            await asyncio.sleep(0.001)
    assert trimmer.trims == 1
    trimmer(99)  # the count restarted at the trim
    await settle()
    assert trimmer.trims == 1
    assert isinstance(release_free_memory(), bool)  # False where there is no glibc


async def test_the_heap_is_not_trimmed_until_bursts_have_stopped_for_a_while() -> None:
    """Freed memory stays with the process between bursts (the next round's uploads reuse
    it) and goes back to the OS only ``quiet`` seconds after the last burst."""
    trimmer = HeapTrimmer(after=100, interval=0, quiet=3600)
    trimmer(200)
    for _ in range(3):
        await settle()
        trimmer(200)  # the next bursts end: still within quiet seconds of the last
    await settle()
    assert trimmer.trims == 0
