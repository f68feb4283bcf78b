"""ByteBudget: one server-wide bound on the bytes its connections hold in flight, FIFO-fair."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from tensorswap.wire.errors import OverBudget

__all__ = [
    "DEFAULT_MAX_INFLIGHT_BYTES",
    "BudgetStats",
    "ByteBudget",
    "Reservation",
    "Tie",
    "owner_of",
]

DEFAULT_MAX_INFLIGHT_BYTES = 1 << 30
"""1 GiB: room for three of the largest (256 MiB) blocks at once, compressed or not."""


@dataclass(frozen=True, slots=True)
class BudgetStats:
    """A snapshot of a budget's counters."""

    limit: int
    in_flight: int
    """Bytes reserved now."""
    peak: int
    """The most bytes ever reserved at once (never above ``limit``)."""
    waits: int
    """Reservations that had to wait for others to release."""
    refused: int
    """Reservations refused outright: larger than the whole limit."""


class ByteBudget:
    """Counts bytes reserved by many tasks against one ``limit``; over it, they wait.

    ``acquire(n)`` returns once ``n`` bytes fit; ``release(n)`` gives them back. Waiters are
    served strictly in arrival order: a request that fits is not let past an earlier one that
    does not, so a large request is never starved by a stream of small ones. A request for
    more than ``limit`` could never be granted and raises OverBudget at once (``refused``).
    A waiter cancelled before its turn leaves the queue; one cancelled just after being
    granted gives its bytes back, so cancellation never leaks a reservation. Event loop only
    (not thread-safe).

    ``on_idle(granted)``, if given, is called each time the bytes in flight fall back to 0,
    with the bytes granted since the previous time (a server returns freed memory then).
    """

    def __init__(
        self,
        limit: int = DEFAULT_MAX_INFLIGHT_BYTES,
        *,
        on_idle: Callable[[int], None] | None = None,
    ) -> None:
        if limit < 1:
            raise ValueError(f"the in-flight byte limit must be at least 1, got {limit}")
        self.limit = limit
        self.in_flight = 0
        self.peak = 0
        self.waits = 0
        self.refused = 0
        self.on_idle = on_idle
        self._granted = 0  # bytes granted since in_flight was last 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    def stats(self) -> BudgetStats:
        return BudgetStats(self.limit, self.in_flight, self.peak, self.waits, self.refused)

    @property
    def waiting(self) -> int:
        """Requests queued now."""
        return len(self._waiters)

    def _grant(self, nbytes: int) -> None:
        self.in_flight += nbytes
        self.peak = max(self.peak, self.in_flight)
        self._granted += nbytes

    async def acquire(self, nbytes: int, what: str = "bytes in flight") -> None:
        """Reserve ``nbytes``, waiting (FIFO) while they do not fit; OverBudget above limit."""
        if nbytes < 0:
            raise ValueError(f"cannot reserve a negative byte count {nbytes}")
        if nbytes > self.limit:
            self.refused += 1
            raise OverBudget(what, nbytes, self.limit)
        if not self._waiters and self.in_flight + nbytes <= self.limit:
            self._grant(nbytes)
            return
        self.waits += 1
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (nbytes, future)
        self._waiters.append(entry)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():  # granted, then cancelled: undo
                self.release(nbytes)
            else:
                with contextlib.suppress(ValueError):  # _wake may have dropped it already
                    self._waiters.remove(entry)
                self._wake()  # the head may have changed to one that fits
            raise

    def release(self, nbytes: int) -> None:
        """Give back ``nbytes`` reserved earlier and wake the waiters that now fit, in order."""
        if nbytes < 0 or nbytes > self.in_flight:
            raise ValueError(f"cannot release {nbytes} bytes of {self.in_flight} in flight")
        self.in_flight -= nbytes
        self._wake()
        if self.in_flight == 0 and self._granted:
            granted, self._granted = self._granted, 0
            if self.on_idle is not None:
                self.on_idle(granted)

    def _wake(self) -> None:
        while self._waiters:
            nbytes, future = self._waiters[0]
            if future.done():  # cancelled, its task not yet resumed to remove it
                self._waiters.popleft()
                continue
            if self.in_flight + nbytes > self.limit:
                return
            self._waiters.popleft()
            self._grant(nbytes)
            future.set_result(None)

    async def reserve(self, nbytes: int, what: str = "bytes in flight") -> Reservation:
        """``acquire(nbytes)`` as a Reservation, released (in parts or whole) exactly once."""
        await self.acquire(nbytes, what)
        return Reservation(self, nbytes)


