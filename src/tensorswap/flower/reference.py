"""ArrayRef: what a Flower message carries instead of an ArrayRecord (root CID, names, shapes,
dtypes), as the plain fields of a Flower ConfigRecord; every field bounded before use."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tensorswap.cid import Cid, Multicodec
from tensorswap.codec import DType
from tensorswap.errors import CidError, CodecError
from tensorswap.errors.flower import BadReference, ReferenceMismatch

__all__ = [
    "MARKER",
    "MAX_ARRAYS",
    "MAX_DIMS",
    "MAX_NAME",
    "MAX_SAMPLES",
    "VERSION",
    "ArrayRef",
    "is_reference",
]

MARKER = "tensorswap.ref"
"""The ConfigRecord field that marks a reference; its value is the format's VERSION."""
VERSION = 1
MAX_ARRAYS = 65_536
"""At most this many arrays in one reference (names, shapes and dtypes alike)."""
MAX_NAME = 1024
"""An array's name (its key in the ArrayRecord) is at most this many characters."""
MAX_DIMS = 32
"""numpy's own limit on dimensions; a shape with more is refused before anything is fetched."""

_FIELDS = {MARKER, "root", "names", "shapes", "dtypes", "swarm"}
_OPTIONAL = {"samples", "submitted"}
"""Fields a reference may carry besides ``_FIELDS`` (a reader of version 1 that predates one
refuses it; only a ``BlockStrategy`` that asked for it receives it)."""
MAX_SAMPLES = 2**63 - 1


def is_reference(fields: Mapping[str, Any]) -> bool:
    """Whether a ConfigRecord's fields are a tensorswap array reference (by its marker)."""
    return MARKER in fields


