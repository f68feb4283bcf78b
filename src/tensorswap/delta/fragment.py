"""DWE fragments: the per-layer weight-delta model, extraction and the axiom state hash."""

from __future__ import annotations

import hashlib
import struct
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from tensorswap.codec.dtypes import is_torch_tensor
from tensorswap.errors import DeltaError

#: Schema string of a plain axiom DWE fragment (whole layers), as axiom_engine writes it.
DWE_SCHEMA = "axiom.dwe.v1"
#: Schema of a tensorswap slice fragment: each layer entry carries a flat slice of one layer.
SLICE_SCHEMA = "tensorswap.dwe.slice.v1"
#: Every schema this package reads; anything else is refused on receipt.
KNOWN_SCHEMAS = frozenset({DWE_SCHEMA, SLICE_SCHEMA})

_F32 = np.dtype("<f4")
_U64_MAX = (1 << 64) - 1


class DeltaInputMismatch(DeltaError, ValueError):
    """The optimized and baseline states cannot be paired layer by layer."""

    def __init__(self, detail: str, layer: object = None) -> None:
        self.detail = detail
        self.layer = layer
        where = f" (layer {layer!r})" if layer is not None else ""
        super().__init__(f"cannot extract delta{where}: {detail}")


@dataclass(frozen=True, eq=False)
class DweLayerDelta:
    """One layer's delta: its index in the receiver's state list, a shape and float32 values.

    ``values`` is always a 1-D, C-contiguous little-endian float32 array (converted once, here);
    it may be a read-only view into a received buffer.
    """

    layer_index: int
    shape: tuple[int, ...]
    values: np.ndarray = field(repr=False)

    def __post_init__(self) -> None:
        index = int(self.layer_index)
        if not 0 <= index <= _U64_MAX:
            raise ValueError(f"layer_index {index} does not fit in u64")
        shape = tuple(int(d) for d in self.shape)
        if any(not 0 <= d <= _U64_MAX for d in shape):
            raise ValueError(f"shape {list(shape)} has a dimension outside u64")
        values = np.ascontiguousarray(self.values, dtype=_F32).reshape(-1)
        object.__setattr__(self, "layer_index", index)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "values", values)

    @classmethod
    def from_decoded(
        cls, layer_index: int, shape: tuple[int, ...], values: np.ndarray
    ) -> DweLayerDelta:
        """Wrap fields that the bincode decoder already produced in canonical form.

        ``layer_index`` and dims are u64 ints and ``values`` a 1-D little-endian float32 view,
        so the normalisation of ``__init__`` is skipped (it dominates decoding small frames).
        """
        self = object.__new__(cls)
        object.__setattr__(self, "layer_index", layer_index)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "values", values)
        return self

    @property
    def value_count(self) -> int:
        """Number of float32 values carried."""
        return int(self.values.shape[0])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DweLayerDelta):
            return NotImplemented
        return (
            self.layer_index == other.layer_index
            and self.shape == other.shape
            and self.values.tobytes() == other.values.tobytes()
        )

    __hash__ = None  # type: ignore[assignment]  # holds an array: not hashable


@dataclass(frozen=True, eq=False)
class DweFragment:
    """A DWE fragment, field for field the axiom_engine ``DweFragment`` plus the later ``hmac``.

    ``state_hash`` is the lower-case hex SHA-256 of :func:`compute_state_hash`; ``hmac`` is the
    lower-case hex HMAC-SHA256 over the fragment's bincode without the hmac field, or ``None``.
    """

    schema: str
    session_id: str
    sequence: int
    layers: tuple[DweLayerDelta, ...]
    state_hash: str
    hmac: str | None = None

    def __post_init__(self) -> None:
        sequence = int(self.sequence)
        if not 0 <= sequence <= _U64_MAX:
            raise ValueError(f"sequence {sequence} does not fit in u64")
        object.__setattr__(self, "sequence", sequence)
        object.__setattr__(self, "layers", tuple(self.layers))

    @property
    def value_count(self) -> int:
        """Total float32 values over all layers."""
        return sum(layer.value_count for layer in self.layers)

    def with_hmac(self, hmac_hex: str | None) -> DweFragment:
        """A copy carrying ``hmac_hex`` (the layers' arrays are shared, not copied)."""
        return replace(self, hmac=hmac_hex)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DweFragment):
            return NotImplemented
        return (
            self.schema == other.schema
            and self.session_id == other.session_id
            and self.sequence == other.sequence
            and self.state_hash == other.state_hash
            and self.hmac == other.hmac
            and self.layers == other.layers
        )

    __hash__ = None  # type: ignore[assignment]


def state_hash_pieces(layers: Iterable[DweLayerDelta]) -> Iterator[bytes | memoryview]:
    """The pieces hashed for ``state_hash``, in order: index and dims as u64 LE, values f32 LE."""
    for layer in layers:
        ndim = len(layer.shape)
        yield struct.pack(f"<{1 + ndim}Q", layer.layer_index, *layer.shape)
        yield layer.values.data.cast("B")


