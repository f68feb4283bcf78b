"""What a RoundClient decides about an update before it sends it: small or not, and the order
its blocks go in."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tensorswap.cid import Cid, Multicodec
from tensorswap.store import BlockStore, ModelUpdate, read_manifest

__all__ = ["SMALL_UPDATE", "children_first", "is_small"]

SMALL_UPDATE = 64 * 1024
"""Updates of at most this many bytes of values are stored and listed on the event loop."""


def is_small(update: ModelUpdate | Mapping[str, Any] | Cid) -> bool:
    """Whether ``update`` holds at most SMALL_UPDATE bytes of values (a CID: unknown, no)."""
    if isinstance(update, Cid):
        return False
    tensors = update.tensors if isinstance(update, ModelUpdate) else update
    total = 0
    for value in tensors.values():
        total += int(getattr(value, "nbytes", SMALL_UPDATE + 1))
        if total > SMALL_UPDATE:
            return False
    return True


def children_first(store: BlockStore, root: Cid) -> list[Cid]:
    """The blocks of ``root``, chunks before the manifests that list them (what a push sends),
    each manifest's links in its own order: a tensor's chunks go first to last, which is
    the order a cut-through round folds them in (``rounds.engine.cut``)."""
    order: list[Cid] = []
    seen: set[Cid] = set()

    def visit(cid: Cid) -> None:
        if cid in seen:
            return
        seen.add(cid)
        if cid.codec is Multicodec.TENSORSWAP_MANIFEST:
            for link in read_manifest(store, cid).links():
                visit(link)
        order.append(cid)

    visit(root)
    return order