@dataclass(frozen=True, slots=True)
class ArrayRef:
    """An ArrayRecord's arrays as stored blocks: the update manifest ``root`` lists them by
    ``names`` (the record's keys, in order); ``shapes`` and ``dtypes`` say what each is, so a
    receiver checks what it fetched (``check``) and a reader learns them without fetching.
    ``swarm``: receivers may fetch the chunks from peers that hold them, not only the service.
    ``samples``: the update stored under ``root`` says it covers this many samples (its
    ``num_samples``, the weight a coordinator's FedAvg gives it); None: not set (0 stored).
    ``submitted``: the key of the coordinator's round that holds ``root`` as the replying
    node's contribution, accepted from this reply's mod (None: not submitted, or refused).
    """

    root: Cid
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    swarm: bool = False
    samples: int | None = None
    submitted: str | None = None

    @classmethod
    def of(
        cls,
        root: Cid,
        arrays: Mapping[str, np.ndarray],
        *,
        swarm: bool = False,
        samples: int | None = None,
    ) -> ArrayRef:
        """The reference to ``arrays`` stored under ``root``."""
        return cls(
            root,
            tuple(arrays),
            tuple(tuple(int(d) for d in a.shape) for a in arrays.values()),
            tuple(DType.of(a.dtype).value for a in arrays.values()),
            swarm,
            samples,
        )

    @property
    def nbytes(self) -> int:
        """The arrays' bytes (values only), from the shapes and dtypes."""
        return sum(
            int(np.prod(shape, dtype=np.int64)) * DType.parse(dtype).itemsize
            for shape, dtype in zip(self.shapes, self.dtypes, strict=True)
        )

    def fields(self) -> dict[str, Any]:
        """The ConfigRecord fields: int, str, bool and lists of str only (Flower's value
        types); ``samples`` only when set."""
        fields: dict[str, Any] = {
            MARKER: VERSION,
            "root": str(self.root),
            "names": list(self.names),
            "shapes": [",".join(str(d) for d in shape) for shape in self.shapes],
            "dtypes": list(self.dtypes),
            "swarm": self.swarm,
        }
        if self.samples is not None:
            fields["samples"] = self.samples
        if self.submitted is not None:
            fields["submitted"] = self.submitted
        return fields

    @classmethod
    def parse(cls, key: str, fields: Mapping[str, Any]) -> ArrayRef:
        """The reference in a received ConfigRecord's fields; BadReference if any field is
        missing, of the wrong type, or out of bounds (checked before anything is fetched)."""
        if fields.get(MARKER) != VERSION:
            raise BadReference(key, f"version {fields.get(MARKER)!r}, this bridge reads {VERSION}")
        if not _FIELDS <= set(fields) <= _FIELDS | _OPTIONAL:
            raise BadReference(key, f"fields {sorted(fields)}, expected {sorted(_FIELDS)}")
        root = _root(key, fields["root"])
        names = _strings(key, "names", fields["names"], MAX_NAME)
        shapes = tuple(_shape(key, s) for s in _strings(key, "shapes", fields["shapes"], 512))
        dtypes = tuple(_dtype(key, d) for d in _strings(key, "dtypes", fields["dtypes"], 16))
        if not len(names) == len(shapes) == len(dtypes):
            raise BadReference(
                key, f"{len(names)} names, {len(shapes)} shapes, {len(dtypes)} dtypes"
            )
        if len(set(names)) != len(names):
            raise BadReference(key, "an array name appears twice")
        if not isinstance(fields["swarm"], bool):
            raise BadReference(key, "swarm is not a bool")
        samples = fields.get("samples")
        if samples is not None and (
            isinstance(samples, bool)
            or not isinstance(samples, int)
            or not 0 <= samples <= MAX_SAMPLES
        ):
            raise BadReference(key, f"samples is not an int in [0, {MAX_SAMPLES}]")
        submitted = fields.get("submitted")
        if submitted is not None and (
            not isinstance(submitted, str) or not 0 < len(submitted) <= 2 * MAX_NAME
        ):
            raise BadReference(key, f"submitted is not a round key of at most {2 * MAX_NAME}")
        return cls(root, names, shapes, dtypes, fields["swarm"], samples, submitted)

    def check(self, arrays: Mapping[str, np.ndarray]) -> None:
        """ReferenceMismatch unless ``arrays`` are the names, shapes and dtypes claimed."""
        got = ArrayRef.of(self.root, arrays, swarm=self.swarm)
        for what in ("names", "shapes", "dtypes"):
            if getattr(got, what) != getattr(self, what):
                raise ReferenceMismatch(str(self.root), f"{what} {getattr(got, what)[:4]}...")


def _root(key: str, value: object) -> Cid:
    if not isinstance(value, str) or len(value) > 256:
        raise BadReference(key, "root is not a CID string")
    try:
        cid = Cid.parse(value)
    except (CidError, ValueError) as exc:
        raise BadReference(key, f"root: {exc}") from exc
    if cid.codec is not Multicodec.TENSORSWAP_MANIFEST:
        raise BadReference(key, f"root {cid} is not a manifest")
    return cid


def _strings(key: str, what: str, value: object, longest: int) -> tuple[str, ...]:
    if not isinstance(value, Sequence) or isinstance(value, str | bytes):
        raise BadReference(key, f"{what} is not a list")
    if len(value) > MAX_ARRAYS:
        raise BadReference(key, f"{len(value)} {what}, at most {MAX_ARRAYS}")
    if not all(isinstance(v, str) and len(v) <= longest for v in value):
        raise BadReference(key, f"{what}: an entry is not a string of at most {longest}")
    return tuple(value)


def _shape(key: str, text: str) -> tuple[int, ...]:
    parts = text.split(",") if text else []
    if len(parts) > MAX_DIMS or not all(p.isdigit() and len(p) <= 19 for p in parts):
        raise BadReference(key, f"shape {text[:40]!r} is not up to {MAX_DIMS} dims")
    return tuple(int(p) for p in parts)


def _dtype(key: str, text: str) -> str:
    try:
        return DType.parse(text).value
    except (CodecError, ValueError) as exc:
        raise BadReference(key, f"dtype {text!r}: {exc}") from exc
