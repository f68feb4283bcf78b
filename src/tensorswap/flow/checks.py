"""The checks shared by the flow message validators: field types, int and float columns, limits.

The stateless checks are functions; `FieldChecks` holds one validation pass's limits and float
bound, with the pieces several messages share (strings, floats rounded to f32, the spike columns
in one struct pack, batch metadata). The per-message rules are in `tensorswap.flow.validate`.
"""

from __future__ import annotations

import math
import re
import struct
from itertools import chain
from typing import Any

import numpy as np

from tensorswap.flow.errors import FieldTypeError, ValidationError, ValidationKind
from tensorswap.flow.floats import f32
from tensorswap.flow.limits import Bytes, Count, Float, ProtocolLimits
from tensorswap.flow.messages import U64_MAX, BatchMetadata

__all__ = [
    "FieldChecks",
    "IntColumn",
    "as_float",
    "as_list",
    "check_count",
    "check_finite",
    "check_int",
    "check_int_columns",
    "check_items",
    "check_u64",
    "duplicate_identifier",
    "first_duplicate",
    "limit_exceeded",
    "same_float",
]

_K = ValidationKind
_pack = struct.pack
_unpack = struct.unpack
_FLOATS = {float}
_INTS = {int}
_U64_LABEL = re.compile(r"\+?[0-9]+")


_SPIKE_STRUCTS: dict[int, tuple[struct.Struct, struct.Struct]] = {}


def _spike_structs(n: int) -> tuple[struct.Struct, struct.Struct]:
    """Structs for ``n`` spike events: all columns (u16, u32, f32), and the f32 column alone."""
    structs = _SPIKE_STRUCTS.get(n)
    if structs is None:
        structs = (struct.Struct(f"<{n}H{n}I{n}f"), struct.Struct(f"<{n}f"))
        if len(_SPIKE_STRUCTS) < 64:  # the batch sizes in use; others are built on demand
            _SPIKE_STRUCTS[n] = structs
    return structs


# ── failures and stateless checks ─────────────────────────────────────────────────────────────
def limit_exceeded(path: str, actual: int, limit: int) -> ValidationError:
    return ValidationError(path, _K.LIMIT_EXCEEDED, Count(actual), Count(limit))


def duplicate_identifier(path: str, identifier: object) -> ValidationError:
    # corpus-ipc reports a numeric identifier as ``actual``, any other one in the path.
    label = str(identifier)
    if _U64_LABEL.fullmatch(label) and int(label) <= U64_MAX:
        return ValidationError(path, _K.DUPLICATE_IDENTIFIER, Count(int(label)))
    if label not in path:
        path = f"{path}:{label}"
    return ValidationError(path, _K.DUPLICATE_IDENTIFIER)


def first_duplicate(ids: list[Any]) -> int | None:
    if len(set(ids)) == len(ids):
        return None
    seen: set[Any] = set()
    for i, identifier in enumerate(ids):
        if identifier in seen:
            return i
        seen.add(identifier)
    return None  # pragma: no cover - unequal lengths imply a repeat


def check_count(path: str, actual: int, limit: int) -> None:
    if actual > limit:
        raise limit_exceeded(path, actual, limit)


def check_int(path: str, value: object, low: int, high: int, name: str) -> None:
    if type(value) is int and low <= value <= high:
        return
    # int subclasses (IntEnum) and numpy integers are written as plain ints; bools are not ints
    if isinstance(value, int | np.integer) and not isinstance(value, bool) and low <= value <= high:
        return
    raise FieldTypeError(path, f"an integer in {low}..={high} ({name})", value)


def check_u64(path: str, value: object) -> None:
    check_int(path, value, 0, U64_MAX, "u64")


# (values, item path, maximum, Rust type name, struct code) of one integer column
IntColumn = tuple[list[Any], str, int, str, str]


def check_int_columns(*columns: IntColumn) -> None:
    """Every item an ``int`` (not a bool) within its column's range; one struct pack checks
    all ranges at once, the precise per-item check runs only when that fails."""
    codes = "".join(f"{len(values)}{code}" for values, _, _, _, code in columns)
    flat = list(chain.from_iterable(column[0] for column in columns))
    try:
        _pack("<" + codes, *flat)
    except struct.error:
        pass
    else:
        if not flat or set(map(type, flat)) == _INTS:
            return
    for values, item, high, name, _ in columns:
        for i, value in enumerate(values):
            check_int(item.format(i), value, 0, high, name)


def as_list(path: str, value: object, what: str = "a list") -> list[Any]:
    if not isinstance(value, list):
        raise FieldTypeError(path, what, value)
    return value


def check_items(values: list[Any], item: str, cls: type) -> None:
    if values and set(map(type, values)) != {cls}:
        for i, value in enumerate(values):
            if not isinstance(value, cls):
                raise FieldTypeError(item.format(i), f"a {cls.__name__}", value)


def as_float(path: str, value: object) -> float:
    """A number (Python or numpy) as a float (not yet rounded); else a FieldTypeError."""
    if isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:  # an int beyond the f64 range (copysign would convert it too)
            return math.inf if value > 0 else -math.inf
    raise FieldTypeError(path, "a float (f32)", value)


