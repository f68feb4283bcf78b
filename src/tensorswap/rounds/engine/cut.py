"""Cut-through rounds: fold chunk k as soon as every expected contribution's chunk k is in.

A round whose participants are known (``expected_peers``), whose strategy folds (FedAvg, the
mean) without clipping, and whose hooks do not transform its result (``may_stream``) can be
aggregated while it uploads. Each peer first *announces* its update: its manifests (checked
against their CIDs and the round's layout, held here in memory only: the store never shows
a manifest before its chunks), then pushes the chunks in manifest order. Every stored block
the block service hands to ``on_stored`` that is a chunk some announcement names is marked
present (its values kept while they fit ``max_held_bytes``, read back re-hashed otherwise).
When every expected peer has announced and holds chunk k of tensor t, that piece is folded
across them in peer-name order, with the accumulator the barrier path uses, so each value is
the same bit for bit as a deterministic round's; the result's piece is encoded as the
barrier path encodes it, stored, and listed in ``progress`` for peers waiting on the stream
(``rounds.server.cut``). Only hashes checked on receipt (or re-hashed on the read) reach a
fold.

The result is used only if the accepted contributions are exactly the announced ones
(``finish`` then writes the manifests over the pieces stored). Anything else (a peer that
never announced or submits, another layout or chunking, a non-finite piece, a restart)
*abandons* the cut-through: the round aggregates through the barrier path over what it
accepted, and chunks streamed were a prefetch, kept only where its manifest names them.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping

import numpy as np

from tensorswap.cid import Cid, Multicodec
from tensorswap.errors import HashMismatch, TensorSwapError
from tensorswap.rounds.core.state import Contribution, RoundId, RoundInfo, RoundTracker
from tensorswap.rounds.engine._cut_fold import fold_piece
from tensorswap.rounds.engine._cut_memory import ROUNDS_KEPT, CutMemory
from tensorswap.rounds.engine._cut_pace import Pacer
from tensorswap.rounds.engine._cut_parse import (
    Announced,
    AnnounceVerdict,
    parse_announce,
)
from tensorswap.rounds.engine._cut_round import Piece, RoundCut
from tensorswap.rounds.engine.fold import CHUNKS
from tensorswap.rounds.engine.hooks import Admission, HookList
from tensorswap.rounds.engine.result import put_manifests
from tensorswap.rounds.engine.updates import (
    STREAMING_KINDS,
    aggregator_spec,
    count_nonfinite,
)
from tensorswap.store import BlockStore, ChunkRef

__all__ = ["ROUNDS_KEPT", "AnnounceVerdict", "CutThrough"]

log = logging.getLogger(__name__)

DEFAULT_MAX_HELD_BYTES = 64 * 1024 * 1024
"""Received chunk values kept for their fold, over all rounds; beyond, read back re-hashed
(holding more saves a hash per byte, and costs resident memory while peers are out of step)."""

DEFAULT_MAX_ANNOUNCED_BYTES = 256 * 1024 * 1024
"""Announced manifest bytes held over all rounds (each announcement may carry 8 MiB): past
it, ended rounds are forgotten first, then announcements are refused (their rounds go to the
barrier), so hostile announcers cannot grow the coordinator's memory without bound."""