class Reservation:
    """Bytes reserved in a ByteBudget; ``release`` gives back part or all, never more."""

    __slots__ = ("budget", "nbytes")

    def __init__(self, budget: ByteBudget, nbytes: int) -> None:
        self.budget = budget
        self.nbytes = nbytes
        """Bytes still held."""

    def release(self, nbytes: int | None = None) -> None:
        """Give back ``nbytes`` (default: all still held); idempotent once all is back."""
        part = self.nbytes if nbytes is None else min(nbytes, self.nbytes)
        if part > 0:
            self.nbytes -= part
            self.budget.release(part)

    def tie(self, owner: object | None = None, nbytes: int | None = None) -> Tie:
        """Move ``nbytes`` (default: all still held) of this reservation onto ``owner``, the
        object whose memory they stand for: they go back to the budget when ``owner`` is
        freed, from whichever thread frees it, or earlier through the Tie's ``release``
        (bytes a store took over). So the budget counts memory exactly as long as it exists,
        even when a cancelled connection, a worker thread or a kept error holds it longer
        than the code path that received it. ``owner`` None: the bytes go back through
        ``release``, or once an owner given later (``Tie.follow``) is freed. Event loop only."""
        part = self.nbytes if nbytes is None else min(nbytes, self.nbytes)
        self.nbytes -= part
        return Tie(self.budget, part, owner)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


class Tie:
    """Budget bytes tied to the object holding their memory (``Reservation.tie``): released
    exactly once, when the object they follow is freed or by ``release``, whichever comes
    first. Until it follows one (``follow``), only ``release`` gives them back."""

    __slots__ = ("_give_back", "_token")

    def __init__(self, budget: ByteBudget, nbytes: int, owner: object | None = None) -> None:
        loop = asyncio.get_running_loop()
        thread = threading.get_ident()
        token = [nbytes] if nbytes > 0 else []  # popped once: by release or by the owner's end

        def give_back() -> None:
            try:
                held = token.pop()  # atomic: whichever thread comes first gives back
            except IndexError:
                return
            if threading.get_ident() == thread:
                budget.release(held)
            else:  # freed on a worker thread: the budget belongs to its loop
                with contextlib.suppress(RuntimeError):  # that loop is closed: nothing to do
                    loop.call_soon_threadsafe(budget.release, held)

        self._token = token
        self._give_back = give_back
        if owner is not None:
            self.follow(owner)

    @property
    def nbytes(self) -> int:
        """Bytes still held (0 once given back)."""
        return self._token[0] if self._token else 0

    def follow(self, owner: object) -> None:
        """Give the bytes back when ``owner`` (which holds their memory now) is freed; one that
        takes no weak reference leaves them to ``release``. May be called for several owners
        in turn (the first to go gives them back)."""
        if not self._token:
            return
        with contextlib.suppress(TypeError):
            weakref.finalize(owner, self._give_back).atexit = False

    def release(self) -> None:
        """Give the bytes back now (idempotent; an owner's end then gives nothing back)."""
        self._give_back()


def owner_of(view: memoryview) -> object:
    """The object whose memory ``view`` shows (the exporter every slice of it keeps alive) if
    it takes weak references, else the view itself (``Reservation.tie``)."""
    owner = view.obj
    try:
        weakref.ref(owner)
    except TypeError:
        return view
    return owner
