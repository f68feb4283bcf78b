"""A round's aggregate from its accepted contributions: every read verified, unreadable ones
dropped (and recorded), the result stored as a model update in the round's layout."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sized

import numpy as np

from tensorswap.aggregate import Contribution as AggregateInput
from tensorswap.aggregate import aggregate
from tensorswap.cid import Cid
from tensorswap.codec import DType
from tensorswap.errors import BlockNotFound, CorruptBlock
from tensorswap.rounds.core.errors import ContributionsLost, NonFiniteAggregate
from tensorswap.rounds.core.state import Contribution, Layout, RoundInfo
from tensorswap.rounds.engine.cut import CutThrough
from tensorswap.rounds.engine.fold import RoundWork, assemble, load_chunk
from tensorswap.rounds.engine.refold import UNREADABLE, catch_up, facts_of
from tensorswap.rounds.engine.result import put_pieces
from tensorswap.rounds.engine.updates import (
    STREAMING_KINDS,
    aggregator_spec,
    count_nonfinite,
)
from tensorswap.store import (
    DEFAULT_CHUNK_BYTES,
    BlockStore,
    MalformedManifest,
    ModelUpdate,
    get_update,
    put_update,
)

__all__ = ["UNREADABLE", "Drop", "compute_aggregate", "facts_of"]

log = logging.getLogger(__name__)

Drop = Callable[[str, str], None]
"""``drop(peer, reason)``: record that an accepted contribution is left out of the aggregate."""


def _read_inputs(
    store: BlockStore,
    live: list[Contribution],
    lose: Callable[[Contribution, Exception], None],
) -> list[AggregateInput]:
    """Every live contribution read back (re-hashed), scaled by its staleness factor; one
    that is unreadable goes to ``lose`` instead."""
    inputs = []
    for c in live:
        try:
            update = get_update(store, Cid.parse(c.update_cid), verify=True)
        except UNREADABLE as exc:
            lose(c, exc)
            continue
        tensors = dict(update.tensors)
        if c.scale != 1.0:  # an asynchronous run's staleness factor
            tensors = {k: v * v.dtype.type(c.scale) for k, v in tensors.items()}
        inputs.append(AggregateInput(tensors, c.num_samples))
    return inputs


def compute_aggregate(
    store: BlockStore,
    info: RoundInfo,
    contributions: list[Contribution],
    work: RoundWork,
    drop: Drop,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    cut: CutThrough | None = None,
) -> Cid:
    """Aggregate the round's contributions (less those dropped before) and store the result,
    its tensors cut into chunks of ``chunk_bytes`` (the coordinator's ``result_chunk_bytes``).

    Streaming kinds (FedAvg, mean) use the sums folded at submit time and fold the rest (after
    a restart, or a rebuild) in fold order; other strategies read every contribution back,
    in the same order. A deterministic round folds here, in canonical order (by peer name),
    each contribution read back from its chunk blocks (one contribution mapped at a time,
    let go before the next). Every block is
    re-hashed on the read that feeds the aggregate. A contribution whose blocks fail that
    check or are missing is dropped through ``drop`` with the reason; if fewer than the
    round's quorum remain, ContributionsLost is raised and nothing is stored. An aggregate
    that would hold NaN or Inf (finite contributions whose sum overflowed) raises
    NonFiniteAggregate and nothing is stored, unless the strategy propagates non-finite
    values on purpose (``non_finite=propagate``). Errors from storing the result (a full
    disk) propagate for the caller to retry. With ``cut``, a round whose pieces were all
    folded at arrival over exactly the contributions accepted (``rounds.engine.cut``) only
    has its manifests stored: the same values, read back from nothing.
    """
    spec = aggregator_spec(info.spec)
    gone = info.dropped_peers
    live = [c for c in contributions if c.peer not in gone]
    if info.spec.deterministic:  # canonical order: the arrival order changes no bit
        live.sort(key=lambda c: c.peer)
    lost: dict[str, str] = {}

    def lose(contribution: Contribution, exc: Exception) -> None:
        reason = f"unreadable: {exc}"
        log.warning(
            "round %s: contribution from %r (%s) dropped: %s",
            info.round_id,
            contribution.peer,
            contribution.update_cid,
            reason,
        )
        lost[contribution.peer] = reason
        drop(contribution.peer, reason)

    with work.lock:
        if spec.kind in STREAMING_KINDS:
            done = None if cut is None else cut.finish(info, live, result_metadata(info, live, ()))
            if done is not None:
                work.reset()
                return done
            # after a restart, or a rebuild: fold what is missing, in fold order
            catch_up(store, work, spec, live, lose)
            kept = [c for c in live if c.peer not in lost]
            _check_quorum(info, len(kept), lost)
            # shared chunks are exact only when no contribution is clipped or scaled
            exact = spec.max_norm is None and all(c.scale == 1.0 for c in kept)
            guard = None if spec.non_finite.value == "propagate" else kept
            return _store_streaming(store, info, kept[0], work, exact, chunk_bytes, guard)
        inputs = _read_inputs(store, live, lose)
        _check_quorum(info, len(inputs), lost)
        result = aggregate(inputs, spec)
        del inputs
        values = result.values
        assert isinstance(values, dict)  # inputs were dicts, so the aggregate is one too
        for layer in info.layout or ():
            want = DType.parse(layer.dtype).numpy
            if values[layer.name].dtype != want:
                values[layer.name] = values[layer.name].astype(want)
        if spec.non_finite.value != "propagate":
            _check_finite(info, values.items(), [c for c in live if c.peer not in lost])
    metadata = result_metadata(info, result.used, result.dropped)
    update = ModelUpdate(values, result.total_samples, metadata, name=info.round_id.as_key())
    return put_update(store, update, chunk_bytes=chunk_bytes)


def _check_quorum(info: RoundInfo, left: int, lost: dict[str, str]) -> None:
    quorum = max(info.spec.min_peers, 1)
    if lost and left < quorum:
        raise ContributionsLost(info.round_id.as_key(), left, quorum, lost)
    if left < 1:
        raise ContributionsLost(info.round_id.as_key(), left, quorum, dict(info.dropped))


def _store_streaming(
    store: BlockStore,
    info: RoundInfo,
    first: Contribution,
    work: RoundWork,
    exact_shared: bool,
    chunk_bytes: int,
    finite_among: list[Contribution] | None = None,
) -> Cid:
    """Store the streaming sums' result; the caller holds ``work.lock``. ``first``: a folded
    contribution, whose layout is the round's when the round has none recorded; with
    ``finite_among`` (the folded contributions) NonFiniteAggregate for a non-finite piece."""
    assert work.acc is not None and work.bounds is not None
    bounds, same = work.bounds, work.same or {}
    try:  # the sums become the result (divided in place): one model's memory, not two
        result = work.acc.result(consume=True)
    finally:
        work.reset()  # spent either way: a retry folds again from the stored contributions
    layout: Layout = info.layout or facts_of(store, first).layout
    pieces: dict[str, np.ndarray] = result.values  # type: ignore[assignment]
    if exact_shared:
        # A piece every contribution stored as the same chunk averages to that chunk: take
        # its values as they are, bit for bit, so a frozen layer's aggregate is the block every
        # peer already holds (float32 sums are off by an ulp or two); clipping would scale
        # it, so not then. A chunk that fails its check now keeps the computed sum.
        for key, source in same.items():
            if key in pieces:
                try:
                    pieces[key] = load_chunk(store, source)
                except (CorruptBlock, BlockNotFound, MalformedManifest) as exc:
                    log.warning(
                        "round %s: shared chunk unreadable, sum kept: %s", info.round_id, exc
                    )
    if finite_among is not None:
        named = ((key.partition("@")[2], piece) for key, piece in pieces.items())
        _check_finite(info, named, finite_among)
    metadata = result_metadata(info, result.used, result.dropped)
    name = info.round_id.as_key()
    # chunk by chunk from the pieces when they are cut as put_update cuts
    cid = put_pieces(
        store,
        pieces,
        bounds,
        layout,
        num_samples=result.total_samples,
        metadata=metadata,
        name=name,
        chunk_bytes=chunk_bytes,
    )
    if cid is not None:
        return cid
    values = assemble(pieces, bounds, layout)
    update = ModelUpdate(values, result.total_samples, metadata, name=name)
    return put_update(store, update, chunk_bytes=chunk_bytes)


def _check_finite(
    info: RoundInfo, values: Iterable[tuple[str, np.ndarray]], contributions: list[Contribution]
) -> None:
    """NonFiniteAggregate naming the first tensor in ``values`` (name, values) with NaN or
    Inf (one pass, in bounded steps: ``count_nonfinite``)."""
    for name, piece in values:
        bad = count_nonfinite(piece)
        if bad:
            peers = ", ".join(repr(c.peer) for c in contributions[:8])
            more = f" and {len(contributions) - 8} more" if len(contributions) > 8 else ""
            raise NonFiniteAggregate(info.round_id.as_key(), name, bad, f"peers {peers}{more}")


def result_metadata(info: RoundInfo, used: Sized, dropped: Sized) -> dict[str, str]:
    """The metadata stored with a round's aggregate."""
    return {
        "round": info.round_id.as_key(),
        "strategy": info.spec.strategy,
        "contributors": str(len(used)),
        "dropped": str(len(dropped)),
    }
