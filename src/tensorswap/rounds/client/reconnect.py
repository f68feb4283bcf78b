"""Reconnect with backoff: run a peer's request again on a fresh connection after a wire failure.

A coordinator that restarts (kill -9, a deploy) or a link that drops leaves a RoundClient's
connection broken; the request then fails with a TransportError (refused, reset, timed out)
or an ``ERROR`` frame. ``retrying`` connects, runs the operation, and on such a failure
closes the connection, waits (exponential backoff with jitter) and does both again, until
the operation returns or the backoff's ``give_up_after`` passes. What it repeats must be
safe to repeat: a submit resends only the blocks the coordinator still lacks, and a submit
that the coordinator journaled before the failure is refused as DuplicateContribution on the
retry (``retrying`` returns ``on_duplicate()`` then, when given).
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from tensorswap.rounds.client.client import RoundClient
from tensorswap.rounds.core.errors import DuplicateContribution
from tensorswap.wire.errors import (
    AuthenticationFailed,
    BlockHashMismatch,
    ChecksumMismatch,
    IncompleteStream,
    RemoteError,
    StreamEnded,
    TransportError,
)

__all__ = ["RETRYABLE", "RETRYABLE_CODES", "Backoff", "retryable", "retrying"]

T = TypeVar("T")

log = logging.getLogger(__name__)

RETRYABLE: tuple[type[BaseException], ...] = (
    TransportError,  # refused, busy, reset, timed out, closed mid-frame
    OSError,
    StreamEnded,
    IncompleteStream,
    ChecksumMismatch,  # bytes damaged on the way: a resend may arrive whole
    BlockHashMismatch,
)
"""Failures of the connection, not of the request: a fresh connection may succeed (the
same set as ``region.link.TRANSIENT``). Also retried: an ``ERROR`` frame whose code says
the server gave up on this connection for now (``RETRYABLE_CODES``), and a failed
authentication caused by the connection closing mid-handshake (a coordinator going down
or still starting). Never retried: the coordinator's refusals (RoundsError leaves such as
RoundNotFound), a wrong key, a protocol violation, a block too large for the server."""

RETRYABLE_CODES = frozenset({"timeout", "busy", "store_error"})
"""ERROR codes after which the same request may succeed on a new connection."""

_CAUGHT: tuple[type[BaseException], ...] = (*RETRYABLE, AuthenticationFailed, RemoteError)


def retryable(exc: BaseException) -> bool:
    """Whether ``retrying`` tries again after ``exc``."""
    if isinstance(exc, AuthenticationFailed):
        return isinstance(exc.__cause__, RETRYABLE)
    if isinstance(exc, RemoteError):
        return exc.code in RETRYABLE_CODES
    return isinstance(exc, RETRYABLE)


@dataclass(frozen=True, slots=True)
class Backoff:
    """Attempt ``k`` (from 1) waits ``min(cap, first * factor ** (k - 1))`` seconds, times a
    random factor in ``[1 - jitter, 1]`` (peers that lost one coordinator do not all come
    back at once). ``give_up_after`` seconds after the first failure, the last one is raised
    (None: never)."""

    first: float = 0.2
    factor: float = 2.0
    cap: float = 5.0
    jitter: float = 0.2
    give_up_after: float | None = 120.0

    def __post_init__(self) -> None:
        for name in ("first", "factor", "cap", "jitter"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.factor < 1:
            raise ValueError(f"factor must be >= 1, got {self.factor}")
        if self.jitter > 1:
            raise ValueError(f"jitter must be in [0, 1], got {self.jitter}")
        give_up = self.give_up_after
        if give_up is not None and (not math.isfinite(give_up) or give_up < 0):
            raise ValueError(f"give_up_after must be a number >= 0 or None, got {give_up!r}")

    def delay(self, failures: int, draw: float = 0.0) -> float:
        """The wait after ``failures`` (>= 1) failures in a row, for a uniform ``draw`` in
        [0, 1) (the jitter's randomness, passed in: a pure function of its arguments)."""
        if failures < 1:
            raise ValueError(f"failures must be >= 1, got {failures}")
        if not 0.0 <= draw <= 1.0:
            raise ValueError(f"draw must be in [0, 1], got {draw}")
        exponent = 0
        if self.factor > 1 and self.first > 0:
            # the growths until ``cap`` is reached, and one more: factor ** exponent stays finite
            to_cap = math.log(max(self.cap / self.first, 1.0)) / math.log(self.factor)
            exponent = min(failures - 1, math.ceil(to_cap) + 1)
        return min(self.cap, self.first * self.factor**exponent) * (1 - self.jitter * draw)

    def delays(self, rng: random.Random | None = None) -> Iterator[float]:
        """The waits before attempts 2, 3, ...: endless, each at most ``cap``."""
        rng = rng or random.Random()
        failures = 0
        while True:
            failures += 1
            yield self.delay(failures, rng.random())


async def retrying(
    connect: Callable[[], Awaitable[RoundClient]],
    operation: Callable[[RoundClient], Awaitable[T]],
    backoff: Backoff | None = None,
    *,
    on_duplicate: Callable[[], T] | None = None,
    on_retry: Callable[[int, BaseException, float], None] | None = None,
    sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    clock: Callable[[], float] = time.monotonic,
    rng: random.Random | None = None,
) -> T:
    """``operation(client)`` on a client from ``connect()``, again on a new one after a
    ``retryable`` failure (of the connect or of the operation), with ``backoff`` between tries.

    Each attempt's client is closed before the next (aborted after a failure).
    ``on_retry(attempt, error, wait)`` is called before each wait. A DuplicateContribution
    on a retry (not the first attempt) means an earlier attempt was accepted:
    ``on_duplicate()`` is returned when given, else it is raised. Cancelling the call
    aborts the client in use.
    """
    backoff = backoff or Backoff()
    waits = backoff.delays(rng)
    started: float | None = None
    attempt = 0
    while True:
        attempt += 1
        try:
            client = await connect()
            try:
                result = await operation(client)
            except BaseException:
                client.blocks.transport.abort()  # broken or cancelled: no graceful flush
                raise
            await _close(client)
            return result
        except DuplicateContribution:
            if attempt > 1 and on_duplicate is not None:
                return on_duplicate()
            raise
        except _CAUGHT as exc:
            if not retryable(exc):
                raise
            now = clock()
            started = now if started is None else started
            if backoff.give_up_after is not None and now - started >= backoff.give_up_after:
                raise
            wait = next(waits)
            if backoff.give_up_after is not None:
                wait = min(wait, max(0.0, started + backoff.give_up_after - now))
            log.info("attempt %d failed (%s); trying again in %.2f s", attempt, exc, wait)
            if on_retry is not None:
                on_retry(attempt, exc, wait)
            await sleep(wait)


async def _close(client: RoundClient) -> None:
    """Close without raising: the connection may be broken already."""
    try:
        await client.aclose()
    except (TransportError, OSError):
        client.blocks.transport.abort()
