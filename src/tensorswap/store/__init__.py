"""Content-addressed block stores, tensor manifests and garbage collection."""

from tensorswap.store.base import BlockStore, StoreSize
from tensorswap.store.directory import DirectoryStore
from tensorswap.store.memory import MemoryStore

__all__ = ["BlockStore", "DirectoryStore", "MemoryStore", "StoreSize"]
