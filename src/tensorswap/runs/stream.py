"""A run's step chunk by chunk: the next global model and optimizer state stored piece by
piece from memory-mapped chunks, so the step holds a few chunks, never whole models."""

from __future__ import annotations

import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

from tensorswap.aggregate import quiet
from tensorswap.aggregate.server_opt import ServerOptimizer
from tensorswap.cid import Cid, Multicodec
from tensorswap.codec import DType, TensorBlock, encode_block
from tensorswap.store import (
    BlockStore,
    ChunkRef,
    TensorManifest,
    UpdateManifest,
    chunk_bounds,
    decode_chunk,
    encode_manifest,
    read_manifest,
    tensor_manifest,
    update_manifest,
)

if TYPE_CHECKING:
    from tensorswap.runs.finite import FiniteGuard

__all__ = ["stream_noised", "stream_step"]

_STREAMED = frozenset({"float32", "float64"})


def _plans(
    store: BlockStore,
    optimizer: ServerOptimizer,
    cur_u: UpdateManifest,
    agg_u: UpdateManifest,
    state_u: UpdateManifest | None,
) -> list[tuple[str, TensorManifest, TensorManifest, dict[str, TensorManifest | None]]] | None:
    """Per tensor of the current model: its manifest, the aggregate's and the state's (by
    prefix; None: no state yet); None when they are not laid out for a streamed step."""
    agg_refs = {ref.name: ref.cid for ref in agg_u.tensors}
    state_refs = {ref.name: ref.cid for ref in state_u.tensors} if state_u else {}
    plans = []
    for ref in cur_u.tensors:
        cur_t = _tensor(store, ref.cid)
        agg_cid = agg_refs.get(ref.name)
        if agg_cid is None or cur_t.dtype not in _STREAMED:
            return None
        agg_t = _tensor(store, agg_cid)
        state_t: dict[str, TensorManifest | None] = {}
        for prefix in optimizer.prefixes:
            kept_cid = state_refs.get(f"{prefix}/{ref.name}")
            if kept_cid is None and state_u is not None:
                return None
            state_t[prefix] = None if kept_cid is None else _tensor(store, kept_cid)
        tensors = [cur_t, agg_t, *(t for t in state_t.values() if t is not None)]
        if any(t.dtype != cur_t.dtype or t.shape != cur_t.shape for t in tensors):
            return None
        want = chunk_bounds(cur_t.size, DType.parse(cur_t.dtype).itemsize)
        if any(_bounds(t) != want for t in tensors):
            return None
        plans.append((ref.name, cur_t, agg_t, state_t))
    return plans


@quiet  # overflow is not a warning here: the guard refuses what it made
def stream_step(
    store: BlockStore,
    optimizer: ServerOptimizer,
    server_round: int,
    current: Cid,
    aggregate: Cid,
    state: Cid | None,
    *,
    delta: bool,
    metadata: Mapping[str, str],
    name: str,
    guard: FiniteGuard | None = None,
    source: str = "aggregate",
) -> tuple[Cid, Cid | None] | None:
    """``(new global CID, new state CID)``, the very updates ``put_update`` would store for
    ``optimizer.step`` over the whole models (same chunks, same manifests), computed chunk
    by chunk; ``delta``: the aggregate is a mean delta, the optimizer sees ``current +
    aggregate``. None (nothing decided, maybe some chunks stored) when the models are not
    laid out for it: a dtype other than float32/float64, or chunks not cut where
    ``put_update`` cuts them; the caller steps whole models then. Every chunk is re-hashed
    as it is read. With ``guard``, each chunk of the aggregate (as ``source``), of the new
    model and of the new state is checked as it is made: NonFiniteStep at the first NaN or
    Inf (the chunks stored until then are unnamed blocks, for retention to collect)."""
    cur_u, agg_u = _update(store, current), _update(store, aggregate)
    state_u = _update(store, state) if state is not None else None
    plans = _plans(store, optimizer, cur_u, agg_u, state_u)
    if plans is None:
        return None
    model_refs: list[tuple[str, Cid]] = []
    state_out: list[tuple[str, Cid]] = []
    for tensor_name, cur_t, agg_t, state_t in plans:
        new_chunks: list[ChunkRef] = []
        kept_chunks: dict[str, list[ChunkRef]] = {p: [] for p in optimizer.prefixes}
        for i, chunk in enumerate(cur_t.chunks):
            cur = decode_chunk(store.get(chunk.cid, verify=True), cur_t, i)
            agg = decode_chunk(store.get(agg_t.chunks[i].cid, verify=True), agg_t, i)
            if guard is not None:
                guard.check(source, tensor_name, agg)
            if delta:
                agg = cur + agg
            pieces = {}
            for prefix, kept in state_t.items():
                if kept is None:
                    pieces[prefix] = np.zeros(cur.size, cur.dtype)
                else:
                    view = store.get(kept.chunks[i].cid, verify=True)
                    pieces[prefix] = decode_chunk(view, kept, i).copy()
            out = np.empty(cur.size, cur.dtype)
            optimizer.step_piece(server_round, cur, agg, pieces, out)
            if guard is not None:
                guard.check("optimizer step", tensor_name, out)
                for prefix, piece in pieces.items():
                    guard.check("optimizer state", f"{prefix}/{tensor_name}", piece)
            new_chunks.append(_put_chunk(store, out))
            for prefix, piece in pieces.items():
                kept_chunks[prefix].append(_put_chunk(store, piece))
        model_refs.append((tensor_name, _put_tensor(store, tensor_name, cur_t, new_chunks)))
        for prefix, chunks in kept_chunks.items():
            label = f"{prefix}/{tensor_name}"
            state_out.append((label, _put_tensor(store, label, cur_t, chunks)))
    new = _put_update(store, update_manifest(name, 0, model_refs, metadata))
    if not state_out:
        return new, None
    # the state in the order ``optimizer.state`` lists it: tensor by tensor, prefix by prefix
    kept_update = update_manifest(f"{name}/state", 0, state_out, metadata)
    return new, _put_update(store, kept_update)


