"""Keeping a cut-through round's uploads in step: a peer far ahead waits for the others.

A cut-through piece folds when the *slowest* expected peer's chunk of it is in, and until
then the coordinator holds the chunks of the peers ahead. Peers do not progress evenly (on
loopback the CPU, on a shared link TCP, which gives one flow twice another's rate for
seconds at a time), so without pacing the coordinator held up to ``max_held_bytes`` of
arrived values: 4.1-4.3x one update of resident memory in the loopback round, against the
barrier's 3.5x.

``Pacer.hold`` runs on the block service's sink thread of the connection that brought a
chunk, before the chunk counts as arrived. While the chunks between the pieces folded so
far and this one hold ``window_bytes`` or more (one 4 MiB chunk by default), it waits. The
connection's sink then fills, the server stops reading that socket, and the bytes wait in
the kernel's socket buffer and the sender's, not in the coordinator's memory. Pacing only
moves time: every chunk is still taken, folded and streamed as before.

What it does not do: change how a shared link is split. The bytes of a peer that is ahead
are already across the link when its socket is no longer read, so the pieces still
complete at the slowest flow's pace there (measured on a 200 Mbit/s link, docs/wire.md).

It never waits on an event loop (a small block stored on the loop is not paced), and gives a
round's pacing up for good when a wait sees no piece folded for ``patience`` seconds (at
least ``min_patience``, else four times the longest gap between folds the round has seen):
a peer that stopped must not hold the others' uploads, which the barrier would let through.
Nothing is paced before every expected peer has announced (nothing can fold before).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from threading import Condition

from tensorswap.rounds.core.patience import Patience
from tensorswap.rounds.engine._cut_parse import Announced

__all__ = ["DEFAULT_WINDOW_BYTES", "Pacer", "Pacing"]

log = logging.getLogger(__name__)

DEFAULT_WINDOW_BYTES = 4 * 1024 * 1024
"""The lead a peer may have over the folds: one chunk of the default size (a 4 MiB chunk then
counts once every piece before it has folded; smaller chunks, such as a model's biases, may
run that many bytes ahead, so that a piece of a few KiB does not cost a thread hand-off)."""


@dataclass(slots=True)
class Pacing:
    """One round's pacing state (guarded by the round's lock, ``settled`` its condition)."""

    on: bool = True
    patience: Patience = field(default_factory=Patience)  # pieces folded are the progress
    folded: int = 0
    starts: tuple[int, ...] = ()  # each position's first byte in the update's chunks

    def lead(self, sizes: Callable[[], list[int]], position: int) -> int:
        """Bytes of the update's chunks from the ``folded``-th position up to ``position``
        (``sizes``: every chunk's length in manifest order, asked for once)."""
        if not self.starts:
            start, starts = 0, [0]
            for size in sizes():
                start += size
                starts.append(start)
            self.starts = tuple(starts)
        return self.starts[position] - self.starts[min(self.folded, position)]


class Pacer:
    """The pacing rule (see the module docstring). A chunk goes on while the chunks between
    the pieces folded and it hold less than ``window_bytes`` (so one whole chunk at least)."""

    def __init__(
        self,
        window_bytes: int = DEFAULT_WINDOW_BYTES,
        min_patience: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if window_bytes < 1:
            raise ValueError(f"window_bytes must be positive, not {window_bytes}")
        self.window_bytes = window_bytes
        self.min_patience = min_patience
        self.clock = clock
        self.waits = 0
        """Chunks that waited so far, over all rounds (status: ``cut_paced_waits``)."""
        self.given_up = 0
        """Rounds whose pacing was given up (status: ``cut_pacing_off``)."""

    def folded(self, pacing: Pacing) -> None:
        """A piece of the round folded (the caller holds the round's lock and notifies)."""
        pacing.patience.progressed(self.clock())
        pacing.folded += 1

    def hold(
        self,
        pacing: Pacing,
        settled: Condition,
        got: Announced,
        piece: tuple[int, int],
        live: Callable[[], bool],
    ) -> None:
        """``wait`` for chunk ``piece`` (tensor, chunk) of the announced update ``got``."""
        at = got.position(piece)

        def lead() -> int:
            return pacing.lead(lambda: [c.nbytes for _, c in got.refs()], at)

        self.wait(pacing, settled, lead, live)

    def wait(
        self,
        pacing: Pacing,
        settled: Condition,
        lead: Callable[[], int],
        live: Callable[[], bool],
    ) -> None:
        """Wait while ``lead()`` (the bytes between the pieces folded and this chunk) is
        ``window_bytes`` or more, the round ``live`` and paced; ``settled`` is the round's
        condition, held by the caller."""
        if not pacing.on or _on_event_loop():
            return
        waited = False
        while pacing.on and live() and lead() >= self.window_bytes:
            if not waited:
                self.waits += 1
                waited = True
                if pacing.patience.last is None:
                    pacing.patience.last = self.clock()  # the count starts with the wait
            left, patience = pacing.patience.left(self.clock(), self.min_patience)
            if left <= 0:
                pacing.on = False
                self.given_up += 1
                log.info("cut-through pacing off: no piece folded for %.2f s", patience)
                settled.notify_all()
                return
            settled.wait(left)


def _on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
