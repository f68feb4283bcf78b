"""The tensorswap error tree: one root, a branch per layer, precise leaves.

::

    TensorSwapError
    ├── CodecError                 (codec: encode/decode of tensor blocks and legacy formats)
    │   ├── UnsupportedDtype       (also ValueError)
    │   ├── TruncatedData          a length or count points past the end of the buffer
    │   ├── InvalidMagic           the bytes are not the format they claim to be
    │   ├── MalformedBlock         structurally broken Arrow IPC / metadata
    │   └── ShapeMismatch          (also ValueError)
    ├── CidError                   (cid)
    │   ├── InvalidCid             (also ValueError) a string or bytes that is no CID we read
    │   └── HashMismatch           bytes do not hash to the CID they were given under
    ├── StoreError                 (store)
    │   ├── BlockNotFound          (also KeyError)
    │   └── CorruptBlock           a stored block no longer matches its CID
    ├── AggregationError           (aggregate) (also ValueError)
    │   ├── EmptyInput
    │   ├── ShapeMismatch          (the codec leaf is shared: same facts, same name)
    │   ├── DtypeMismatch
    │   └── NonFiniteValues
    ├── WireError                  (wire: leaves in tensorswap.wire.errors)
    │   └── TransportError         (transport: byte streams under wire and delta; leaves in
    │                              tensorswap.transport.errors, re-exported by wire.errors)
    ├── RoundsError                (rounds: leaves in tensorswap.errors.rounds; its RunsError
    │                              branch in tensorswap.errors.runs, region's leaves in
    │                              tensorswap.errors.region)
    ├── PrivacyError               (privacy: DP leaves in tensorswap.errors.privacy, and the
    │   └── SecAggError            SecAgg+ branch in tensorswap.errors.secagg)
    ├── DeltaError                 (delta: leaves next to their raisers in tensorswap.delta)
    ├── FlowError                  (flow: leaves in tensorswap.flow.errors)
    ├── CollectiveError            (collective: peers averaging among themselves; leaves in
    │                              tensorswap.errors.collective)
    ├── NetlabError                (netlab: the network lab of namespaces; leaves in
    │                              tensorswap.netlab.errors)
    ├── FlowerBridgeError          (flower: Flower messages' arrays as block references;
    │                              leaves in tensorswap.errors.flower)
    ├── TensorNamesMismatch        (torch) (also ValueError) named tensors disagree on names
    ├── HostPortError              (also ValueError) text that is not HOST:PORT (misuse)
    ├── DemoError                  (demo) (also RuntimeError) the demo could not run
    └── UvloopMissing              (also RuntimeError) uvloop asked for, not installed
                                   (in tensorswap._eventloop)

Layer packages define further leaves next to their raisers, always under the branch of
their layer (the rounds, runs, privacy, secagg and region leaves live in this package, so
that importing it registers every refusal a coordinator may send: ``register_remote``),
and no two error classes share a name (tests/test_error_tree.py checks both).
Lower-level exceptions (pyarrow, zmq, OSError) are translated at the layer boundary with
``raise ... from exc``. Every error carries its facts as attributes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any


class TensorSwapError(Exception):
    """Root of every error tensorswap raises on purpose."""


# ── codec ────────────────────────────────────────────────────────────────────
class CodecError(TensorSwapError):
    """Encoding or decoding a tensor block failed."""


class UnsupportedDtype(CodecError, ValueError):
    """A dtype that the chosen encoding cannot carry."""

    def __init__(self, dtype: object, supported: Sequence[str] = ()) -> None:
        self.dtype = str(dtype)
        self.supported = tuple(supported)
        extra = f"; supported: {', '.join(self.supported)}" if self.supported else ""
        super().__init__(f"unsupported dtype {self.dtype!r}{extra}")


class TruncatedData(CodecError):
    """A length or count read from the bytes points past the end of the buffer."""

    def __init__(self, what: str, needed: int, available: int) -> None:
        self.what = what
        self.needed = needed
        self.available = available
        super().__init__(
            f"truncated data reading {what}: needed {needed} bytes, {available} available"
        )


class InvalidMagic(CodecError):
    """The bytes do not start with the magic of the format they are decoded as."""

    def __init__(self, format_name: str, expected: bytes, found: bytes) -> None:
        self.format_name = format_name
        self.expected = expected
        self.found = found
        super().__init__(f"invalid magic for {format_name}: expected {expected!r}, got {found!r}")


class MalformedBlock(CodecError):
    """Structurally broken input: bad Arrow IPC, missing column, inconsistent metadata."""


class ShapeMismatch(CodecError, ValueError):
    """Two shapes that must agree do not (raised by the codec and by aggregation)."""

    def __init__(
        self, expected: Sequence[int], got: Sequence[int], context: str = "", *, what: str = ""
    ) -> None:
        self.expected = tuple(int(d) for d in expected)
        self.got = tuple(int(d) for d in got)
        self.context = context
        where = f" ({context})" if context else ""
        msg = what or f"shape mismatch{where}: expected {list(self.expected)}, got {list(self.got)}"
        super().__init__(msg)


# ── cid ──────────────────────────────────────────────────────────────────────
class CidError(TensorSwapError):
    """Parsing, building or verifying a content identifier failed."""


class InvalidCid(CidError, ValueError):
    """A string or byte string that is not a CID tensorswap understands."""

    def __init__(self, value: object, reason: str) -> None:
        self.value = value
        self.reason = reason
        shown = value if isinstance(value, str) else repr(value)
        if isinstance(shown, str) and len(shown) > 80:
            shown = shown[:77] + "..."
        super().__init__(f"invalid CID {shown}: {reason}")


class HashMismatch(CidError):
    """Bytes do not hash to the CID they were presented under."""

    def __init__(self, cid: object, actual: object, context: str = "") -> None:
        self.cid = cid
        self.actual = actual
        self.context = context
        where = f" ({context})" if context else ""
        super().__init__(f"content does not match CID {cid}{where}: it hashes to {actual}")


# ── store ────────────────────────────────────────────────────────────────────
class StoreError(TensorSwapError):
    """A block store operation failed."""


class BlockNotFound(StoreError, KeyError):
    """The store does not hold the requested block."""

    def __init__(self, cid: object) -> None:
        self.cid = cid
        super().__init__(f"block not found: {cid}")

    def __str__(self) -> str:  # KeyError quotes its argument; keep the plain message
        return str(self.args[0])


class CorruptBlock(StoreError):
    """A stored block no longer matches its CID; its bytes are never returned."""

    def __init__(self, cid: object, path: object = None, detail: str = "") -> None:
        self.cid = cid
        self.path = path
        self.detail = detail
        where = f" at {path}" if path is not None else ""
        more = f": {detail}" if detail else ""
        super().__init__(f"corrupt block {cid}{where}{more}")


# ── aggregate ────────────────────────────────────────────────────────────────
class AggregationError(TensorSwapError, ValueError):
    """Contributions could not be aggregated; nothing was computed."""


class EmptyInput(AggregationError):
    """No contributions were given."""

    def __init__(self, what: str = "No gradient blocks provided") -> None:
        super().__init__(what)


class AggregateShapeMismatch(AggregationError, ShapeMismatch):
    """Contributions disagree on a shape."""


class DtypeMismatch(AggregationError):
    """Contributions disagree on a dtype."""

    def __init__(self, expected: object, got: object, context: str = "") -> None:
        self.expected = str(expected)
        self.got = str(got)
        self.context = context
        where = f" ({context})" if context else ""
        super().__init__(f"dtype mismatch{where}: expected {self.expected}, got {self.got}")


class NonFiniteValues(AggregationError):
    """A contribution holds NaN or infinite values."""

    def __init__(self, index: int, count: int, context: str = "") -> None:
        self.index = index
        self.count = count
        self.context = context
        where = f" ({context})" if context else ""
        super().__init__(f"contribution {index} has {count} non-finite values{where}")


# ── higher layers: their leaves live next to their raisers ───────────────────
class WireError(TensorSwapError):
    """Sending or receiving frames or blocks failed."""


class TransportError(WireError):
    """A byte stream failed: connect, send, receive, a peer refusing us, use after close.

    The transport layer (``tensorswap.transport``) sits under both wire and delta; its
    branch stays inside WireError so that ``except WireError`` still catches it.
    """


class RoundsError(TensorSwapError):
    """A coordinator round operation failed."""


class DeltaError(TensorSwapError):
    """Building, verifying, sending or applying a weight-delta fragment failed."""


class FlowError(TensorSwapError):
    """Encoding, validating or exchanging a typed training message failed."""


class NetlabError(TensorSwapError):
    """The network lab (namespaces, links, shaping, relays) could not be built or driven."""


class PrivacyError(TensorSwapError):
    """Privacy: a differentially private run could not do what was asked, or a secure
    aggregation (SecAgg+) failed. Leaves in ``tensorswap.errors.privacy`` (DP) and
    ``tensorswap.errors.secagg`` (its ``SecAggError`` branch)."""


# ── the remote error registry ────────────────────────────────────────────────
_REMOTE: dict[str, type[TensorSwapError]] = {}


def register_remote(*classes: type[TensorSwapError]) -> None:
    """Make error types known to every client as a coordinator's refusals: a refusal that
    names ``cls.__name__`` (the wire's code) is raised as ``cls`` with its facts (see
    ``tensorswap.rounds.protocol.raise_remote``); any other code is a bare RemoteError.

    Each errors module calls this for its leaves where they are defined, and this package
    imports every built-in one, so which type a client raises never depends on what else the
    process imported. A second, different class under a taken name is a ValueError."""
    for cls in classes:
        if not (isinstance(cls, type) and issubclass(cls, TensorSwapError)):
            raise TypeError(f"only TensorSwapError types cross the wire, not {cls!r}")
        held = _REMOTE.setdefault(cls.__name__, cls)
        if held is not cls:
            raise ValueError(
                f"two remote error types are named {cls.__name__}: "
                f"{held.__module__} and {cls.__module__}"
            )


def remote_types() -> Mapping[str, type[TensorSwapError]]:
    """Every registered remote error type by name (a live, read-only view)."""
    return MappingProxyType(_REMOTE)


__all__ = [
    "AggregateShapeMismatch",
    "AggregationError",
    "BlockNotFound",
    "CidError",
    "CodecError",
    "CorruptBlock",
    "DeltaError",
    "DtypeMismatch",
    "EmptyInput",
    "FlowError",
    "HashMismatch",
    "InvalidCid",
    "InvalidMagic",
    "MalformedBlock",
    "NetlabError",
    "NonFiniteValues",
    "PrivacyError",
    "RoundsError",
    "ShapeMismatch",
    "StoreError",
    "TensorSwapError",
    "TransportError",
    "TruncatedData",
    "UnsupportedDtype",
    "WireError",
    "register_remote",
    "remote_types",
]

# The leaves of the rounds, runs, privacy and region branches: defined here (not in their
# rooms, whose ``errors`` modules re-export them), so importing tensorswap.errors registers
# every built-in remote refusal without importing those rooms.
from tensorswap.errors import collective, flower, privacy, region, rounds, runs, secagg  # noqa: E402
from tensorswap.errors.collective import *  # noqa: E402, F403
from tensorswap.errors.flower import *  # noqa: E402, F403
from tensorswap.errors.privacy import *  # noqa: E402, F403
from tensorswap.errors.region import *  # noqa: E402, F403
from tensorswap.errors.rounds import *  # noqa: E402, F403
from tensorswap.errors.runs import *  # noqa: E402, F403
from tensorswap.errors.secagg import *  # noqa: E402, F403

__all__ += [
    name
    for leaves in (collective, flower, privacy, region, rounds, runs, secagg)
    for name in leaves.__all__
    if name not in __all__
]


def __getattr__(name: str) -> Any:
    """The rest of the tree (wire, transport, codec, store, aggregate, delta, flow, swarm,
    netlab, simulate, demo errors): imported from the module that defines it on first use."""
    import importlib

    from tensorswap.errors._index import ELSEWHERE

    where = ELSEWHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'tensorswap.errors' has no attribute {name!r}")
    return getattr(importlib.import_module(where), name)


def __dir__() -> list[str]:
    from tensorswap.errors._index import ELSEWHERE

    return sorted(set(globals()) | set(ELSEWHERE))
