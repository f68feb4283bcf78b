"""A manifest claiming a shape no array can have is a MalformedManifest, never numpy's error."""

from __future__ import annotations

import msgspec
import pytest

from tensorswap.cid import Multicodec
from tensorswap.codec.arrow import MAX_DECODED_VALUES
from tensorswap.store import (
    MANIFEST_MAGIC,
    MalformedManifest,
    MemoryStore,
    TensorManifest,
    decode_manifest,
    encode_manifest,
    get_tensor,
)


# ── manifests: shapes no array can have ────────────────────────────────────────
@pytest.mark.parametrize("shape", [(0, 2**40, 2**40), (0, 2**63), (2**64 - 1, 0)])
def test_zero_size_shape_beyond_any_array_is_a_malformed_manifest(shape: tuple[int, ...]) -> None:
    # Zero values, so the chunk sum checks out, but numpy cannot make an array of this shape:
    # get_tensor let numpy's ValueError escape from reshape.
    store = MemoryStore()
    manifest = TensorManifest("w", "float32", shape, 0, "dense", "", (), {})
    data = MANIFEST_MAGIC + msgspec.msgpack.encode(manifest)
    with pytest.raises(MalformedManifest, match="shape"):
        decode_manifest(data)
    cid = store.put(data, codec=Multicodec.TENSORSWAP_MANIFEST)
    with pytest.raises(MalformedManifest):
        get_tensor(store, cid)


def test_zero_size_shape_past_the_load_limit_is_refused_on_load() -> None:
    store = MemoryStore()
    shape = (0, MAX_DECODED_VALUES + 1)  # a valid manifest, but beyond what a load builds
    manifest = TensorManifest("w", "float32", shape, 0, "dense", "", (), {})
    cid = store.put(encode_manifest(manifest), codec=Multicodec.TENSORSWAP_MANIFEST)
    with pytest.raises(MalformedManifest, match="exceeds"):
        get_tensor(store, cid)
