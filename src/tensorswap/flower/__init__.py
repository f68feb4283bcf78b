"""Flower apps on tensorswap's data plane: a ClientApp mod (``blocks_mod``) and a Strategy
wrapper (``BlockStrategy``) move a message's arrays as verified blocks through a block service
(and the swarm), the message carrying only a reference (root CID, names, shapes, dtypes).

Needs Flower (``tensorswap[flower]``, flwr 1.42) for the mod, the strategy and the records;
the reference format, the link and the service import without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tensorswap.flower.errors import (
        AggregateUnavailable,
        ArraysUnavailable,
        BadReference,
        FlowerBridgeError,
        ReferenceMismatch,
    )
    from tensorswap.flower.link import BlockLink, LinkCounters
    from tensorswap.flower.mod import blocks_mod
    from tensorswap.flower.node_store import NodeStore
    from tensorswap.flower.records import StoredArray
    from tensorswap.flower.reference import ArrayRef, is_reference
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
    "AggregateUnavailable": "tensorswap.flower.errors",
    "ArraysUnavailable": "tensorswap.flower.errors",
    "BadReference": "tensorswap.flower.errors",
    "FlowerBridgeError": "tensorswap.flower.errors",
    "ReferenceMismatch": "tensorswap.flower.errors",
    "ArrayRef": "tensorswap.flower.reference",
    "is_reference": "tensorswap.flower.reference",
    "BlockLink": "tensorswap.flower.link",
    "LinkCounters": "tensorswap.flower.link",
    "NodeStore": "tensorswap.flower.node_store",
    "blocks_mod": "tensorswap.flower.mod",
    "BlockService": "tensorswap.flower.service",
    "BlockStrategy": "tensorswap.flower.strategy",
    "StoredArray": "tensorswap.flower.records",
}
"""Every name is imported on first use: those that need flwr (the room imports without
Flower), the service (the rounds coordinator), and the data plane (link, store, wire, swarm):
a deployed ClientApp starts a process per message, which imports the app, and so this
package, before it knows whether its message needs any of it (``mod``'s docstring)."""


def __getattr__(name: str) -> Any:
    """The names of ``_LAZY``, imported on first use."""
    import importlib

    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module 'tensorswap.flower' has no attribute {name!r}")
    return getattr(importlib.import_module(where), name)
