"""Flower apps on tensorswap's data plane: a ClientApp mod (``blocks_mod``) and a Strategy
wrapper (``BlockStrategy``) move a message's arrays as verified blocks through a block service
(and the swarm), the message carrying only a reference (root CID, names, shapes, dtypes).

Needs Flower (``tensorswap[flower]``, flwr 1.42) for the mod, the strategy and the records;
the reference format, the link and the service import without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tensorswap.flower.errors import (
    ArraysUnavailable,
    BadReference,
    FlowerBridgeError,
    ReferenceMismatch,
)
from tensorswap.flower.link import BlockLink, LinkCounters
from tensorswap.flower.node_store import NodeStore
from tensorswap.flower.reference import ArrayRef, is_reference
from tensorswap.flower.service import BlockService

if TYPE_CHECKING:
    from tensorswap.flower.mod import blocks_mod
    from tensorswap.flower.records import StoredArray
    from tensorswap.flower.strategy import BlockStrategy

__all__ = [
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

_NEEDS_FLOWER = {
    "blocks_mod": "tensorswap.flower.mod",
    "BlockStrategy": "tensorswap.flower.strategy",
    "StoredArray": "tensorswap.flower.records",
}


def __getattr__(name: str) -> Any:
    """The names that need flwr, imported on first use (the room imports without Flower)."""
    import importlib

    where = _NEEDS_FLOWER.get(name)
    if where is None:
        raise AttributeError(f"module 'tensorswap.flower' has no attribute {name!r}")
    return getattr(importlib.import_module(where), name)
