"""Content-addressed block stores, tensor manifests and garbage collection."""

from tensorswap.store.base import BlockStore, StoreSize
from tensorswap.store.directory import DirectoryStore
from tensorswap.store.gc import GcResult, collect_garbage, reachable
from tensorswap.store.manifest import (
    DEFAULT_CHUNK_BYTES,
    MANIFEST_MAGIC,
    ChunkRef,
    MalformedManifest,
    Manifest,
    TensorManifest,
    TensorRef,
    UpdateManifest,
    chunk_bounds,
    chunk_starts,
    decode_chunk,
    decode_manifest,
    encode_manifest,
    is_manifest,
    manifest_closure,
    read_manifest,
    tensor_manifest,
    update_manifest,
)
from tensorswap.store.memory import MemoryStore
from tensorswap.store.tensors import ModelUpdate, get_tensor, get_update, put_tensor, put_update

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "MANIFEST_MAGIC",
    "BlockStore",
    "ChunkRef",
    "DirectoryStore",
    "GcResult",
    "MalformedManifest",
    "Manifest",
    "MemoryStore",
    "ModelUpdate",
    "StoreSize",
    "TensorManifest",
    "TensorRef",
    "UpdateManifest",
    "chunk_bounds",
    "chunk_starts",
    "collect_garbage",
    "decode_chunk",
    "decode_manifest",
    "encode_manifest",
    "get_tensor",
    "get_update",
    "is_manifest",
    "manifest_closure",
    "put_tensor",
    "put_update",
    "reachable",
    "read_manifest",
    "tensor_manifest",
    "update_manifest",
]