def check_finite(path: str, value: float) -> None:
    if not math.isfinite(value):
        raise ValidationError(path, _K.NON_FINITE, Float(value))


def same_float(a: float, b: object) -> bool:
    return type(b) is float and (a == b or (a != a and b != b))


class FieldChecks:
    """The shared state and pieces of one validation pass; ``peak`` bounds the magnitude of
    every float seen."""

    __slots__ = ("limits", "peak", "track_peak", "trusted")

    def __init__(self, limits: ProtocolLimits, trusted: bool, track_peak: bool = True) -> None:
        self.limits = limits
        self.trusted = trusted
        self.track_peak = track_peak
        self.peak = 0.0

    # ── shared pieces ──────────────────────────────────────────────────────────────────────────
    def add(self, total: int, n: int) -> int:
        total += n
        if total > self.limits.max_aggregate_records:
            raise limit_exceeded("aggregate", total, self.limits.max_aggregate_records)
        return total

    def string(self, path: str, value: object) -> None:
        if not isinstance(value, str):
            raise FieldTypeError(path, "a str", value)
        if value.isascii():
            size = len(value)
        else:
            try:
                size = len(value.encode("utf-8"))
            except UnicodeEncodeError:
                raise FieldTypeError(path, "valid Unicode (no lone surrogates)", value) from None
        limit = self.limits.max_string_bytes
        if size > limit:
            raise ValidationError(path, _K.LIMIT_EXCEEDED, Bytes(size), Bytes(limit))

    def opt_string(self, path: str, value: object) -> None:
        if value is not None:
            self.string(path, value)

    def number(self, path: str, value: object) -> float:
        """One float rounded to f32; not yet checked for finiteness."""
        if type(value) is not float:
            if self.trusted:
                raise FieldTypeError(path, "a float (f32)", value)
            value = as_float(path, value)
        rounded = f32(value)
        magnitude = abs(rounded)
        if magnitude > self.peak:
            self.peak = magnitude
        return rounded

    def floats(self, values: list[Any], item: str) -> list[float]:
        """Finite f32 floats: ``values`` itself when every item already is one, else a copy."""
        if not values:
            return values
        if not self.trusted and set(map(type, values)) != _FLOATS:
            values = [as_float(item.format(i), v) for i, v in enumerate(values)]
        fmt = f"<{len(values)}f"
        try:
            rounded: Any = _unpack(fmt, _pack(fmt, *values))
        except OverflowError:  # a finite float beyond the f32 range becomes inf
            rounded = [f32(v) for v in values]
        else:
            if self.trusted and rounded == tuple(values):
                # Decoded JSON holds no inf or NaN, and nothing overflowed: all finite.
                if self.track_peak:
                    self.peak = max(self.peak, max(rounded), -min(rounded))
                return values
        # A sum of f32 magnitudes cannot overflow an f64: only inf or NaN makes it non-finite.
        total = sum(map(abs, rounded))
        if not math.isfinite(total):
            for i, value in enumerate(rounded):
                check_finite(item.format(i), value)
        if total > self.peak:
            self.peak = total
        return values if rounded == tuple(values) else list(rounded)

    def spike_columns(
        self, channels: list[Any], times: list[Any], strengths: list[Any]
    ) -> list[float] | None:
        """The common case of the spike columns in one struct pack: every channel an ``int``
        within u16, every time an ``int`` within u32, every strength a finite ``float`` once
        rounded to f32. Returns the rounded strengths (``strengths`` itself when unchanged), or
        ``None`` when any of this does not hold and the precise checks must find the fault."""
        n = len(strengths)
        if not n:
            return strengths
        # Exact types (no bool, no subclass); comparing with a list of types needs no hashing.
        ints = [int] * n
        if list(map(type, channels)) != ints or list(map(type, times)) != ints:
            return None
        if list(map(type, strengths)) != [float] * n:
            return None
        columns, floats = _spike_structs(n)
        try:
            packed = columns.pack(*channels, *times, *strengths)
        except (struct.error, OverflowError):  # an integer out of range, a float beyond f32
            return None
        rounded = floats.unpack_from(packed, 6 * n)
        # The norm bounds every magnitude, and it is finite exactly when every value is (the
        # norm of 65,536 finite f32 values cannot overflow an f64).
        peak = math.hypot(*rounded)
        if not math.isfinite(peak):
            return None
        if peak > self.peak:
            self.peak = peak
        return strengths if rounded == tuple(strengths) else list(rounded)

    def metadata(self, metadata: BatchMetadata | None, counted: int) -> None:
        total = self.add(0, counted)
        if metadata is None:
            return
        if not isinstance(metadata, BatchMetadata):
            raise FieldTypeError("metadata", "a BatchMetadata or None", metadata)
        if metadata.processing_latency_ns is not None:
            check_u64("processing_latency_ns", metadata.processing_latency_ns)
        self.opt_string("source", metadata.source)
        custom = metadata.custom
        if not isinstance(custom, dict):
            raise FieldTypeError("custom", "a dict of str to str", custom)
        check_count("custom", len(custom), self.limits.max_metadata_entries)
        for key, value in custom.items():
            if key == "":
                raise ValidationError("custom.<empty>", _K.NESTED_METADATA)
            self.string("custom.<key>", key)
            self.string("custom.<value>", value)
        self.add(total, len(custom))
