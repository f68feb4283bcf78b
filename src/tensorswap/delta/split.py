"""Split a delta larger than the cap into self-contained fragments, and reassemble them.

Whole layers are packed greedily into ``axiom.dwe.v1`` fragments, which any axiom peer applies.
A layer too big for one fragment is cut into flat C-order slices, one per
``tensorswap.dwe.slice.v1`` fragment whose single entry has ``shape = [*layer_shape, offset]``.
Parts take consecutive sequences, each carries its own state hash (and HMAC once signed), and
each is applied on arrival: deltas add, so every value is added exactly once and the result is
bit-identical to applying the whole delta. An axiom peer refuses a slice part (its value count
never matches the shape), before changing anything.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from tensorswap.delta.bincode import (
    HMAC_FIELD_BYTES,
    MAX_DWE_FRAGMENT_BYTES,
    MAX_DWE_LAYERS,
    encoded_size,
)
from tensorswap.delta.fragment import (
    DWE_SCHEMA,
    SLICE_SCHEMA,
    DweFragment,
    DweLayerDelta,
    element_count,
    layer_target,
    make_fragment,
    quoted,
)
from tensorswap.errors import DeltaError

_HASH_HEX_DIGITS = 64


class SplitError(DeltaError, ValueError):
    """A delta cannot be split under the cap, or parts do not reassemble into whole layers."""


def _header_bytes(schema: str, session_id: str, reserve: int) -> int:
    strings = len(schema.encode("utf-8")) + len(session_id.encode("utf-8"))
    return 8 + 8 + strings + 8 + 8 + 8 + _HASH_HEX_DIGITS + reserve


def _layer_bytes(ndim: int, count: int) -> int:
    return 8 + 8 + 8 * ndim + 8 + 4 * count


@dataclass
class _Packer:
    session_id: str
    sequence: int
    max_bytes: int
    reserve: int
    parts: list[DweFragment]
    pending: list[DweLayerDelta]
    max_layers: int = MAX_DWE_LAYERS
    pending_bytes: int = 0

    def flush(self) -> None:
        if self.pending:
            self._emit(DWE_SCHEMA, self.pending)
            self.pending = []
            self.pending_bytes = 0

    def _emit(self, schema: str, layers: list[DweLayerDelta]) -> None:
        sequence = self.sequence + len(self.parts)
        self.parts.append(make_fragment(self.session_id, sequence, layers, schema=schema))

    def add(self, layer: DweLayerDelta) -> None:
        header = _header_bytes(DWE_SCHEMA, self.session_id, self.reserve)
        size = _layer_bytes(len(layer.shape), layer.value_count)
        if header + size > self.max_bytes:
            self.flush()
            self._slice(layer)
            return
        full = len(self.pending) >= self.max_layers
        if full or header + self.pending_bytes + size > self.max_bytes:
            self.flush()
        self.pending.append(layer)
        self.pending_bytes += size

    def _slice(self, layer: DweLayerDelta) -> None:
        ndim = len(layer.shape) + 1
        room = self.max_bytes - _header_bytes(SLICE_SCHEMA, self.session_id, self.reserve)
        per_part = (room - _layer_bytes(ndim, 0)) // 4
        if per_part < 1:
            raise SplitError(f"cap of {self.max_bytes} bytes cannot hold one value of a slice")
        for offset in range(0, layer.value_count, per_part):
            values = layer.values[offset : offset + per_part]
            piece = DweLayerDelta(layer.layer_index, (*layer.shape, offset), values)
            self._emit(SLICE_SCHEMA, [piece])


def split_fragment(
    fragment: DweFragment,
    *,
    max_bytes: int = MAX_DWE_FRAGMENT_BYTES,
    reserve_hmac: bool = True,
    max_layers: int = MAX_DWE_LAYERS,
) -> list[DweFragment]:
    """Split ``fragment`` into parts whose bincode fits ``max_bytes``; one part if it fits.

    Parts are numbered ``fragment.sequence, fragment.sequence + 1, ...`` (the caller's next free
    sequence is ``fragment.sequence + len(parts)``), keep the layer order, and share the values'
    memory with ``fragment`` (slices are views). ``reserve_hmac`` leaves room for the hmac field
    so that parts can be signed afterwards. No part holds more than ``max_layers`` layers (what a
    listener decodes by default). Only whole-layer ``axiom.dwe.v1`` fragments split.
    """
    if fragment.schema != DWE_SCHEMA:
        raise SplitError(f"only {DWE_SCHEMA} fragments split, not {quoted(fragment.schema)}")
    reserve = HMAC_FIELD_BYTES if reserve_hmac else 0
    unsigned = fragment.with_hmac(None)
    if max_layers < 1:
        raise SplitError(f"max_layers must be >= 1, got {max_layers}")
    if encoded_size(unsigned) + reserve <= max_bytes and len(fragment.layers) <= max_layers:
        return [fragment]
    if not fragment.layers:  # nothing to split, and the bare header alone does not fit
        raise SplitError(f"a fragment with no layers needs more than {max_bytes} bytes")
    packer = _Packer(fragment.session_id, fragment.sequence, max_bytes, reserve, [], [], max_layers)
    for layer in fragment.layers:
        packer.add(layer)
    packer.flush()
    return packer.parts


@dataclass
class _Assembly:
    layer_index: int
    shape: tuple[int, ...]
    values: np.ndarray
    filled: int = 0


def _check_parts(parts: Sequence[DweFragment]) -> None:
    if not parts:
        raise SplitError("no parts to reassemble")
    first = parts[0]
    for position, part in enumerate(parts):
        if part.session_id != first.session_id:
            raise SplitError(f"part {position} is from session {quoted(part.session_id)}")
        expected = first.sequence + position
        if part.sequence != expected:
            raise SplitError(f"part {position} has sequence {part.sequence}, expected {expected}")


def _entries(parts: Iterable[DweFragment]) -> Iterable[tuple[str, DweLayerDelta]]:
    for part in parts:
        for layer in part.layers:
            yield part.schema, layer


def reassemble(parts: Sequence[DweFragment]) -> DweFragment:
    """Join consecutive parts from :func:`split_fragment` back into one whole-layer fragment.

    Parts must be of one session, in sequence order without holes, and every sliced layer must
    be covered from offset 0 to its end in order; otherwise :class:`SplitError`. The result has
    the first part's sequence and the state hash of the original delta.
    """
    _check_parts(parts)
    layers: list[DweLayerDelta] = []
    open_layer: _Assembly | None = None
    # A slice header may claim any shape: never allocate more than the parts actually carry.
    carried = sum(layer.value_count for _, layer in _entries(parts))
    for schema, layer in _entries(parts):
        target = layer_target(schema, layer)
        if not target.sliced:
            if open_layer is not None:
                raise SplitError(f"layer {open_layer.layer_index} is incomplete")
            layers.append(layer)
            continue
        if open_layer is None:
            total = element_count(target.shape, limit=carried)
            if total > carried:
                detail = f"claims more than the {carried} values the parts carry"
                raise SplitError(f"layer {layer.layer_index} {detail}")
            buffer = np.empty(total, dtype="<f4")
            open_layer = _Assembly(layer.layer_index, target.shape, buffer)
        if (layer.layer_index, target.shape, target.offset) != (
            open_layer.layer_index,
            open_layer.shape,
            open_layer.filled,
        ):
            raise SplitError(
                f"slice of layer {layer.layer_index} at offset {target.offset} does not continue "
                f"layer {open_layer.layer_index} at offset {open_layer.filled}"
            )
        open_layer.values[target.offset : target.offset + target.count] = layer.values
        open_layer.filled += target.count
        if open_layer.filled == open_layer.values.shape[0]:
            done = open_layer
            layers.append(DweLayerDelta(done.layer_index, done.shape, done.values))
            open_layer = None
    if open_layer is not None:
        raise SplitError(f"layer {open_layer.layer_index} is incomplete")
    return make_fragment(parts[0].session_id, parts[0].sequence, layers)
