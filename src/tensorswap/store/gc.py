"""Garbage collection: remove the blocks that no root manifest reaches."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tensorswap.cid import Cid
from tensorswap.errors import BlockNotFound
from tensorswap.store.base import BlockStore
from tensorswap.store.directory import DirectoryStore
from tensorswap.store.manifest import manifest_closure

__all__ = ["GcResult", "collect_garbage", "reachable"]


@dataclass(frozen=True, slots=True)
class GcResult:
    """What a collection did (or, for a dry run, would do)."""

    removed: int
    removed_bytes: int
    kept: int
    kept_bytes: int
    temp_files_removed: int = 0
    spared: int = 0
    """Unreachable blocks kept because they are younger than ``min_age`` (counted in kept)."""


def reachable(store: BlockStore, roots: Iterable[Cid]) -> set[Cid]:
    """Every block reachable from ``roots`` by following manifests (raw blocks are leaves).

    A root the store lacks contributes nothing; a manifest that a present root links but the
    store lacks (or holds corrupt) raises, since what it links cannot be known.
    """
    found: set[Cid] = set()
    for root in roots:
        if root in found:
            continue
        if not store.has(root):
            continue
        found.update(manifest_closure(store, root))
    return found


def collect_garbage(
    store: BlockStore,
    roots: Iterable[Cid],
    *,
    dry_run: bool = False,
    temp_file_age: float | None = 3600.0,
    min_age: float = 0.0,
    listed: Iterable[Cid] | None = None,
) -> GcResult:
    """Delete every block not reachable from ``roots``; report counts and bytes.

    ``min_age`` (seconds) spares unreachable blocks stored or touched more recently than
    that (``BlockStore.age_of``; a store that keeps no ages spares every unreachable block
    then): the grace period that protects blocks a client pushed but has not yet referenced.

    The store is listed before reachability is computed, so a block put while a collection
    runs is never removed by it; but a block that was already present, unreferenced, when the
    listing ran is removed even if a manifest put meanwhile starts linking it: pass the roots
    of writes in flight, or collect while no one writes. If a linked manifest cannot be read,
    BlockNotFound / CorruptBlock / MalformedManifest is raised and nothing is deleted. For a
    DirectoryStore, temp files older than ``temp_file_age`` seconds are removed too (None:
    not looked for).

    ``listed``: the blocks to consider, listed by the caller before it computed ``roots``
    (default: the store's listing now), so that a caller holding off writers while it
    decides need not hold them off while the store is listed.
    """
    if min_age < 0:
        raise ValueError(f"min_age must not be negative, got {min_age}")
    listed = list(store) if listed is None else list(listed)
    keep = reachable(store, roots)
    removed = removed_bytes = kept = kept_bytes = spared = 0
    for cid in listed:
        try:
            nbytes = store.size_of(cid)
            young = cid not in keep and min_age > 0 and dry_run and _younger(store, cid, min_age)
        except BlockNotFound:
            continue  # deleted by someone else meanwhile
        if cid in keep or young:
            kept += 1
            kept_bytes += nbytes
            spared += young
            continue
        if dry_run:
            gone: bool | None = True
        elif min_age > 0:  # the age check and the delete in one step (see delete_if_older)
            gone = store.delete_if_older(cid, min_age)
        else:
            gone = store.delete(cid)
        if gone is None:
            kept += 1
            kept_bytes += nbytes
            spared += 1
        elif gone:
            removed += 1
            removed_bytes += nbytes
    temps = 0
    if isinstance(store, DirectoryStore) and not dry_run and temp_file_age is not None:
        temps = store.remove_temp_files(older_than=temp_file_age)
    return GcResult(removed, removed_bytes, kept, kept_bytes, temps, spared)


def _younger(store: BlockStore, cid: Cid, seconds: float) -> bool:
    age = store.age_of(cid)
    return age is None or age < seconds
