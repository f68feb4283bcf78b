"""Tensor and model-update manifests: round trips, chunking, dedup, closure, decoder safety."""

from __future__ import annotations

import contextlib
import json

import ml_dtypes
import msgspec
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensorswap.cid import Cid, HashFunction, Multicodec
from tensorswap.codec import Encoding, TensorBlock
from tensorswap.codec.lossy import ENCODINGS
from tensorswap.errors import BlockNotFound, StoreError, UnsupportedDtype
from tensorswap.store import (
    MANIFEST_MAGIC,
    BlockStore,
    ChunkRef,
    MalformedManifest,
    MemoryStore,
    ModelUpdate,
    TensorManifest,
    TensorRef,
    UpdateManifest,
    decode_manifest,
    encode_manifest,
    get_tensor,
    get_update,
    is_manifest,
    manifest_closure,
    put_tensor,
    put_update,
    read_manifest,
)

CHUNK = 64  # bytes per chunk in these tests: 16 float32 values


def _values(dtype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    if dtype == "bfloat16":
        return rng.standard_normal(n).astype(ml_dtypes.bfloat16).reshape(shape)
    if dtype.startswith("float"):
        return rng.standard_normal(n).astype(dtype).reshape(shape)
    return rng.integers(-100 if dtype.startswith("int") else 0, 100, n).astype(dtype).reshape(shape)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize(
    "dtype", ["float32", "float16", "bfloat16", "float64", "int8", "uint8", "int32", "int64"]
)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (1,), (7,), (5, 9), (2, 3, 17)])
def test_round_trip_dtypes_and_shapes(
    store: BlockStore, dtype: str, shape: tuple[int, ...]
) -> None:
    values = _values(dtype, shape)
    block = TensorBlock("layer.weight", values, num_samples=12, metadata={"k": "v"})
    cid = put_tensor(store, block, chunk_bytes=CHUNK)
    assert cid.codec is Multicodec.TENSORSWAP_MANIFEST
    back = get_tensor(store, cid)
    assert back == block
    assert _same(back.values, values)


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from(["float32", "float16", "bfloat16", "int8", "int64"]),
    shape=st.lists(st.integers(0, 9), max_size=3).map(tuple),
    chunk_bytes=st.integers(1, 100),
    seed=st.integers(0, 3),
)
def test_round_trip_property(
    dtype: str, shape: tuple[int, ...], chunk_bytes: int, seed: int
) -> None:
    store = MemoryStore()
    values = _values(dtype, shape, seed)
    cid = put_tensor(store, TensorBlock("x", values), chunk_bytes=chunk_bytes)
    assert _same(get_tensor(store, cid).values, values)
    assert store.missing(manifest_closure(store, cid)) == []


