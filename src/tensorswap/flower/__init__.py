"""Flower apps on tensorswap's data plane: a ClientApp mod (``blocks_mod``) and a Strategy
wrapper (``BlockStrategy``) move a message's arrays as verified blocks through a block service
(and the swarm), the message carrying only a reference (root CID, names, shapes, dtypes).

Needs Flower (``tensorswap[flower]``, flwr 1.42) for the mod, the strategy and the records;
the reference format, the link and the service import without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tensorswap.flower.errors import (
    AggregateUnavailable,
    ArraysUnavailable,
    BadReference,
    FlowerBridgeError,
    ReferenceMismatch,
)
from tensorswap.flower.link import BlockLink, LinkCounters
from tensorswap.flower.node_store import NodeStore
from tensorswap.flower.reference import ArrayRef, is_reference

if TYPE_CHECKING:
    from tensorswap.flower.mod import blocks_mod
    from tensorswap.flower.records import StoredArray
    from tensorswap.flower.service import BlockService
    from tensorswap.flower.strategy import BlockStrategy

__all__ = [
    "AggregateUnavailable",
    "ArrayRef",
    "ArraysUnavailable",
    "BadReference",
    "BlockLink",
    "BlockService",
    "BlockStrategy",
    "FlowerBridgeError",
    "LinkCounters",
    "NodeStore",
    "ReferenceMismatch",
    "StoredArray",
    "blocks_mod",
    "is_reference",
]

_LAZY = {
    "blocks_mod": "tensorswap.flower.mod",
    "BlockService": "tensorswap.flower.service",
    "BlockStrategy": "tensorswap.flower.strategy",
    "StoredArray": "tensorswap.flower.records",
}
"""Names imported on first use: those that need flwr (the room imports without Flower), and
the service (the rounds coordinator: a ClientApp process, one per message, never needs it)."""


def __getattr__(name: str) -> Any:
    """The names of ``_LAZY``, imported on first use."""
    import importlib

    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module 'tensorswap.flower' has no attribute {name!r}")
    return getattr(importlib.import_module(where), name)
