"""DialThrottle: when a region's link may open its next connection upstream, shared by all
of the link's operations, so a flood of requests below never turns into a flood of dials."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from tensorswap.rounds.client import Backoff

__all__ = ["DialThrottle"]


class DialThrottle:
    """The link-wide backoff between dials (a circuit breaker).

    After ``k`` failed dials in a row (refused, busy, timed out, or the hello refused) no
    dial is made until ``backoff.delay(k, draw)`` seconds after the last failure: until
    then, and while the one dial allowed after it (the probe) is under way, ``admit``
    answers with the last failure, which the operation takes as its own (a transient one is
    retried on the operation's own backoff, a refusal is raised to its caller at once). A
    successful dial resets it. So the upstream sees one dial per delay, however many
    operations want one, and a request below hears the reason without waiting. ``clock``
    and ``draw`` (uniform in [0, 1)) are injectable for tests.
    """

    def __init__(
        self,
        backoff: Backoff,
        *,
        clock: Callable[[], float] = time.monotonic,
        draw: Callable[[], float] | None = None,
    ) -> None:
        self.backoff = backoff
        self._clock = clock
        self._draw = draw or random.Random().random
        self.failures = 0
        """Failed dials in a row."""
        self.not_before = 0.0
        """The clock's time before which no dial is made."""
        self.last: Exception | None = None
        """The last dial's failure (None once one succeeded)."""
        self.refused = False
        """Whether ``last`` is a refusal (the upstream answered no) rather than a fault."""
        self.dials = 0
        """Dials admitted so far."""
        self._probing = False

    def wait(self) -> float:
        """Seconds until a dial may be made again (0: now)."""
        return max(0.0, self.not_before - self._clock())

    def admit(self) -> Exception | None:
        """None: dial now (after failures, as the one probe); else the failure to answer
        the operation with instead of dialling."""
        if self.failures and (self._probing or self.wait() > 0):
            return self.last
        self._probing = self.failures > 0
        self.dials += 1
        return None

    def failed(self, exc: Exception, *, refused: bool = False) -> float:
        """Note a failed dial (``refused``: the upstream answered no, rather than broke);
        the wait it sets."""
        self.failures += 1
        delay = self.backoff.delay(self.failures, self._draw())
        self.not_before = self._clock() + delay
        self.last, self.refused, self._probing = exc, refused, False
        return delay

    def abandoned(self) -> None:
        """The admitted dial ended without a verdict (cancelled): another may probe."""
        self._probing = False

    def succeeded(self) -> None:
        self.failures, self.not_before, self.last, self.refused = 0, 0.0, None, False
        self._probing = False
