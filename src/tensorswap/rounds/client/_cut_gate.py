"""Keeping a cut-through peer's own upload in step with the round: pacing at the sender.

A cut-through piece folds when the *slowest* expected peer's chunk of it is in. On a shared
link TCP does not split the bandwidth evenly (one flow at twice another's rate for seconds),
so a peer far ahead takes link time from the slowest, whose chunks every fold waits for:
on a 200 Mbit/s link the first piece folded 0.3-0.4 s after the uploads began, and the
round's download, which can only start then, ended that much later. The coordinator's own
pacing (``rounds.engine._cut_pace``) cannot fix this: the bytes of a peer ahead are across
the link by the time it stops reading them.

``UploadGate`` holds a peer's next chunk while it is ``lead_bytes`` or more (and at least
``MIN_LEAD`` chunks) past the pieces its result stream has brought back, which are the
pieces the round has folded. The link's share then goes to the peers behind, and the
pieces complete at the link's pace rather than its slowest flow's. Since the stream counts
pieces that have also come back down, a peer whose download is slower than its upload paces
its upload to its download (the round's result reaches it no sooner either way).

Nothing is paced before every expected peer has announced (nothing folds before; a peer
that is early must not wait for the late ones): the stream says when (``StreamAnswer.ready``,
``arm``), and a coordinator that predates it never does, so its rounds are not paced.

Pacing only moves time. It never holds a chunk that a fold waits for: every piece before the
one held has been sent by this peer, and a piece the others hold back is one this peer is
ahead on. It stops for good when the stream ends (the round finished, or went back to the
barrier) and when no piece has come for ``patience`` seconds (``min_patience``, or four
times the longest gap between pieces seen so far if longer): a stalled peer elsewhere must not
hold this one's upload, which the barrier would let through.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from tensorswap.cid import Cid
from tensorswap.rounds.core.patience import Patience
from tensorswap.store import BlockStore, read_manifest
from tensorswap.store.manifest import TensorManifest

__all__ = ["DEFAULT_LEAD_BYTES", "MIN_LEAD", "UploadGate"]

log = logging.getLogger(__name__)

DEFAULT_LEAD_BYTES = 1024 * 1024
"""How far (bytes of its own chunks) a peer may run ahead of the pieces streamed back."""
MIN_LEAD = 2
"""Chunks a peer may always run ahead (one on the wire, one being folded and streamed)."""


class UploadGate:
    """The sender-side pacing of one peer's upload in one round (see the module docstring).

    ``starts``: each chunk position's first byte in the update's chunks, in manifest order
    (one more entry than chunks); ``positions``: each chunk CID's first position."""

    def __init__(
        self,
        positions: dict[Cid, int],
        starts: tuple[int, ...],
        *,
        lead_bytes: int = DEFAULT_LEAD_BYTES,
        min_patience: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if lead_bytes < 1:
            raise ValueError(f"lead_bytes must be positive, not {lead_bytes}")
        self.positions = positions
        self.starts = starts
        self.lead_bytes = lead_bytes
        self.min_patience = min_patience
        self.clock = clock
        self.on = True
        """False once the stream ended or the round's pacing was given up."""
        self.armed = False
        """True once every expected peer has announced (before, nothing folds: no pacing)."""
        self.streamed = 0
        """Result pieces the stream has brought so far."""
        self.waits = 0
        """Chunks that waited before they were sent."""
        self.given_up = False
        self._patience = Patience()  # pieces streamed back are the progress
        self._changed = asyncio.Event()

    @classmethod
    def of(cls, store: BlockStore, update: Cid, **options: object) -> UploadGate:
        """The gate of the update ``update`` in ``store`` (its manifests read from there)."""
        positions: dict[Cid, int] = {}
        starts = [0]
        for link in read_manifest(store, update).links():
            tensor = read_manifest(store, link)
            if not isinstance(tensor, TensorManifest):
                continue
            for chunk in tensor.chunks:
                positions.setdefault(chunk.cid, len(starts) - 1)
                starts.append(starts[-1] + chunk.nbytes)
        return cls(positions, tuple(starts), **options)  # type: ignore[arg-type]

    # ── what the stream tells ────────────────────────────────────────────────
    def progressed(self, streamed: int) -> None:
        """The stream has brought ``streamed`` pieces in all."""
        if streamed <= self.streamed:
            return
        self._patience.progressed(self.clock())
        self.streamed = streamed
        self._changed.set()

    def arm(self) -> None:
        """Every expected peer has announced: pieces fold from now on."""
        if not self.armed:
            self.armed = True
            self._changed.set()

    def close(self) -> None:
        """The stream ended: nothing waits any more."""
        self.on = False
        self._changed.set()

    # ── the rule ─────────────────────────────────────────────────────────────
    def due(self, position: int) -> float | None:
        """How long (at most) the chunk at ``position`` waits before it is looked at again;
        None: it goes now. Gives the round's pacing up when it waited ``patience``."""
        if not (self.on and self.armed) or not 0 <= position < len(self.starts) - 1:
            return None
        ahead = position - self.streamed
        if ahead < MIN_LEAD:
            return None
        if self.starts[position] - self.starts[self.streamed] < self.lead_bytes:
            return None
        left, patience = self._patience.left(self.clock(), self.min_patience)
        if left <= 0:
            self.on = False
            self.given_up = True
            log.info("cut-through upload pacing off: no piece came back for %.2f s", patience)
            return None
        return left

    async def before(self, cid: Cid) -> None:
        """Wait until the chunk ``cid`` may be sent (at once if it is not one of the update's
        chunks)."""
        position = self.positions.get(cid)
        if position is None:
            return
        waited = False
        while (left := self.due(position)) is not None:
            if not waited:
                self.waits += 1
                waited = True
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)
