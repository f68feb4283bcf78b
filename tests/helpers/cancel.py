"""Cancel a call at each of its await points in turn: ``sweep`` and the ``Stepwise`` transport.

``CancelAt(coro, k)`` drives ``coro`` as its task would, counting the times it suspends
(an await that yields to the event loop); at the k-th it cancels it right there, as
``task.cancel()`` would (the future it waits on is cancelled, and the CancelledError comes
out of that await). ``sweep`` runs a call cancelled at suspension 1, 2, ... until it
completes, checking after each cancel that the next calls on the same client still get the
right answers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Generator
from typing import Any

from tensorswap.wire import Transport


class CancelAt:
    """``await CancelAt(coro, k)``: ``coro``, cancelled at its ``k``-th suspension."""

    def __init__(self, coro: Coroutine[Any, Any, Any], k: int) -> None:
        self.coro = coro
        self.k = k
        self.suspensions = 0
        self.injected = asyncio.Event()
        """Set when the cancel was delivered (the call had suspended ``k`` times)."""

    def __await__(self) -> Generator[Any, Any, Any]:
        coro = self.coro
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                yielded = coro.send(value) if error is None else coro.throw(error)
            except StopIteration as stop:
                return stop.value
            value, error = None, None
            self.suspensions += 1
            if self.suspensions == self.k:
                self.injected.set()
                # as task.cancel(): the future awaited is cancelled and raises where it is
                # awaited; a bare yield (sleep(0)) gets the CancelledError thrown in
                if not (isinstance(yielded, asyncio.Future) and yielded.cancel()):
                    error = asyncio.CancelledError()
                continue
            try:
                value = yield yielded
            except BaseException as exc:  # thrown in by the task: pass it on
                error = exc


async def run_cancelled_at(
    make: Callable[[], Coroutine[Any, Any, Any]],
    k: int,
    meanwhile: Callable[[CancelAt, asyncio.Task[Any]], Awaitable[None]] | None = None,
) -> tuple[bool, Any]:
    """``make()`` in a task cancelled at its k-th suspension: (whether the cancel came, what
    it returned if it completed). ``meanwhile(stepper, task)`` runs while it does."""
    stepper = CancelAt(make(), k)

    async def drive() -> Any:
        return await stepper

    task = asyncio.ensure_future(drive())
    if meanwhile is not None:
        await meanwhile(stepper, task)
    await asyncio.wait([task])
    if stepper.injected.is_set():
        if not task.cancelled():
            task.exception()  # a cancel the call turned into an error: retrieved, no result
        return True, None
    return False, task.result()


async def sweep(
    make: Callable[[int], Coroutine[Any, Any, Any]],
    check: Callable[[int, bool], Awaitable[None]],
    *,
    meanwhile: Callable[[int, CancelAt, asyncio.Task[Any]], Awaitable[None]] | None = None,
    limit: int = 400,
) -> int:
    """For k = 1, 2, ...: ``make(k)`` cancelled at its k-th suspension, then
    ``check(k, cancelled)``; until a call completes. Returns how many points were cut."""
    for k in range(1, limit):
        hook = None if meanwhile is None else _bind(meanwhile, k)
        cancelled, _ = await run_cancelled_at(lambda k=k: make(k), k, hook)
        await check(k, cancelled)
        if not cancelled:
            return k - 1
    raise AssertionError(f"the call still suspends after {limit} points")


def _bind(
    meanwhile: Callable[[int, CancelAt, asyncio.Task[Any]], Awaitable[None]], k: int
) -> Callable[[CancelAt, asyncio.Task[Any]], Awaitable[None]]:
    async def hook(stepper: CancelAt, task: asyncio.Task[Any]) -> None:
        await meanwhile(k, stepper, task)

    return hook


class Stepwise(Transport):
    """A transport over ``inner`` that moves every send and every receive in two halves
    with a suspension between them, and reads nothing ahead: each frame can be cut in the
    middle, on either side."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.peer = inner.peer

    @property  # type: ignore[override]
    def bytes_sent(self) -> int:
        return self.inner.bytes_sent

    @property  # type: ignore[override]
    def bytes_received(self) -> int:
        return self.inner.bytes_received

    async def send(self, *parts: Any) -> None:
        for part in parts:
            view = memoryview(part).cast("B")
            half = view.nbytes // 2
            await self.inner.send(view[:half])
            await asyncio.sleep(0)
            await self.inner.send(view[half:])

    async def receive_into(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        half = view.nbytes // 2
        got = await self.inner.receive_into(view[:half]) if half else 0
        if got < half:
            return got
        await asyncio.sleep(0)
        return got + await self.inner.receive_into(view[half:])

    async def send_eof(self) -> None:
        await self.inner.send_eof()

    async def aclose(self) -> None:
        await self.inner.aclose()

    def abort(self) -> None:
        self.inner.abort()
