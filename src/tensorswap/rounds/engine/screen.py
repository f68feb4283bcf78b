"""Screening a submitted update before it is recorded: its layout; its values folded or checked."""

from __future__ import annotations

from tensorswap.aggregate import AggregatorSpec
from tensorswap.errors import AggregationError, BlockNotFound, CorruptBlock, NonFiniteValues
from tensorswap.rounds.core.errors import InvalidUpdate, UnknownUpdate, UpdateMismatch
from tensorswap.rounds.core.state import Layout, RoundInfo, layout_mismatch
from tensorswap.rounds.engine.fold import RoundWork, count_nonfinite_chunks, load_pieces
from tensorswap.rounds.engine.updates import STREAMING_KINDS, UpdateFacts, check_finite
from tensorswap.store import BlockStore

__all__ = ["check_layout", "screen"]


def check_layout(info: RoundInfo, layout: Layout, peer: str) -> None:
    """UpdateMismatch when the round has a layout and ``layout`` differs from it."""
    if info.layout is not None:
        detail = layout_mismatch(info.layout, layout)
        if detail is not None:
            raise UpdateMismatch(info.round_id.as_key(), peer, detail)


def screen(
    store: BlockStore,
    work: RoundWork,
    spec: AggregatorSpec,
    facts: UpdateFacts,
    key: str,
    peer: str,
    scale: float = 1.0,
    fold: bool = True,
    counted: list[tuple[str, int]] | None = None,
) -> bool:
    """Fold the update into the round's sums (streaming kinds, times ``scale``; unless
    ``fold`` is False: a deterministic round folds at its close, in canonical order) or
    check its values; True if folded. The caller holds ``work.lock``.

    Every chunk is re-hashed as it is read. A chunk that fails its hash check (quarantined by a
    directory store) or vanished refuses the submit with UnknownUpdate: nothing is recorded,
    and the peer's next push sends that block again. ``counted``: each tensor's non-finite
    values as counted when its chunks arrived (a cut-through round, ``rounds.engine.cut``),
    so an update not folded here is checked without reading it back.
    """
    try:
        if fold and spec.kind in STREAMING_KINDS:
            if work.acc is None:
                work.reset(spec)
            pieces, bounds, n = load_pieces(store, facts, work.bounds)
            try:
                work.fold(pieces, bounds, n, facts, scale)
            except NonFiniteValues as exc:
                raise InvalidUpdate(key, peer, f"{exc.count} non-finite values") from exc
            except AggregationError as exc:
                raise InvalidUpdate(key, peer, str(exc)) from exc
            return True
        if spec.non_finite.value == "raise":
            counts = count_nonfinite_chunks(store, facts) if counted is None else counted
            check_finite(counts, key, peer)  # chunk by chunk
        return False
    except (CorruptBlock, BlockNotFound) as exc:
        detail = f"{exc} (push it again: the coordinator lacks it now)"
        raise UnknownUpdate(key, peer, str(facts.cid), detail) from exc
