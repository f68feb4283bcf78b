"""Checking a contributed model update against a round, and mapping strategies to aggregators."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from tensorswap.aggregate import (
    AggregatorKind,
    AggregatorSpec,
    NonFinitePolicy,
    StreamingAccumulator,
)
from tensorswap.aggregate.validate import FLOAT_DTYPE_NAMES
from tensorswap.cid import Cid, Multicodec
from tensorswap.errors import AggregationError, BlockNotFound, InvalidCid
from tensorswap.rounds.core.errors import (
    InvalidRoundSpec,
    InvalidUpdate,
    UnknownUpdate,
    UpdateMismatch,
)
from tensorswap.rounds.core.state import LayerSpec, Layout, RoundSpec
from tensorswap.store import (
    BlockStore,
    MalformedManifest,
    Manifest,
    TensorManifest,
    UpdateManifest,
    decode_manifest,
)

__all__ = [
    "STRATEGY_PARAMS",
    "STREAMING_KINDS",
    "UpdateFacts",
    "aggregator_spec",
    "check_finite",
    "count_nonfinite",
    "inspect_update",
    "new_accumulator",
    "parse_update_cid",
]

STREAMING_KINDS = frozenset({AggregatorKind.FEDAVG, AggregatorKind.MEAN})
"""Strategies folded in as contributions arrive (O(model) memory); others run at the end."""

STRATEGY_PARAMS = frozenset(
    {"byzantine", "select", "trim_fraction", "trim_count", "max_norm", "dtype", "non_finite"}
)
"""The ``RoundSpec.params`` keys understood (the options of ``AggregatorSpec``)."""

_SCAN = 1 << 20  # values per finiteness-check step: bounded scratch memory


def aggregator_spec(spec: RoundSpec) -> AggregatorSpec:
    """The AggregatorSpec a round's strategy and params describe; InvalidRoundSpec if none."""
    try:
        kind = AggregatorKind(spec.strategy)
    except ValueError:
        known = sorted(k.value for k in AggregatorKind)
        raise InvalidRoundSpec(f"unknown strategy {spec.strategy!r}; one of {known}") from None
    params: dict[str, object] = dict(spec.params)
    unknown = sorted(set(params) - STRATEGY_PARAMS)
    if unknown:
        known = sorted(STRATEGY_PARAMS)
        raise InvalidRoundSpec(f"unknown strategy params {unknown}; known {known}")
    try:
        if "non_finite" in params:
            params["non_finite"] = NonFinitePolicy(params["non_finite"])
        return AggregatorSpec(kind, **params)  # type: ignore[arg-type]
    except (AggregationError, ValueError, TypeError) as exc:
        raise InvalidRoundSpec(f"strategy {spec.strategy!r}: {exc}") from exc


def new_accumulator(spec: AggregatorSpec) -> StreamingAccumulator:
    """A streaming accumulator for a FEDAVG or MEAN spec."""
    return StreamingAccumulator(
        spec.kind, dtype=spec.dtype, max_norm=spec.max_norm, non_finite=spec.non_finite
    )


def parse_update_cid(value: Cid | str, key: str, peer: str) -> Cid:
    """The update CID as a Cid; UnknownUpdate for a string that is no CID or no manifest."""
    try:
        cid = value if isinstance(value, Cid) else Cid.parse(value)
    except InvalidCid as exc:
        raise UnknownUpdate(key, peer, str(value), f"not a CID ({exc.reason})") from None
    if cid.codec is not Multicodec.TENSORSWAP_MANIFEST:
        raise UnknownUpdate(key, peer, str(cid), "not a manifest CID")
    return cid


@dataclass(frozen=True, slots=True)
class UpdateFacts:
    """What the manifests of a held model update say: its layers, sample count and size."""

    cid: Cid
    layout: Layout
    num_samples: int
    nbytes: int
    tensors: tuple[tuple[Cid, TensorManifest], ...] = ()
    """Each layer's tensor manifest CID and decoded manifest, in layout order."""


def inspect_update(
    store: BlockStore, cid: Cid, key: str, peer: str, *, verify: bool | None = None
) -> UpdateFacts:
    """Read an update's manifests and check that every block it needs is in ``store``.

    Raises UnknownUpdate (a manifest or chunk is missing), UpdateMismatch (not a model
    update, or a layer of a dtype that cannot be aggregated). Chunks are not read, only
    looked up, so this costs a few small reads whatever the update's size.
    """
    manifest, nbytes = _manifest(store, cid, key, peer, verify)
    if not isinstance(manifest, UpdateManifest):
        raise UpdateMismatch(key, peer, f"{cid} is a tensor manifest, not a model update")
    layers = []
    tensors = []
    for ref in manifest.tensors:
        tensor, size = _manifest(store, ref.cid, key, peer, verify, f"tensor {ref.name!r}")
        if not isinstance(tensor, TensorManifest):
            raise UpdateMismatch(key, peer, f"entry {ref.name!r} links an update, not a tensor")
        if tensor.name != ref.name:
            raise UpdateMismatch(key, peer, f"entry {ref.name!r} links tensor {tensor.name!r}")
        missing = store.missing(tensor.links())
        if missing:
            detail = f"tensor {ref.name!r} lacks {len(missing)} of {len(tensor.chunks)} chunks"
            raise UnknownUpdate(key, peer, str(cid), f"{detail}, first {missing[0]}")
        if tensor.dtype not in FLOAT_DTYPE_NAMES:
            raise UpdateMismatch(
                key, peer, f"layer {ref.name!r} is {tensor.dtype}; only float tensors aggregate"
            )
        nbytes += size + sum(chunk.nbytes for chunk in tensor.chunks)
        layers.append(LayerSpec(ref.name, tensor.dtype, tuple(tensor.shape)))
        tensors.append((ref.cid, tensor))
    return UpdateFacts(cid, tuple(layers), manifest.num_samples, nbytes, tuple(tensors))


def _manifest(
    store: BlockStore, cid: Cid, key: str, peer: str, verify: bool | None, what: str = ""
) -> tuple[Manifest, int]:
    where = f"{what} " if what else ""
    try:
        view = store.get(cid, verify=verify)
    except BlockNotFound:
        detail = f"{where}manifest missing" if what else ""
        raise UnknownUpdate(key, peer, str(cid), detail) from None
    try:
        return decode_manifest(view, cid), view.nbytes
    except MalformedManifest as exc:
        raise UpdateMismatch(key, peer, f"{where}not a valid manifest: {exc.reason}") from exc


def count_nonfinite(values: np.ndarray) -> int:
    """NaN and infinite values in ``values``, scanned in bounded steps (no full-size mask)."""
    flat = values.reshape(-1)
    bad = 0
    for start in range(0, flat.size, _SCAN):
        part = flat[start : start + _SCAN]
        bad += int(part.size - np.count_nonzero(np.isfinite(part)))
    return bad


def check_finite(counts: Iterable[tuple[str, int]], key: str, peer: str) -> None:
    """InvalidUpdate naming the first tensor that holds NaN or infinite values, given each
    tensor's name and count of them (``fold.count_nonfinite_chunks``)."""
    for name, bad in counts:
        if bad:
            raise InvalidUpdate(key, peer, f"tensor {name!r} has {bad} non-finite values")
