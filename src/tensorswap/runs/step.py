"""A run's step: the round's aggregate and the server optimizer make the next global version."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from tensorswap.aggregate import quiet, server_optimizer
from tensorswap.aggregate.server_opt import ServerOptimizer
from tensorswap.cid import Cid
from tensorswap.errors import AggregationError, RoundsError
from tensorswap.rounds.core import Contribution, RoundSpec
from tensorswap.rounds.engine import aggregator_spec
from tensorswap.runs.errors import FutureVersion, InvalidRunSpec, StaleContribution
from tensorswap.runs.finite import FiniteGuard
from tensorswap.runs.model import RunInfo, RunMode, RunSpec, VersionRecord
from tensorswap.runs.stream import stream_step
from tensorswap.store import BlockStore, ModelUpdate, get_update, put_update

__all__ = ["apply_step", "check_policies", "check_staleness"]


def check_policies(spec: RunSpec) -> None:
    """InvalidRunSpec unless the spec's strategy and server optimizer (with their options)
    exist (AccountantUnavailable for a noised DP run without dp-accounting): checked when
    a run is created, not at its first step."""
    try:
        aggregator_spec(RoundSpec(1, strategy=spec.strategy, params=spec.params))
        hyper: dict[str, Any] = dict(spec.optimizer_params)
        server_optimizer(spec.optimizer, **hyper)
    except (AggregationError, RoundsError) as exc:
        raise InvalidRunSpec(f"run spec: {exc}") from exc
    if spec.dp_clip is not None and spec.dp_noise > 0:
        from tensorswap.privacy.accountant import check_available

        check_available()  # AccountantUnavailable now, not at the first step
    if spec.secagg:
        _check_secagg(spec)


def _check_secagg(spec: RunSpec) -> None:
    """InvalidRunSpec without ``cryptography``, or (with ``per_round``) when the SecAgg+
    parameters cannot serve a round of that size."""
    try:
        from tensorswap.privacy.secagg.errors import SecAggError
        from tensorswap.privacy.secagg.protocol import make_config
        from tensorswap.runs.secure import secagg_weight
    except ModuleNotFoundError as exc:
        raise InvalidRunSpec(
            f"secure aggregation needs the privacy extra (pip install tensorswap[privacy]): {exc}"
        ) from exc
    if spec.per_round is None:
        return  # the sample size is known per round: a round that cannot run fails
    try:
        make_config(
            range(spec.per_round),
            1,
            threshold=spec.secagg_threshold,
            bits=spec.secagg_bits,
            clip=spec.secagg_clip or spec.dp_clip or 1.0,
            max_weight=secagg_weight(spec),
            min_survivors=spec.secagg_min_survivors,
        )
    except SecAggError as exc:
        raise InvalidRunSpec(f"run spec: {exc}") from exc


def check_staleness(info: RunInfo, peer: str, trained_on: int | None) -> float:
    """The scale of an asynchronous contribution trained on version ``trained_on``:
    ``spec.scale_for(current - trained_on)``. StaleContribution past ``max_staleness``,
    FutureVersion from a version that does not exist yet; ValueError without ``trained_on``."""
    if trained_on is None:
        raise ValueError(f"run {info.name!r} is asynchronous: submit with trained_on=<version>")
    if trained_on > info.version:
        raise FutureVersion(info.name, peer, trained_on, info.version)
    staleness = info.version - trained_on
    if staleness > info.spec.max_staleness:
        raise StaleContribution(info.name, peer, trained_on, info.version, info.spec.max_staleness)
    return info.spec.scale_for(staleness)


def apply_step(
    store: BlockStore,
    info: RunInfo,
    aggregate_cid: Cid,
    contributions: Sequence[Contribution],
    trained_on: dict[str, int] | None = None,
    *,
    delta: bool = False,
    source: str = "aggregate",
) -> VersionRecord:
    """Version ``info.version + 1``: the server optimizer (with the state journaled for the
    current version) stepped from the current global model and the round's aggregate; both
    the new model and the new state are stored as model updates. A function of those CIDs
    alone, so a step repeated after a restart gives the very same CIDs.

    In an asynchronous run the aggregate is the mean delta (peers submit their update minus
    the global model they trained from): the optimizer sees ``current + delta`` as Flower's
    aggregated model. So in a differentially private run (``delta``): its aggregate is the
    noised mean delta.

    Nothing non-finite is ever named: the aggregate (``source``: what released it), the new
    model and the new state are checked chunk by chunk as they are made, and NaN or Inf
    raises NonFiniteStep (``FiniteGuard``) before any manifest names the result.
    """
    spec = info.spec
    version = info.version + 1
    hyper: dict[str, Any] = dict(spec.optimizer_params)
    optimizer = server_optimizer(spec.optimizer, **hyper)
    meta = {"run": info.name, "version": str(version), "optimizer": spec.optimizer}
    name = f"{info.name}@{version}"
    state = info.state_cid
    delta = delta or spec.mode is RunMode.ASYNC
    guard = FiniteGuard.of(info, contributions)
    streamed = stream_step(
        store,
        optimizer,
        version,
        info.global_cid,
        aggregate_cid,
        state,
        delta=delta,
        metadata=meta,
        name=name,
        guard=guard,
        source=source,
    )
    if streamed is None:  # not laid out for chunk-by-chunk: whole models, same result
        streamed = _whole_step(
            store, info, optimizer, aggregate_cid, version, delta, meta, name, (guard, source)
        )
    global_cid, state_cid = streamed
    peers = tuple(c.peer for c in contributions)
    seen = trained_on or {}
    staleness = tuple(info.version - seen[p] for p in peers if p in seen)
    return VersionRecord(
        version,
        global_cid,
        state_cid,
        info.round,
        peers,
        staleness if len(staleness) == len(peers) else (),
        time.time(),
    )


@quiet  # overflow is not a warning here: the guard refuses what it made
def _whole_step(
    store: BlockStore,
    info: RunInfo,
    optimizer: ServerOptimizer,
    aggregate_cid: Cid,
    version: int,
    delta: bool,
    meta: dict[str, str],
    name: str,
    checked: tuple[FiniteGuard, str],
) -> tuple[Cid, Cid | None]:
    """``stream_step``'s result from whole models in memory (any dtype, any chunking),
    checked by ``checked`` (the guard, the aggregate's source) before anything is stored."""
    guard, source = checked
    current = {k: np.asarray(v) for k, v in _load(store, info.global_cid).items()}
    aggregate = _load(store, aggregate_cid)
    guard.check_all(source, aggregate)
    if delta:
        aggregate = {
            k: current[k] + np.asarray(v, dtype=current[k].dtype) for k, v in aggregate.items()
        }
    if info.state_cid is not None:
        optimizer.load_state(_load(store, info.state_cid))
    stepped = optimizer.step(current, aggregate, version)
    new = {k: stepped[k].astype(current[k].dtype, copy=False) for k in current}
    guard.check_all("optimizer step", new)
    guard.check_all("optimizer state", optimizer.state)
    global_cid = put_update(store, ModelUpdate(new, 0, meta, name=name))
    state = optimizer.state
    state_cid = (
        put_update(store, ModelUpdate(state, 0, meta, name=f"{name}/state")) if state else None
    )
    return global_cid, state_cid


def _load(store: BlockStore, cid: Cid) -> dict[str, np.ndarray]:
    return dict(get_update(store, cid, verify=True).tensors)