@pytest.mark.parametrize("extra", [-1, 0, 1])
@pytest.mark.parametrize("chunks", [1, 2, 3])
def test_chunk_boundaries(store: BlockStore, chunks: int, extra: int) -> None:
    n = chunks * (CHUNK // 4) + extra
    values = np.arange(n, dtype=np.float32)
    cid = put_tensor(store, TensorBlock("t", values), chunk_bytes=CHUNK)
    manifest = read_manifest(store, cid)
    assert isinstance(manifest, TensorManifest)
    counts = [c.values for c in manifest.chunks]
    assert sum(counts) == n
    assert all(c == CHUNK // 4 for c in counts[:-1]) and 0 < counts[-1] <= CHUNK // 4
    assert len(counts) == -(-n // (CHUNK // 4))
    assert _same(get_tensor(store, cid).values, values)


@pytest.mark.parametrize("workers", [1, 3])
def test_parallel_workers_give_the_same_cid(store: BlockStore, workers: int) -> None:
    values = _values("float32", (37, 11), seed=5)
    block = TensorBlock("p", values)
    serial = put_tensor(MemoryStore(), block, chunk_bytes=CHUNK, workers=1)
    cid = put_tensor(store, block, chunk_bytes=CHUNK, workers=workers)
    assert cid == serial
    assert _same(get_tensor(store, cid, workers=workers).values, values)
    with pytest.raises(ValueError, match="workers"):
        put_tensor(store, block, workers=0)


def test_single_chunk_is_zero_copy(store: BlockStore, monkeypatch: pytest.MonkeyPatch) -> None:
    cid = put_tensor(store, TensorBlock("t", np.arange(10, dtype=np.float32)))
    manifest = read_manifest(store, cid)
    assert isinstance(manifest, TensorManifest) and len(manifest.chunks) == 1
    views: list[memoryview] = []
    real_get = store.get

    def spy(cid: Cid, *, verify: bool | None = None) -> memoryview:
        views.append(real_get(cid, verify=verify))
        return views[-1]

    monkeypatch.setattr(store, "get", spy)
    values = get_tensor(store, cid).values
    chunk = np.frombuffer(views[-1], np.uint8)
    start = values.ctypes.data - chunk.ctypes.data
    assert 0 <= start < chunk.size and not values.flags.writeable


def test_non_contiguous_and_identical_chunks_dedup(store: BlockStore) -> None:
    base = np.zeros((8, 32), dtype=np.float32)
    cid = put_tensor(store, TensorBlock("t", base[:, ::2]), chunk_bytes=CHUNK)
    # 128 zeros in chunks of 16: eight identical chunks, one block
    manifest = read_manifest(store, cid)
    assert isinstance(manifest, TensorManifest)
    assert len(manifest.chunks) == 8 and len(set(manifest.links())) == 1
    assert store.size().blocks == 2
    assert _same(get_tensor(store, cid).values, np.zeros((8, 16), np.float32))


def test_a_chunk_listed_many_times_is_fetched_once(
    store: BlockStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    values = np.concatenate([np.zeros(64, np.float32), np.ones(16, np.float32)])
    cid = put_tensor(store, TensorBlock("t", values), chunk_bytes=CHUNK)  # 4 x zeros, 1 x ones
    fetched: list[Cid] = []
    get = store.get

    def counting_get(block: Cid, *, verify: bool | None = None) -> memoryview:
        fetched.append(block)
        return get(block, verify=verify)

    monkeypatch.setattr(store, "get", counting_get)
    assert _same(get_tensor(store, cid, verify=True).values, values)
    assert len(fetched) == 3 and len(set(fetched)) == 3  # the manifest and two distinct chunks


def test_deterministic_cids(store: BlockStore) -> None:
    block = TensorBlock("t", np.arange(100, dtype=np.int64), metadata={"b": "2", "a": "1"})
    first = put_tensor(store, block, chunk_bytes=CHUNK)
    again = TensorBlock("t", np.arange(100, dtype=np.int64), metadata={"a": "1", "b": "2"})
    assert put_tensor(MemoryStore(), again, chunk_bytes=CHUNK) == first
    assert put_tensor(store, block, chunk_bytes=2 * CHUNK) != first
    sha = put_tensor(store, block, hash=HashFunction.SHA2_256)
    assert sha.hash is HashFunction.SHA2_256
    assert all(c.hash is HashFunction.SHA2_256 for c in manifest_closure(store, sha))


def test_compression_and_lossy_encodings(store: BlockStore) -> None:
    values = np.linspace(-1, 1, 300, dtype=np.float32)
    zstd = put_tensor(store, TensorBlock("t", values), chunk_bytes=CHUNK, compression="zstd")
    assert _same(get_tensor(store, zstd).values, values)
    f16 = put_tensor(store, TensorBlock("t", values), chunk_bytes=CHUNK, encoding="f16")
    back = get_tensor(store, f16).values
    assert back.dtype == np.float32 and np.allclose(back, values, atol=1e-3)


def _update(seed: int, shared: np.ndarray) -> ModelUpdate:
    return ModelUpdate(
        {"embed": shared, "head": _values("float32", (4, 20), seed)},
        num_samples=10 + seed,
        metadata={"client": str(seed)},
        name=f"round-{seed}",
    )


def test_model_update_round_trip(store: BlockStore) -> None:
    update = _update(1, _values("bfloat16", (3, 30)))
    cid = put_update(store, update, chunk_bytes=CHUNK)
    back = get_update(store, cid)
    assert list(back.tensors) == ["embed", "head"]
    for name, values in update.tensors.items():
        assert _same(back.tensors[name], values)
    assert (back.num_samples, dict(back.metadata), back.name) == (11, {"client": "1"}, "round-1")
    manifest = read_manifest(store, cid)
    assert isinstance(manifest, UpdateManifest)
    assert [t.name for t in manifest.tensors] == ["embed", "head"]
    with pytest.raises(MalformedManifest, match="expected a tensor"):
        get_tensor(store, cid)
    with pytest.raises(MalformedManifest, match="expected an update"):
        get_update(store, manifest.tensors[0].cid)


def test_update_dedup_adds_only_new_chunks(store: BlockStore) -> None:
    shared = _values("float32", (10, 40))  # 400 values: 25 chunks
    first = put_update(store, _update(1, shared), chunk_bytes=CHUNK)
    before = store.size()
    second = put_update(store, _update(2, shared), chunk_bytes=CHUNK)
    after = store.size()
    # new: 5 "head" chunks, the "head" tensor manifest, the update manifest
    assert after.blocks - before.blocks == 5 + 1 + 1
    assert store.missing(manifest_closure(store, second)) == []
    assert set(manifest_closure(store, first)) & set(manifest_closure(store, second))


def test_closure_and_missing_after_chunk_delete(store: BlockStore) -> None:
    cid = put_update(store, _update(3, _values("int32", (50,))), chunk_bytes=CHUNK)
    closure = manifest_closure(store, cid)
    assert closure[0] == cid and len(closure) == len(set(closure))
    assert set(closure) == set(store)
    chunk = closure[-1]
    assert chunk.codec is Multicodec.RAW
    store.delete(chunk)
    assert store.missing(closure) == [chunk]
    with pytest.raises(BlockNotFound):
        get_update(store, cid)
    raw = store.put(b"leaf")
    assert manifest_closure(store, raw) == [raw]


def test_closure_of_missing_manifest_raises(store: BlockStore) -> None:
    with pytest.raises(BlockNotFound):
        manifest_closure(store, Cid.of(b"x", codec=Multicodec.TENSORSWAP_MANIFEST))


def test_manifest_bytes_start_with_magic_and_are_deterministic() -> None:
    ref = ChunkRef(Cid.of(b"c").to_bytes(), 4, 100)
    manifest = TensorManifest("n", "float32", (4,), 0, "dense", "", (ref,), {"z": "1", "a": "2"})
    data = encode_manifest(manifest)
    assert data.startswith(MANIFEST_MAGIC) and is_manifest(data)
    assert decode_manifest(data) == manifest
    reordered = TensorManifest("n", "float32", (4,), 0, "dense", "", (ref,), {"a": "2", "z": "1"})
    assert encode_manifest(reordered) == data
    assert not is_manifest(b"TSMF")


def _tensor_manifest(**changes: object) -> TensorManifest:
    fields: dict[str, object] = {
        "name": "n",
        "dtype": "float32",
        "shape": (2, 3),
        "num_samples": 0,
        "encoding": "dense",
        "compression": "",
        "chunks": (
            ChunkRef(Cid.of(b"a").to_bytes(), 4, 10),
            ChunkRef(Cid.of(b"b").to_bytes(), 2, 9),
        ),
        "metadata": {},
    }
    fields.update(changes)
    return TensorManifest(**fields)  # type: ignore[arg-type]


MANIFEST_CID = Cid.of(b"m", codec=Multicodec.TENSORSWAP_MANIFEST).to_bytes()


@pytest.mark.parametrize(
    "manifest, reason",
    [
        (_tensor_manifest(dtype="complex64"), "complex64"),
        (_tensor_manifest(encoding="rot13"), "rot13"),
        (_tensor_manifest(compression="gzip"), "compression"),
        (_tensor_manifest(shape=(2, -3)), "shape"),
        (_tensor_manifest(shape=(1,) * 65), "shape"),
        (_tensor_manifest(shape=(7,)), "7"),
        (_tensor_manifest(chunks=(ChunkRef(MANIFEST_CID, 6, 1),)), "raw"),
        (_tensor_manifest(chunks=(ChunkRef(Cid.of(b"a").to_bytes(), 0, 1),) * 2), "0 values"),
        (_tensor_manifest(num_samples=-1), "num_samples"),
        (UpdateManifest("u", 1, (TensorRef("a", MANIFEST_CID),) * 2, {}), "duplicate"),
        (UpdateManifest("u", 1, (TensorRef("a", Cid.of(b"a").to_bytes()),), {}), "not a manifest"),
    ],
)
def test_invalid_manifests_are_refused(manifest: TensorManifest, reason: str) -> None:
    with pytest.raises(MalformedManifest, match=reason):
        encode_manifest(manifest)
    raw = MANIFEST_MAGIC + msgspec.msgpack.encode(manifest)
    with pytest.raises(MalformedManifest, match=reason):
        decode_manifest(raw)


@pytest.mark.parametrize(
    "data, reason",
    [
        (b"", "TSMF"),
        (b"TSMF\x02", "TSMF"),
        (MANIFEST_MAGIC, "truncated"),
        (MANIFEST_MAGIC + msgspec.msgpack.encode({"kind": "blob"}), "blob"),
        (MANIFEST_MAGIC + msgspec.msgpack.encode([1, 2]), "Expected `object`"),
        (encode_manifest(_tensor_manifest()) + b"\x00", "trailing"),
    ],
)
def test_decoder_refuses_garbage(data: bytes, reason: str) -> None:
    with pytest.raises(MalformedManifest, match=reason) as info:
        decode_manifest(data)
    assert isinstance(info.value, StoreError) and isinstance(info.value, ValueError)


def test_bad_chunk_cid_bytes_refused() -> None:
    good = encode_manifest(_tensor_manifest())
    cid = Cid.of(b"a").to_bytes()
    broken = good.replace(cid, b"\x01\x55\x1e\x21" + cid[4:] + b"!")
    with pytest.raises(MalformedManifest):
        decode_manifest(broken)


@settings(suppress_health_check=[HealthCheck.too_slow], max_examples=200)
@given(st.data())
def test_truncated_or_mutated_manifest_gives_typed_error(data: st.DataObject) -> None:
    good = encode_manifest(_tensor_manifest(metadata={"key": "value"}))
    cut = data.draw(st.integers(0, len(good) - 1))
    with pytest.raises(MalformedManifest):
        decode_manifest(good[:cut])
    pos = data.draw(st.integers(0, len(good) - 1))
    flipped = bytearray(good)
    flipped[pos] ^= data.draw(st.integers(1, 255))
    with contextlib.suppress(MalformedManifest):
        decode_manifest(bytes(flipped))


@given(st.binary(max_size=300))
def test_random_bytes_give_typed_error(raw: bytes) -> None:
    for candidate in (raw, MANIFEST_MAGIC + raw):
        with contextlib.suppress(MalformedManifest):
            decode_manifest(candidate)


def test_lying_manifest_is_caught_on_load(store: BlockStore) -> None:
    chunk = put_tensor(store, TensorBlock("", np.arange(4, dtype=np.float32)))
    real = read_manifest(store, chunk)
    assert isinstance(real, TensorManifest)
    (ref,) = real.chunks
    cases = {
        "says int32": _tensor_manifest(dtype="int32", shape=(4,), chunks=(ref,)),
        "bytes": _tensor_manifest(shape=(4,), chunks=(ChunkRef(ref.cid_bytes, 4, ref.nbytes + 1),)),
        "holds": _tensor_manifest(shape=(4,), chunks=(ChunkRef(ref.cid_bytes, 2, ref.nbytes),) * 2),
    }
    for reason, lie in cases.items():
        cid = store.put(encode_manifest(lie), codec=Multicodec.TENSORSWAP_MANIFEST)
        with pytest.raises(MalformedManifest, match=reason):
            get_tensor(store, cid)
    too_big = _tensor_manifest(shape=(10**9,), chunks=(ChunkRef(ref.cid_bytes, 10**9, ref.nbytes),))
    cid = store.put(encode_manifest(too_big), codec=Multicodec.TENSORSWAP_MANIFEST)
    with pytest.raises(MalformedManifest, match="bytes"):
        get_tensor(store, cid)
    with pytest.raises(MalformedManifest, match="not a manifest CID"):
        read_manifest(store, ref.cid)
    not_arrow = store.put(b"\x00" * ref.nbytes)
    fake = _tensor_manifest(shape=(4,), chunks=(ChunkRef(not_arrow.to_bytes(), 4, ref.nbytes),))
    cid = store.put(encode_manifest(fake), codec=Multicodec.TENSORSWAP_MANIFEST)
    with pytest.raises(MalformedManifest, match="chunk 0"):
        get_tensor(store, cid)


def test_compressed_chunks_are_checked_before_allocating(store: BlockStore) -> None:
    real = put_tensor(
        store, TensorBlock("", np.zeros(8, np.float32)), chunk_bytes=16, compression="zstd"
    )
    manifest = read_manifest(store, real)
    assert isinstance(manifest, TensorManifest) and len(manifest.chunks) == 2
    ref = manifest.chunks[0]
    huge = ChunkRef(ref.cid_bytes, 2**33, ref.nbytes)
    lie = _tensor_manifest(shape=(2**33 + 4,), compression="zstd", chunks=(huge, ref))
    cid = store.put(encode_manifest(lie), codec=Multicodec.TENSORSWAP_MANIFEST)
    with pytest.raises(MalformedManifest, match="holds float32 \\[4\\]"):
        get_tensor(store, cid)
    beyond = ChunkRef(ref.cid_bytes, 10**12, ref.nbytes)  # past what any load allows
    lie = _tensor_manifest(shape=(10**12 + 4,), compression="zstd", chunks=(beyond, ref))
    cid = store.put(encode_manifest(lie), codec=Multicodec.TENSORSWAP_MANIFEST)
    with pytest.raises(MalformedManifest, match="exceeds"):
        get_tensor(store, cid)


@pytest.mark.parametrize(
    "options", [{"compression": "zstd"}, {"encoding": "f16"}, {"encoding": "topk"}]
)
@pytest.mark.parametrize("shape", [(0,), (3, 0, 2)])
def test_tensor_of_zero_values_round_trips_with_any_encoding(
    store: BlockStore, options: dict[str, str], shape: tuple[int, ...]
) -> None:
    block = TensorBlock("e", np.zeros(shape, np.float32))
    cid = put_tensor(store, block, **options)  # type: ignore[arg-type]
    back = get_tensor(store, cid).values
    assert back.dtype == np.float32 and back.shape == shape


def _topk_block_claiming(shape: tuple[int, ...]) -> bytes:
    """A valid topk block keeping no entry (k=0) of a tensor of `shape`: a few hundred bytes."""
    header = {
        "dtype": "float32",
        "encoding": "topk",
        "kind": "tensor",
        "meta": {},
        "name": "",
        "num_samples": 0,
        "params": {"k": 0},
        "shape": list(shape),
        "v": 1,
    }
    fields = [pa.field("indices", pa.int64(), False), pa.field("values", pa.float32(), False)]
    schema = pa.schema(fields, metadata={b"tensorswap.block": json.dumps(header).encode()})
    columns = [pa.array([], pa.int64()), pa.array([], pa.float32())]
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as writer:
        writer.write_batch(pa.RecordBatch.from_arrays(columns, schema=schema))
    return bytes(sink.getvalue().to_pybytes())


def test_chunk_header_cannot_claim_more_values_than_the_manifest(
    store: BlockStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    topk = type(ENCODINGS[Encoding.TOPK])
    built: list[int] = []
    real_decode = topk.decode

    def spy(self: object, cols: object, params: object, dtype: object, size: int) -> np.ndarray:
        built.append(size)
        return real_decode(self, cols, params, dtype, size)  # type: ignore[arg-type]

    monkeypatch.setattr(topk, "decode", spy)
    raw = _topk_block_claiming((1 << 20,))
    chunk = store.put(raw)
    lie = _tensor_manifest(
        shape=(1,), encoding="topk", chunks=(ChunkRef(chunk.to_bytes(), 1, len(raw)),)
    )
    cid = store.put(encode_manifest(lie), codec=Multicodec.TENSORSWAP_MANIFEST)
    with pytest.raises(MalformedManifest, match="chunk 0"):
        get_tensor(store, cid)
    assert built == []  # refused from the header: no tensor of 2**20 values was built


def test_model_update_validates() -> None:
    with pytest.raises(TypeError):
        ModelUpdate({}, num_samples=True)
    with pytest.raises(ValueError):
        ModelUpdate({}, num_samples=-1)
    with pytest.raises(UnsupportedDtype):
        ModelUpdate({"x": np.zeros(2, np.complex64)})


def test_torch_tensors_accepted(store: BlockStore) -> None:
    torch = pytest.importorskip("torch")
    weights = torch.arange(40, dtype=torch.bfloat16).reshape(4, 10)
    cid = put_update(store, ModelUpdate({"w": weights}, num_samples=3), chunk_bytes=CHUNK)
    back = get_update(store, cid).tensors["w"]
    assert back.dtype == ml_dtypes.bfloat16
    assert back.tobytes() == weights.view(torch.int16).numpy().tobytes()


def test_deeply_nested_msgpack_is_malformed_not_a_recursion_error() -> None:
    # the tag comes last, so msgspec skips the deep value first (by recursion)
    body = b"\x82\xa4name" + b"\x91" * 100_000 + b"\xc0" + b"\xa4kind\xa6tensor"
    with pytest.raises(MalformedManifest):
        decode_manifest(MANIFEST_MAGIC + body)
