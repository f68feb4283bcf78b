"""Protocol limits, and the measures a validation failure reports (printed as Rust prints them)."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TypeAlias

from tensorswap.flow.floats import f32, rust_display_f32


@dataclass(frozen=True)
class ProtocolLimits:
    """Caps on collections and strings; decoding always uses :data:`DEFAULT_LIMITS`."""

    max_channel_values: int = 65_536
    """Stimulus values, embeddings, masks, gradient values and traces per row, FloatArray."""
    max_spike_events: int = 65_536
    max_traces: int = 65_536
    max_gradients: int = 65_536
    """Gradient rows per batch."""
    max_metadata_entries: int = 256
    """Entries of ``BatchMetadata.custom`` and of ``ConfigPayload.config``."""
    max_string_bytes: int = 1_024
    """UTF-8 bytes of any string: session ids, keys, values, ``source``, ``layer_id``."""
    max_aggregate_records: int = 131_072
    """Rows plus nested values of one payload; also the cap on ``sequence_length``."""


DEFAULT_LIMITS = ProtocolLimits()


# ── measures: what ``actual`` and ``limit`` hold, printed as Rust prints them ──────────────────
@dataclass(frozen=True)
class Count:
    """A collection length or a numeric identifier."""

    value: int

    def __str__(self) -> str:
        return str(self.value)


@dataclass(frozen=True)
class Bytes:
    """A UTF-8 byte length."""

    value: int

    def __str__(self) -> str:
        return str(self.value)


@dataclass(frozen=True, eq=False)
class Float:
    """An observed f32 (compared by bits, so NaN equals NaN)."""

    value: float

    def _bits(self) -> bytes:
        return struct.pack("<f", f32(self.value))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Float) and self._bits() == other._bits()

    def __hash__(self) -> int:
        return hash(self._bits())

    def __str__(self) -> str:
        return rust_display_f32(self.value)


@dataclass(frozen=True)
class Range:
    """The inclusive range a float must lie in."""

    min: float
    max: float

    def __str__(self) -> str:
        return f"[{rust_display_f32(self.min)}, {rust_display_f32(self.max)}]"


Measure: TypeAlias = Count | Bytes | Float | Range


__all__ = ["DEFAULT_LIMITS", "Bytes", "Count", "Float", "Measure", "ProtocolLimits", "Range"]