def compute_state_hash(layers: Iterable[DweLayerDelta]) -> str:
    """Lower-case hex SHA-256 exactly as axiom_engine's ``hash_layers`` computes it.

    For each layer in order: ``layer_index`` as 8 LE bytes, each dim as 8 LE bytes, each value as
    4 LE bytes. Neither the number of dims nor the number of values is hashed (as in the crate).
    """
    hasher = hashlib.sha256()
    for piece in state_hash_pieces(layers):
        hasher.update(piece)
    return hasher.hexdigest()


def make_fragment(
    session_id: str,
    sequence: int,
    layers: Iterable[DweLayerDelta],
    *,
    schema: str = DWE_SCHEMA,
) -> DweFragment:
    """Build a fragment from ready layer deltas, computing its state hash (no hmac)."""
    layer_tuple = tuple(layers)
    return DweFragment(
        schema=schema,
        session_id=session_id,
        sequence=sequence,
        layers=layer_tuple,
        state_hash=compute_state_hash(layer_tuple),
    )


def _torch_delta(optimized: Any, baseline: Any, name: object) -> tuple[tuple[int, ...], Any]:
    import torch  # deferred: the core works without torch installed

    opt = torch.as_tensor(optimized).detach()
    base = torch.as_tensor(baseline).detach().to(opt.device)
    if tuple(opt.shape) != tuple(base.shape):
        raise DeltaInputMismatch(
            f"shapes differ: optimized {list(opt.shape)} vs baseline {list(base.shape)}", name
        )
    if opt.dtype == torch.bool or opt.is_complex() or base.is_complex():
        raise DeltaInputMismatch(f"unsupported dtype {opt.dtype}", name)
    delta = (opt - base).to(torch.float32).contiguous().cpu().numpy()
    return tuple(opt.shape), delta


def _numpy_delta(optimized: Any, baseline: Any, name: object) -> tuple[tuple[int, ...], Any]:
    opt = np.asarray(optimized)
    base = np.asarray(baseline)
    if opt.shape != base.shape:
        raise DeltaInputMismatch(
            f"shapes differ: optimized {list(opt.shape)} vs baseline {list(base.shape)}", name
        )
    for arr in (opt, base):
        if arr.dtype.kind not in "fiu":
            raise DeltaInputMismatch(f"unsupported dtype {arr.dtype}", name)
    if opt.dtype == np.float32 and base.dtype == np.float32:
        return opt.shape, np.subtract(opt, base, dtype=_F32)
    # Subtract in the inputs' own dtype, then cast, as candle's sub(..).to_dtype(F32) does.
    with np.errstate(over="ignore", invalid="ignore"):
        delta = np.subtract(opt, base)
    return opt.shape, delta.astype(_F32, copy=False)


def layer_delta(
    layer_index: int, optimized: Any, baseline: Any, name: object = None
) -> DweLayerDelta:
    """The float32 delta ``optimized - baseline`` of one layer (numpy arrays or torch tensors).

    The subtraction runs in the inputs' dtype and the result is cast to float32; shapes must be
    equal (no broadcasting), integer and floating dtypes are accepted.
    """
    label = layer_index if name is None else name
    if is_torch_tensor(optimized) or is_torch_tensor(baseline):
        shape, values = _torch_delta(optimized, baseline, label)
    else:
        shape, values = _numpy_delta(optimized, baseline, label)
    return DweLayerDelta(layer_index=layer_index, shape=shape, values=values)


def _paired_layers(
    optimized: Sequence[Any] | Mapping[str, Any], baseline: Sequence[Any] | Mapping[str, Any]
) -> Iterator[tuple[object, Any, Any]]:
    if isinstance(optimized, Mapping) != isinstance(baseline, Mapping):
        raise DeltaInputMismatch("one state is a mapping and the other a sequence")
    if isinstance(optimized, Mapping) and isinstance(baseline, Mapping):
        missing = [k for k in optimized if k not in baseline]
        extra = [k for k in baseline if k not in optimized]
        if missing or extra:
            raise DeltaInputMismatch(
                f"layer names differ: missing from baseline {missing}, extra in baseline {extra}"
            )
        for name, value in optimized.items():
            yield name, value, baseline[name]
        return
    if len(optimized) != len(baseline):
        raise DeltaInputMismatch(
            f"layer counts differ: optimized {len(optimized)} vs baseline {len(baseline)}"
        )
    for index, (opt, base) in enumerate(zip(optimized, baseline, strict=True)):
        yield index, opt, base