def stream_noised(
    store: BlockStore,
    aggregate: Cid,
    factor: float,
    std: float,
    rng: np.random.Generator,
    *,
    metadata: Mapping[str, str],
    name: str,
    workers: int | None = None,
    guard: FiniteGuard | None = None,
) -> Cid:
    """``aggregate`` x ``factor`` plus independent ``N(0, std**2)`` noise per value (drawn and
    added in float64, cast back to each tensor's dtype; ``privacy.dp.add_noise``), stored
    chunk by chunk as an update laid out like ``aggregate``: a few chunks in memory, never
    the whole model. Every chunk is re-hashed as it is read.

    The chunks are shared among ``workers`` threads (default: the CPUs, at most 4), chunk
    ``i`` to thread ``i mod workers``, each drawing from its own child of ``rng``
    (``Generator.spawn``): numpy draws without the GIL, so the draw, the dominant cost,
    runs on every core; the result depends on ``rng`` and ``workers`` only. With ``guard``,
    each noised chunk is checked before it is stored (NonFiniteStep, stage ``DP release``)."""
    from tensorswap.privacy.dp import add_noise

    source = _update(store, aggregate)
    tensors = [(ref.name, _tensor(store, ref.cid)) for ref in source.tensors]
    jobs = [(t, i) for t, (_, tensor) in enumerate(tensors) for i in range(len(tensor.chunks))]
    count = max(1, min(workers or min(os.cpu_count() or 1, 4), len(jobs)))
    generators = rng.spawn(count) if count > 1 else [rng]
    done: dict[tuple[int, int], ChunkRef] = {}

    @quiet  # in each worker thread: numpy's error state is per thread
    def work(w: int) -> None:
        for t, i in jobs[w::count]:
            tensor_name, tensor = tensors[t]
            values = decode_chunk(store.get(tensor.chunks[i].cid, verify=True), tensor, i)
            noised = add_noise(values, factor, std, generators[w])
            if guard is not None:
                guard.check("DP release", tensor_name, noised)
            done[(t, i)] = _put_chunk(store, noised)

    if count == 1:
        work(0)
    else:
        with ThreadPoolExecutor(count, thread_name_prefix="tensorswap-noise") as pool:
            for future in [pool.submit(work, w) for w in range(count)]:
                future.result()
    refs: list[tuple[str, Cid]] = []
    for t, (tensor_name, tensor) in enumerate(tensors):
        chunks = [done[(t, i)] for i in range(len(tensor.chunks))]
        refs.append((tensor_name, _put_tensor(store, tensor_name, tensor, chunks)))
    return _put_update(store, update_manifest(name, 0, refs, metadata))


def _update(store: BlockStore, cid: Cid) -> UpdateManifest:
    manifest = read_manifest(store, cid, verify=True)
    if not isinstance(manifest, UpdateManifest):
        raise TypeError(f"{cid} is not a model update")
    return manifest


def _tensor(store: BlockStore, cid: Cid) -> TensorManifest:
    manifest = read_manifest(store, cid, verify=True)
    if not isinstance(manifest, TensorManifest):
        raise TypeError(f"{cid} is not a tensor")
    return manifest


def _bounds(tensor: TensorManifest) -> tuple[int, ...]:
    if tensor.encoding != "dense" or tensor.compression:
        return ()
    edges = [0]
    for chunk in tensor.chunks:
        edges.append(edges[-1] + chunk.values)
    return tuple(edges) if tensor.chunks else (0,)


def _put_chunk(store: BlockStore, values: np.ndarray) -> ChunkRef:
    data = encode_block(TensorBlock("", values))
    cid = store.put(data, adopt=True)
    return ChunkRef(cid.to_bytes(), values.size, data.size)


def _put_tensor(store: BlockStore, name: str, like: TensorManifest, chunks: list[ChunkRef]) -> Cid:
    manifest = tensor_manifest(name, like.dtype, tuple(like.shape), chunks)
    return store.put(encode_manifest(manifest), codec=Multicodec.TENSORSWAP_MANIFEST)


def _put_update(store: BlockStore, manifest: UpdateManifest) -> Cid:
    return store.put(encode_manifest(manifest), codec=Multicodec.TENSORSWAP_MANIFEST)