class CutThrough(CutMemory):
    """A coordinator's cut-through state (memory only, thread-safe); see the module docstring.

    ``enabled`` turns it off (every announcement is then refused, and rounds run as
    barriers). ``listeners`` are called ``(round_id)`` from any thread when a round's
    progress changes (a piece stored, an abandonment).
    """

    def __init__(
        self,
        store: BlockStore,
        tracker: RoundTracker,
        hooks: HookList,
        chunk_bytes: Callable[[], int],
        *,
        max_held_bytes: int = DEFAULT_MAX_HELD_BYTES,
        pacer: Pacer | None = None,
        max_announced_bytes: int = DEFAULT_MAX_ANNOUNCED_BYTES,
    ) -> None:
        self.store = store
        self.tracker = tracker
        self.hooks = hooks
        self.enabled = True
        self.max_held_bytes = max_held_bytes
        self.max_announced_bytes = max_announced_bytes
        self.announced_bytes = 0
        """Manifest bytes of the announcements remembered, over all rounds."""
        self.pacer = pacer or Pacer()
        """Keeps the uploads in step (``_cut_pace``: a peer far ahead waits for the others)."""
        self.listeners: list[Callable[[RoundId], None]] = []
        self._chunk_bytes = chunk_bytes
        self._rounds: OrderedDict[RoundId, RoundCut] = OrderedDict()
        self._index: dict[Cid, list[tuple[RoundId, str, Piece]]] = {}
        self._held_bytes = 0
        self._lock = threading.Lock()  # the rounds and the index; a round's own lock inside
        self.folded = 0
        """Pieces folded at arrival so far (for tests and status)."""

    # ── announcements ────────────────────────────────────────────────────────
    def announce(
        self, round_id: RoundId, peer: str, cid: Cid, blocks: Mapping[Cid, bytes]
    ) -> AnnounceVerdict:
        """Take ``peer``'s announcement of update ``cid`` (its manifest blocks) for the round.

        Refusals are verdicts, not errors: the peer then submits as it would have (the round
        is a barrier); a refusal that leaves the round unable to cut through abandons it. A
        block that does not hash to its CID raises HashMismatch (the peer sent bad bytes)."""
        size = self._chunk_bytes()
        if not self.enabled:
            return AnnounceVerdict(False, "cut-through is off on this coordinator", size)
        info = self.tracker.info(round_id)
        reason = self._ineligible(info)
        if reason is not None or info is None:
            return AnnounceVerdict(False, reason or "no such round", size)
        try:
            self.hooks.admit(Admission(round_id, peer, 1.0))  # as its submit will be
            self.tracker.check_submit(round_id, peer)
            got = parse_announce(info, peer, cid, blocks, size)
        except HashMismatch:
            raise
        except TensorSwapError as exc:  # it may be cut again; if not, the round's end tells
            return AnnounceVerdict(False, str(exc), size)
        with self._lock:
            rc = self._rounds.get(round_id)
            forgotten = []
            if rc is None:
                spec = aggregator_spec(info.spec)
                rc = RoundCut(spec, info.spec.expected_peers, info.layout)
                self._rounds[round_id] = rc
                forgotten = self._evict()
            room = self._make_room(got.nbytes, round_id, forgotten)
            if room:
                self.announced_bytes += got.nbytes  # reserved: given back unless admitted
        for rid in forgotten:
            self._notify(rid)
        if not room:
            reason = f"the coordinator holds {self.max_announced_bytes} bytes of announcements"
            return AnnounceVerdict(False, reason, size)
        try:
            verdict = self._admit(round_id, rc, got, size)
        finally:
            with rc.lock:
                admitted = rc.announced.get(got.peer) is got
            if not admitted:
                with self._lock:
                    self.announced_bytes -= got.nbytes
        if verdict.ok:  # chunks it already held (a frozen layer) may complete pieces
            self._try_fold(round_id, rc)
        return verdict

    def _ineligible(self, info: RoundInfo | None) -> str | None:
        if info is None:
            return "no such round"
        if info.status.is_terminal or info.status.name == "Aggregating":
            return f"the round is {info.status.name}"
        spec = aggregator_spec(info.spec)
        if spec.kind not in STREAMING_KINDS or spec.max_norm is not None:
            return f"strategy {info.spec.strategy!r} does not fold unclipped"
        if not self.hooks.may_stream(info.round_id):
            return "a hook transforms this round's result"
        return None

    def _admit(self, rid: RoundId, rc: RoundCut, got: Announced, size: int) -> AnnounceVerdict:
        with rc.lock:
            if rc.abandoned is not None:
                return AnnounceVerdict(False, rc.abandoned, size)
            known = rc.announced.get(got.peer)
            if known is not None:
                if known.cid == got.cid:
                    return AnnounceVerdict(True, "", size)
                reason = f"{got.peer!r} announced a second update"
                self._abandon_locked(rid, rc, reason)
                return AnnounceVerdict(False, reason, size)
            if len(rc.announced) >= rc.expected:
                return AnnounceVerdict(False, "every expected peer has announced", size)
            first = next(iter(rc.announced.values()), None)
            if first is not None and first.bounds != got.bounds:
                reason = f"{got.peer!r}'s update is laid out or cut differently"
                self._abandon_locked(rid, rc, reason)
                return AnnounceVerdict(False, reason, size)
            rc.layout = rc.layout or got.layout
            rc.announced[got.peer] = got
            if len(rc.announced) == rc.expected:
                # pieces fold by peer name: the round becomes deterministic (journaled), so a
                # barrier (after a restart, or a fallback) folds the same way, the same bits
                if not self.tracker.make_deterministic(rid):
                    reason = "a contribution was accepted before every peer announced"
                    self._abandon_locked(rid, rc, reason)
                    return AnnounceVerdict(False, reason, size)
                rc.order = tuple(sorted(rc.announced))
        if rc.order:
            self._notify(rid)  # a stream waiting to hear it may go on
        with self._lock:  # not after an abandonment's unindexing (which holds this lock)
            with rc.lock:
                live = rc.abandoned is None and not rc.ended
            if live:
                for piece, chunk in got.chunks():
                    self._index.setdefault(chunk, []).append((rid, got.peer, piece))
        held = [p for p, chunk in got.chunks() if self.store.has(chunk)]  # after the index
        with rc.lock:
            for piece in held:
                rc.present.setdefault(piece, set()).add(got.peer)
        return AnnounceVerdict(True, "", size)

    # ── arrivals ─────────────────────────────────────────────────────────────
    def on_stored(self, cid: Cid, data: memoryview) -> None:
        """A block the block service checked and stored (any thread): marks the announced
        chunks it is present, keeps their values for the fold while they fit, folds the
        pieces it completes. Never raises (a failure abandons the round it concerns)."""
        if cid.codec is Multicodec.TENSORSWAP_MANIFEST:
            return
        with self._lock:
            entries = self._index.pop(cid, None)
        if not entries:
            return
        for rid, peer, piece in entries:
            rc = self._rounds.get(rid)
            if rc is None:
                continue
            self._pace(rc, peer, piece)
            try:
                self._arrived(rc, peer, piece, data)
            except Exception as exc:  # the round falls back; the block stays stored
                self._abandon(rid, rc, f"reading a chunk at arrival failed: {exc}")
            self._try_fold(rid, rc)

    def _pace(self, rc: RoundCut, peer: str, piece: Piece) -> None:
        """Hold this sink thread while ``peer`` is too far ahead of the round's folds."""
        with rc.lock:
            got = rc.announced.get(peer)
            if got is None or not rc.order:  # nothing folds before every peer announced
                return
            live = lambda: rc.abandoned is None and not rc.ended  # noqa: E731
            self.pacer.hold(rc.pacing, rc.settled, got, piece, live)

    def _arrived(self, rc: RoundCut, peer: str, piece: Piece, data: memoryview) -> None:
        with rc.lock:
            got = rc.announced.get(peer)
            if got is None or rc.abandoned is not None or piece in rc.results:
                return
        values = CHUNKS.decode(data, got.tensors[piece[0]], piece[1])  # a view of the slab
        bad = count_nonfinite(values)  # the submit's screening need not read it back
        nbytes = values.nbytes  # what holding them keeps (a compressed block decodes anew)
        with self._lock:
            keep = self._held_bytes + nbytes <= self.max_held_bytes
            if keep:
                self._held_bytes += nbytes
        # present, counted and held at once: a fold another thread starts on seeing this
        # peer present finds its values, and none is kept for a piece folded or let go
        with rc.lock:
            live = rc.abandoned is None and not rc.ended and piece not in rc.results
            if live:
                rc.present.setdefault(piece, set()).add(peer)
                rc.nonfinite.setdefault(peer, {})[piece] = bad
                if keep:
                    rc.held[(piece, peer)] = values
        if keep and not live:
            with self._lock:
                self._held_bytes -= nbytes

    # ── folding ──────────────────────────────────────────────────────────────
    def _try_fold(self, rid: RoundId, rc: RoundCut) -> None:
        """Fold every piece all expected peers hold (each once, in the caller's thread); a
        failure (a non-finite piece, an unreadable chunk) abandons the round, never raises."""
        try:
            self._fold_ready(rid, rc)
        except Exception as exc:  # the barrier path decides what it means
            self._abandon(rid, rc, f"folding at arrival failed: {exc}")

    def _fold_ready(self, rid: RoundId, rc: RoundCut) -> None:
        while True:
            with rc.lock:
                if rc.abandoned is not None or not rc.order:
                    return
                ready = [
                    p
                    for p, peers in rc.present.items()
                    if p not in rc.results and len(peers) >= rc.expected
                ]
                if not ready:
                    return
                piece = ready[0]
                rc.results[piece] = _CLAIMED  # no other thread folds it meanwhile
                inputs = [(rc.announced[p], rc.held.pop((piece, p), None)) for p in rc.order]
            try:
                ref = fold_piece(self.store, rc.spec, rc.layout, piece, inputs)
            except BaseException:
                with rc.lock:  # not claimed any more (the caller abandons the round)
                    rc.results.pop(piece, None)
                    rc.settled.notify_all()
                raise
            finally:
                self._release(inputs)
            with rc.lock:
                rc.results[piece] = ref
                rc.progress.append(ref.cid)
                rc.present.pop(piece, None)
                self.folded += 1
                self.pacer.folded(rc.pacing)
                rc.settled.notify_all()
            self._notify(rid)

    def _release(self, inputs: list[tuple[Announced, np.ndarray | None]]) -> None:
        freed = sum(values.nbytes for _, values in inputs if values is not None)
        if freed:
            with self._lock:
                self._held_bytes -= freed

    # ── the round's end ──────────────────────────────────────────────────────
    def claim(self, round_id: RoundId, peer: str, cid: Cid) -> bool:
        """Whether ``peer``'s update ``cid`` is folded here (the intake then need not fold
        it); a contribution the cut-through cannot hold (not announced, another update, or
        before every peer announced) abandons it: the round is a barrier from then on. (A
        submit before the last announcement does not make the round deterministic: a round
        that also takes regions' partials, whose links never announce, must stay as it was
        started, ``UpstreamIncompatible``.)"""
        rc = self._rounds.get(round_id)
        if rc is None:
            return False
        with rc.lock:
            got = rc.announced.get(peer)
            if rc.abandoned is None and got is not None and got.cid == cid and rc.order:
                return True
        self._abandon(round_id, rc, f"{peer!r} submitted what the cut-through cannot fold")
        return False

    def nonfinite(self, round_id: RoundId, peer: str, cid: Cid) -> list[tuple[str, int]] | None:
        """Per tensor of ``peer``'s covered update, its NaN and infinite values as counted
        when its chunks arrived (checked then); None unless every chunk was counted so."""
        rc = self._rounds.get(round_id)
        if rc is None:
            return None
        with rc.lock:
            got, counts = rc.announced.get(peer), dict(rc.nonfinite.get(peer, {}))
        if got is None or got.cid != cid or rc.abandoned is not None:
            return None
        totals = {tensor.name: 0 for tensor in got.tensors}
        for piece, _ in got.chunks():
            if piece not in counts:
                return None
            totals[got.tensors[piece[0]].name] += counts[piece]
        return list(totals.items())

    def finish(
        self, info: RoundInfo, live: list[Contribution], metadata: dict[str, str]
    ) -> Cid | None:
        """The round's aggregate from the pieces folded at arrival, its manifests stored; None
        when the accepted contributions (``live``) are not exactly those announced, or a
        piece is missing (the caller takes the barrier path; this round's state goes)."""
        rid = info.round_id
        rc = self._rounds.get(rid)
        if rc is None:
            return None
        with rc.lock:
            # a piece a sink thread is folding now is waited for (a fold ends or fails)
            while rc.abandoned is None and _CLAIMED in rc.results.values():
                rc.settled.wait()
            announced = {p: a.cid for p, a in rc.announced.items()}
            got = {c.peer: Cid.parse(c.update_cid) for c in live if c.scale == 1.0}
            whole = len(rc.results) == rc.pieces and _CLAIMED not in rc.results.values()
            if rc.abandoned is not None or announced != got or len(got) != len(live) or not whole:
                why = rc.abandoned or "the accepted contributions are not those announced"
                reason = why if whole or rc.abandoned else "pieces are still missing"
                rc.abandoned = rc.abandoned or reason
                layout, results = None, {}
            else:
                layout, results = rc.layout, dict(rc.results)
        if layout is None:
            log.info("round %s: cut-through not used (%s); barrier aggregation", rid, reason)
            self._end(rid, rc)
            return None
        samples = sum(a.num_samples for a in rc.announced.values())
        cid = put_manifests(self.store, layout, results, samples, metadata, rid.as_key())
        self._end(rid, rc)
        return cid

    def stats(self) -> dict[str, int]:
        """Counters (``tensorswap status``): arrived values held, chunks awaited, rounds
        remembered, pieces folded at arrival so far."""
        with self._lock:
            return {"cut_held_bytes": self._held_bytes, "cut_awaited_chunks": len(self._index),
                    "cut_rounds": len(self._rounds), "cut_folded": self.folded,
                    "cut_paced_waits": self.pacer.waits,
                    "cut_pacing_off": self.pacer.given_up}  # fmt: skip

    def remembered(self) -> tuple[list[RoundId], set[RoundId]]:
        """The rounds whose state is remembered, and those with chunks still awaited."""
        with self._lock:
            awaited = {entry[0] for entries in self._index.values() for entry in entries}
            return list(self._rounds), awaited

    def state(self, round_id: RoundId) -> tuple[list[Cid], str | None] | None:
        """``(progress, abandoned)`` for the stream: the result chunks stored so far, in
        order, and why the round was abandoned (None if not); None when this coordinator
        holds no cut-through state for the round."""
        rc = self._rounds.get(round_id)
        if rc is None:
            return None
        with rc.lock:
            return list(rc.progress), rc.abandoned

    def ready(self, round_id: RoundId) -> bool:
        """Whether every expected peer of the round has announced (its pieces can fold)."""
        rc = self._rounds.get(round_id)
        return rc is not None and bool(rc.order)

    def peer_blocks(self, round_id: RoundId, peer: str) -> list[Cid]:
        """The blocks of ``peer``'s announced update (which a stream need not send it)."""
        rc = self._rounds.get(round_id)
        if rc is None:
            return []
        with rc.lock:
            got = rc.announced.get(peer)
        return [] if got is None else got.closure

    def abandon(self, round_id: RoundId, reason: str) -> None:
        """Give the round's cut-through up (its streams are told; it aggregates as a barrier)."""
        rc = self._rounds.get(round_id)
        if rc is not None:
            self._abandon(round_id, rc, reason)

    # ── internals ────────────────────────────────────────────────────────────
    def _abandon(self, rid: RoundId, rc: RoundCut, reason: str) -> None:
        with rc.lock:
            self._abandon_locked(rid, rc, reason)
        self._drop_held(rc)
        self._unindex(rid, rc)  # its chunks that never came are not waited for
        self._notify(rid)

    def _abandon_locked(self, rid: RoundId, rc: RoundCut, reason: str) -> None:
        if rc.abandoned is None:
            rc.abandoned = reason
            rc.settled.notify_all()
            log.info("round %s: cut-through abandoned: %s", rid, reason)

    def _drop_held(self, rc: RoundCut) -> None:
        with rc.lock:
            held, rc.held = rc.held, {}
        freed = sum(v.nbytes for v in held.values())
        with self._lock:
            self._held_bytes -= freed

    def _end(self, rid: RoundId, rc: RoundCut) -> None:
        with rc.lock:
            rc.ended = True
            rc.settled.notify_all()  # a paced sink thread goes on
        self._drop_held(rc)
        self._unindex(rid, rc)
        self._notify(rid)

    def _unindex(self, rid: RoundId, rc: RoundCut) -> None:
        with self._lock:
            self._unindex_locked(rid, rc)

    def _unindex_locked(self, rid: RoundId, rc: RoundCut) -> None:
        """The round's announced chunks out of the index; the caller holds ``self._lock``."""
        with rc.lock:
            chunks = [chunk for got in rc.announced.values() for _, chunk in got.chunks()]
        for chunk in chunks:
            entries = self._index.get(chunk)
            if entries is not None:
                entries[:] = [e for e in entries if e[0] != rid]
                if not entries:
                    del self._index[chunk]

    def _notify(self, rid: RoundId) -> None:
        for listener in list(self.listeners):
            listener(rid)


_CLAIMED = ChunkRef(Cid.of(b"").to_bytes(), 0, 0)
"""A piece being folded by some thread (not yet stored)."""