def extract_delta_fragment(
    session_id: str,
    sequence: int,
    optimized: Sequence[Any] | Mapping[str, Any],
    baseline: Sequence[Any] | Mapping[str, Any],
) -> DweFragment:
    """Extract the per-layer delta ``optimized - baseline`` as one ``axiom.dwe.v1`` fragment.

    Layer ``i`` is the i-th entry of ``optimized`` (for a mapping: its i-th key, looked up by name
    in ``baseline``), so the receiver's state must list its layers in the same order. Unlike the
    crate, unequal layer counts or shapes are an error (:class:`DeltaInputMismatch`), never a
    silent truncation. Layers that are not floating point in either state (integer buffers
    such as a torch BatchNorm's ``num_batches_tracked``) carry no delta: they are left out,
    their index reserved, so the fragment applies to the same ``state_dict`` (which refuses
    to add to integer states). The result may exceed the 8 MiB cap: see :func:`split_fragment`.
    """
    layers = [
        layer_delta(index, opt, base, name)
        for index, (name, opt, base) in enumerate(_paired_layers(optimized, baseline))
        if _floating(opt) or _floating(base)
    ]
    return make_fragment(session_id, sequence, layers)


def _floating(state: Any) -> bool:
    if is_torch_tensor(state):
        return bool(state.is_floating_point())
    return np.asarray(state).dtype.kind not in "biu"


def describe_fragment(fragment: DweFragment) -> dict[str, Any]:
    """A JSON-ready summary of ``fragment`` (no values), e.g. for ``tensorswap inspect``."""
    return {
        "format": "dwe-fragment",
        "schema": fragment.schema,
        "session_id": fragment.session_id,
        "sequence": fragment.sequence,
        "state_hash": fragment.state_hash,
        "hmac": fragment.hmac,
        "value_count": fragment.value_count,
        "layers": [
            {
                "layer_index": layer.layer_index,
                "shape": list(layer.shape),
                "values": layer.value_count,
            }
            for layer in fragment.layers
        ],
    }


class LayerLayoutError(DeltaError, ValueError):
    """A layer entry is inconsistent in itself: value count vs shape, or a slice out of bounds."""

    def __init__(self, layer_index: int, detail: str) -> None:
        self.layer_index = layer_index
        self.detail = detail
        super().__init__(f"layer {layer_index}: {detail}")


@dataclass(frozen=True)
class LayerTarget:
    """Where a layer entry lands: the full layer shape and a flat range ``[offset, offset+count)``.

    A plain ``axiom.dwe.v1`` entry covers its whole layer (``offset == 0``, ``sliced`` false). In
    a ``tensorswap.dwe.slice.v1`` fragment every entry is a slice: its ``shape`` is the full layer
    shape followed by the flat C-order offset of its first value.
    """

    shape: tuple[int, ...]
    offset: int
    count: int
    sliced: bool


def element_count(dims: Iterable[int], limit: int | None = None) -> int:
    """Number of elements of a shape (1 for a scalar), as an exact Python int.

    With ``limit``, a count above it is returned as ``limit + 1`` as soon as that is known, so a
    received shape of many huge dims costs linear time instead of a quadratic big-int product.
    """
    dims = tuple(dims)
    if 0 in dims:
        return 0
    total = 1
    for dim in dims:
        total *= dim
        if limit is not None and total > limit:
            return limit + 1
    return total


_QUOTE_LIMIT = 200


def quoted(text: str) -> str:
    """``repr(text)`` for an error message, of at most the first 200 characters of a peer's
    string (a repr of 8 MiB of NUL bytes is 32 MiB, kept in telemetry's ``last_error``)."""
    if len(text) <= _QUOTE_LIMIT:
        return repr(text)
    return f"{text[:_QUOTE_LIMIT]!r}... ({len(text)} characters)"


def _shape_text(shape: tuple[int, ...]) -> str:
    """A shape for an error message: in full when short, else its first dims and its rank."""
    if len(shape) <= 8:
        return str(list(shape))
    return f"[{', '.join(map(str, shape[:8]))}, ...] ({len(shape)} dims)"


def layer_target(schema: str, layer: DweLayerDelta) -> LayerTarget:
    """Interpret ``layer`` under ``schema``; raises :class:`LayerLayoutError` if inconsistent."""
    count = layer.value_count
    if schema == SLICE_SCHEMA:
        if not layer.shape:
            raise LayerLayoutError(layer.layer_index, "a slice entry needs [*shape, offset]")
        shape, offset = layer.shape[:-1], layer.shape[-1]
        total = element_count(shape, limit=offset + count)
        if offset + count > total:
            raise LayerLayoutError(
                layer.layer_index,
                f"slice [{offset}, {offset + count}) exceeds {total} values of shape "
                f"{_shape_text(shape)}",
            )
        return LayerTarget(shape, offset, count, sliced=True)
    total = element_count(layer.shape, limit=count)
    if total != count:
        holds = f"more than {count}" if total > count else str(total)
        raise LayerLayoutError(
            layer.layer_index,
            f"shape {_shape_text(layer.shape)} holds {holds} values but {count} were sent",
        )
    return LayerTarget(layer.shape, 0, count, sliced=False)


class SequenceCounter:
    """A thread-safe monotonic sequence source, like later axiom versions' process-wide counter."""

    def __init__(self, start: int = 0) -> None:
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        self._next = start
        self._lock = threading.Lock()

    def next(self, count: int = 1) -> int:
        """Reserve ``count`` consecutive sequences and return the first."""
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        with self._lock:
            first = self._next
            self._next += count
        return first
