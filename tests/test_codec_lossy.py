"""Lossy encodings: every decoded value within its documented bound, refusals as documented."""

from __future__ import annotations

import math
from typing import Any

import hypothesis.extra.numpy as hnp
import ml_dtypes
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensorswap.codec import DType, Encoding, LossyValueError, TensorBlock, decode_block
from tensorswap.codec import encode_block as _encode_block
from tensorswap.codec.lossy import (
    BF16_MAX,
    BF16_OVERFLOW,
    F16_MAX,
    F16_VIA_BF16_MAX,
    INT8_EPS,
    INT8_TINY,
)
from tensorswap.errors import MalformedBlock, UnsupportedDtype

FLOATS = [DType.FLOAT32, DType.FLOAT16, DType.BFLOAT16, DType.FLOAT64]
LOSSY = [Encoding.F16, Encoding.BF16, Encoding.INT8, Encoding.TOPK]
COMPRESSIONS = [None, "lz4", "zstd"]


def encode_block(block: TensorBlock, **kw: Any) -> bytes:
    return bytes(_encode_block(block, **kw))


def _values(dtype: DType, limit: float) -> st.SearchStrategy[np.ndarray]:
    """Finite arrays of `dtype` (subnormals and signed zeros included), |x| <= limit."""
    width = {DType.FLOAT16: 16, DType.FLOAT64: 64}.get(dtype, 32)
    elements = st.floats(-limit, limit, width=width, allow_nan=False, allow_infinity=False)
    np_dtype = np.float32 if dtype is DType.BFLOAT16 else dtype.numpy
    arrays = hnp.arrays(
        np_dtype, hnp.array_shapes(min_dims=0, max_dims=3, max_side=6), elements=elements
    )
    return arrays.map(lambda a: a.astype(dtype.numpy))


def _wide(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, dtype=np.float64)


def _refused(x: np.ndarray, dtype: DType, encoding: Encoding) -> bool:
    """The documented refusals (values out of the target's range)."""
    m = float(np.abs(_wide(x)).max()) if x.size else 0.0
    if encoding is Encoding.F16:
        return m > F16_MAX
    if encoding is Encoding.BF16:
        return m >= BF16_OVERFLOW or (dtype is DType.FLOAT16 and m >= F16_VIA_BF16_MAX)
    return False


def _check_bound(x: np.ndarray, y: np.ndarray, encoding: Encoding, params: dict[str, Any]) -> None:
    """Assert the bound of `encoding` (module docstring of tensorswap.codec.lossy) holds."""
    dtype = DType.of(x.dtype)
    xw, yw = _wide(x).reshape(-1), _wide(y).reshape(-1)
    err = np.abs(yw - xw)
    if encoding is Encoding.F16:
        bound = np.where(np.abs(xw) >= 2.0**-14, 2.0**-11 * np.abs(xw), 2.0**-25)
    elif encoding is Encoding.BF16:
        bound = np.where(np.abs(xw) >= 2.0**-126, 2.0**-8 * np.abs(xw), 2.0**-133)
    elif encoding is Encoding.INT8:
        lo, hi = (float(xw.min()), float(xw.max())) if xw.size else (0.0, 0.0)
        scale = float(params["scale"])
        assert params["offset"] == lo
        expect = (hi - lo) / 255.0
        assert scale == expect or (scale == 0.0 and expect < np.finfo(np.float64).tiny)
        m = max(abs(lo), abs(hi))
        bound = np.full(xw.shape, scale / 2 + INT8_EPS[dtype] * m + INT8_TINY[dtype])
    else:
        kept = yw != 0
        bits = np.dtype(f"u{x.dtype.itemsize}")
        kept_bits = y.reshape(-1).view(bits)[kept]
        assert np.array_equal(kept_bits, x.reshape(-1).view(bits)[kept])  # kept entries exact
        smallest_kept = float(np.abs(yw[kept]).min()) if kept.any() else 0.0
        bound = np.where(kept, 0.0, smallest_kept)
    over = err > bound
    assert not over.any(), (xw[over][:5], yw[over][:5], bound[over][:5])


def _params(raw: bytes) -> dict[str, Any]:
    import msgspec

    schema = pa.ipc.open_stream(raw).schema
    return dict(msgspec.json.decode(schema.metadata[b"tensorswap.block"])["params"])


# ── round trips within the bound, every dtype x encoding x compression ───────
@settings(
    max_examples=250, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    data=st.data(),
    dtype=st.sampled_from(FLOATS),
    encoding=st.sampled_from(LOSSY),
    compression=st.sampled_from(COMPRESSIONS),
)
def test_lossy_round_trip_within_documented_bound(
    data: st.DataObject, dtype: DType, encoding: Encoding, compression: Any
) -> None:
    limit = {DType.FLOAT16: 65504.0, DType.FLOAT64: 1e300}.get(dtype, float(np.float32(3e38)))
    x = data.draw(_values(dtype, limit))
    block = TensorBlock("g", x, 4)
    options = (
        {"topk_fraction": data.draw(st.floats(0.01, 1.0))} if encoding is Encoding.TOPK else {}
    )
    if _refused(x, dtype, encoding):
        with pytest.raises(LossyValueError):
            encode_block(block, encoding=encoding, compression=compression, **options)
        return
    raw = encode_block(block, encoding=encoding, compression=compression, **options)
    decoded = decode_block(raw)
    assert decoded.dtype is dtype
    assert decoded.shape == block.shape
    assert decoded.num_samples == 4
    _check_bound(x, decoded.values, encoding, _params(raw))


# ── each bound is tight: values placed at the bound reach it, none exceed it ──
def test_f16_bound_is_reached() -> None:
    x = (1.0 + 2.0**-11 - 2.0**-23 * np.arange(1, 9)).astype(np.float32)  # just below a tie
    y = decode_block(encode_block(TensorBlock("x", x), encoding=Encoding.F16)).values
    rel = np.abs(_wide(y) - _wide(x)) / _wide(x)
    assert rel.max() <= 2.0**-11
    assert rel.max() > 0.999 * 2.0**-11


def test_f16_subnormal_bound_is_reached() -> None:
    x = np.array([2.0**-25, 3 * 2.0**-25, 2.0**-15], dtype=np.float32)  # ties in the subnormals
    y = decode_block(encode_block(TensorBlock("x", x), encoding=Encoding.F16)).values
    assert np.abs(_wide(y) - _wide(x)).max() == 2.0**-25


def test_bf16_bound_is_reached() -> None:
    x = (1.0 + 2.0**-8 - 2.0**-23 * np.arange(1, 9)).astype(np.float32)
    y = decode_block(encode_block(TensorBlock("x", x), encoding=Encoding.BF16)).values
    rel = np.abs(_wide(y) - _wide(x)) / _wide(x)
    assert rel.max() <= 2.0**-8
    assert rel.max() > 0.99 * 2.0**-8


@pytest.mark.parametrize("dtype", FLOATS)
def test_int8_bound_is_reached_halfway_between_levels(dtype: DType) -> None:
    levels = np.arange(0, 256, dtype=np.float64)
    x = np.concatenate([levels, levels[:-1] + 0.5, levels[:-1] + 0.49]).astype(dtype.numpy)
    raw = encode_block(TensorBlock("q", x), encoding=Encoding.INT8)
    y = decode_block(raw).values
    params = _params(raw)
    assert params["scale"] == 1.0
    _check_bound(x, y, Encoding.INT8, params)
    assert np.abs(_wide(y) - _wide(x)).max() == 0.5  # scale / 2, exactly


def test_int8_constant_block_is_exact() -> None:
    x = np.full(17, -3.25, dtype=np.float32)
    raw = encode_block(TensorBlock("c", x), encoding=Encoding.INT8)
    assert _params(raw)["scale"] == 0.0
    np.testing.assert_array_equal(decode_block(raw).values, x)


def test_int8_extreme_float32_range() -> None:
    x = np.array([-np.finfo(np.float32).max, 0.0, 1e38, np.finfo(np.float32).max], np.float32)
    raw = encode_block(TensorBlock("e", x), encoding=Encoding.INT8)
    y = decode_block(raw).values
    assert np.isfinite(y).all()
    _check_bound(x, y, Encoding.INT8, _params(raw))


def test_int8_tiny_float32_range() -> None:
    x = np.array([0.0, 2.0**-149, 2 * 2.0**-149, 2.0**-140], np.float32)
    raw = encode_block(TensorBlock("t", x), encoding=Encoding.INT8)
    _check_bound(x, decode_block(raw).values, Encoding.INT8, _params(raw))


def test_int8_large_tensor_decodes_in_float32() -> None:
    x = np.random.default_rng(1).standard_normal(200_000).astype(np.float32)
    raw = encode_block(TensorBlock("big", x), encoding=Encoding.INT8)
    y = decode_block(raw).values
    assert y.dtype == np.float32
    _check_bound(x, y, Encoding.INT8, _params(raw))


def test_int8_is_a_quarter_of_float32() -> None:
    x = np.random.default_rng(2).standard_normal(4096).astype(np.float32)
    dense = len(encode_block(TensorBlock("x", x)))
    assert len(encode_block(TensorBlock("x", x), encoding=Encoding.INT8)) < dense / 4 + 1024


@pytest.mark.parametrize("dtype", FLOATS)
def test_topk_drops_at_most_the_smallest_kept_magnitude(dtype: DType) -> None:
    x = np.array([3.0, -3.0, 1.0, -0.5, 0.0, 2.0], dtype=dtype.numpy)
    raw = encode_block(TensorBlock("k", x), encoding=Encoding.TOPK, topk_fraction=0.3)
    y = decode_block(raw).values
    assert _params(raw)["k"] == 2  # ceil(0.3 * 6)
    np.testing.assert_array_equal(_wide(y), [3.0, -3.0, 0.0, 0.0, 0.0, 0.0])


def test_topk_tie_reaches_the_bound() -> None:
    x = np.array([3.0, -3.0, 1.0], dtype=np.float32)
    raw = encode_block(TensorBlock("k", x), encoding=Encoding.TOPK, topk_fraction=0.2)
    y = decode_block(raw).values
    assert np.count_nonzero(y) == 1
    assert np.abs(_wide(y) - _wide(x)).max() == 3.0  # == the smallest kept magnitude
    _check_bound(x, y, Encoding.TOPK, _params(raw))


def test_topk_sparse_block_is_small() -> None:
    x = np.random.default_rng(3).standard_normal(100_000).astype(np.float32)
    raw = encode_block(TensorBlock("s", x), encoding=Encoding.TOPK, topk_fraction=0.01)
    assert len(raw) < 1000 * 12 + 2048


def test_f16_of_a_float16_tensor_is_exact_and_zero_copy() -> None:
    x = np.arange(64, dtype=np.float16)
    data = bytearray(encode_block(TensorBlock("h", x), encoding=Encoding.F16))
    y = decode_block(data).values
    np.testing.assert_array_equal(y, x)
    assert np.shares_memory(y, np.frombuffer(data, np.uint8))


def test_f16_from_torch_is_within_bound() -> None:
    torch = pytest.importorskip("torch")
    t = torch.randn(10_000, requires_grad=True)
    x = t.detach().numpy().copy()
    y = decode_block(encode_block(TensorBlock("t", t), encoding=Encoding.F16)).values
    _check_bound(x, y, Encoding.F16, {})


def test_f16_of_read_only_input_is_within_bound() -> None:
    x = np.random.default_rng(4).standard_normal(10_000).astype(np.float32)
    x.flags.writeable = False
    y = decode_block(encode_block(TensorBlock("r", x), encoding=Encoding.F16)).values
    _check_bound(x, y, Encoding.F16, {})


def test_bf16_float64_just_below_overflow_is_refused_or_finite() -> None:
    x = np.array([np.nextafter(BF16_OVERFLOW, 0.0), 1.0])
    try:
        y = decode_block(encode_block(TensorBlock("b", x), encoding=Encoding.BF16)).values
    except LossyValueError:
        return
    assert np.isfinite(y).all()
    assert float(y[0]) == BF16_MAX


# ── refusals ─────────────────────────────────────────────────────────────────
@pytest.mark.parametrize("encoding", LOSSY)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_values_are_refused(encoding: Encoding, bad: float) -> None:
    x = np.array([1.0, bad, 2.0], dtype=np.float32)
    with pytest.raises(LossyValueError, match="NaN or infinite"):
        encode_block(TensorBlock("n", x), encoding=encoding)


@pytest.mark.parametrize("encoding", LOSSY)
@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int32, np.int64])
def test_integer_tensors_are_refused(encoding: Encoding, dtype: Any) -> None:
    with pytest.raises(UnsupportedDtype):
        encode_block(TensorBlock("i", np.arange(4, dtype=dtype)), encoding=encoding)


def test_f16_refuses_values_beyond_its_range() -> None:
    encode_block(TensorBlock("ok", np.array([F16_MAX, -F16_MAX])), encoding=Encoding.F16)
    with pytest.raises(LossyValueError, match="float16 range"):
        encode_block(TensorBlock("x", np.array([65505.0], np.float32)), encoding=Encoding.F16)


def test_bf16_refuses_values_that_round_to_infinity() -> None:
    x = np.array([BF16_OVERFLOW], np.float32)
    with pytest.raises(LossyValueError, match="bfloat16 range"):
        encode_block(TensorBlock("x", x), encoding=Encoding.BF16)


def test_bf16_of_float16_refuses_values_that_leave_float16() -> None:
    encode_block(TensorBlock("ok", np.array([65280.0], np.float16)), encoding=Encoding.BF16)
    with pytest.raises(LossyValueError, match="float16"):
        encode_block(TensorBlock("x", np.array([65408.0], np.float16)), encoding=Encoding.BF16)


def test_int8_refuses_a_range_that_overflows_float64() -> None:
    x = np.array([-1e308, 1e308])
    with pytest.raises(LossyValueError, match="overflows"):
        encode_block(TensorBlock("x", x), encoding=Encoding.INT8)


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.5, math.nan, 2.0**-21])
def test_topk_fraction_out_of_range_is_refused(fraction: float) -> None:
    with pytest.raises(ValueError, match="topk_fraction"):
        encode_block(
            TensorBlock("x", np.ones(4, np.float32)), encoding=Encoding.TOPK, topk_fraction=fraction
        )


def test_lossy_encodings_keep_empty_and_zero_d_shapes() -> None:
    for encoding in LOSSY:
        for x in (np.zeros((0, 3), np.float32), np.array(1.5, np.float32)):
            decoded = decode_block(encode_block(TensorBlock("e", x), encoding=encoding))
            assert decoded.shape == x.shape


def test_bfloat16_tensor_with_f16_encoding_round_trips_within_bound() -> None:
    x = np.array([1.0, 3.140625, -1e-6, 60000.0], dtype=ml_dtypes.bfloat16)
    decoded = decode_block(encode_block(TensorBlock("b", x), encoding=Encoding.F16))
    assert decoded.dtype is DType.BFLOAT16
    _check_bound(x, decoded.values, Encoding.F16, {})


# ── tampered lossy blocks ────────────────────────────────────────────────────
def _forge_lossy(header_changes: dict[str, Any], columns: dict[str, pa.Array]) -> bytes:
    import msgspec

    header = {
        "v": 1,
        "kind": "tensor",
        "name": "t",
        "dtype": "float32",
        "shape": [3],
        "num_samples": 0,
        "encoding": "int8",
        "params": {"scale": 1.0, "offset": 0.0},
        "meta": {},
    }
    header.update(header_changes)
    schema = pa.schema(
        [pa.field(k, v.type, nullable=False) for k, v in columns.items()],
        metadata={b"tensorswap.block": msgspec.json.encode(header)},
    )
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as writer:
        writer.write_batch(pa.RecordBatch.from_arrays(list(columns.values()), schema=schema))
    return sink.getvalue().to_pybytes()


_Q3 = {"values": pa.array(np.array([-128, 0, 127], np.int8))}
_TOPK = {"indices": pa.array([0, 2], pa.int64()), "values": pa.array([1.0, 2.0], pa.float32())}


@pytest.mark.parametrize(
    ("changes", "columns"),
    [
        ({"params": {}}, _Q3),
        ({"params": {"scale": "1", "offset": 0.0}}, _Q3),
        ({"params": {"scale": -1.0, "offset": 0.0}}, _Q3),
        ({"params": {"scale": 1e308, "offset": 0.0}}, _Q3),
        ({"params": {"scale": 2e36, "offset": 0.0}}, _Q3),
        ({"dtype": "float16", "params": {"scale": 1000.0, "offset": 0.0}}, _Q3),
        ({"encoding": "topk", "params": {}}, _TOPK),
        ({"encoding": "topk", "params": {"k": 3}}, _TOPK),
        ({"encoding": "topk", "params": {"k": 4}, "shape": [3]}, _TOPK),
        ({"encoding": "topk", "params": {"k": 2}, "shape": [2]}, _TOPK),
        (
            {"encoding": "topk", "params": {"k": 2}},
            {"indices": pa.array([2, 0], pa.int64()), "values": _TOPK["values"]},
        ),
        (
            {"encoding": "topk", "params": {"k": 2}},
            {"indices": pa.array([1, 1], pa.int64()), "values": _TOPK["values"]},
        ),
        (
            {"encoding": "topk", "params": {"k": 2}},
            {"indices": pa.array([-1, 1], pa.int64()), "values": _TOPK["values"]},
        ),
        (
            {"encoding": "topk", "params": {"k": 2}},
            {"indices": pa.array([0, 1], pa.int32()), "values": _TOPK["values"]},
        ),
        (
            {"encoding": "bf16", "dtype": "float16", "params": {}},
            {"values": pa.array(np.array([0x7F00, 0, 0], np.uint16))},
        ),
        ({"encoding": "f16", "params": {}}, {"values": pa.array(np.zeros(3, np.uint16))}),
    ],
    ids=[
        "int8-no-params",
        "int8-string-scale",
        "int8-negative-scale",
        "int8-overflowing-scale",
        "int8-beyond-float32",
        "int8-beyond-float16",
        "topk-no-k",
        "topk-k-vs-rows",
        "topk-k-above-size",
        "topk-index-out-of-range",
        "topk-unsorted",
        "topk-duplicate",
        "topk-negative-index",
        "topk-int32-indices",
        "bf16-beyond-float16",
        "f16-wrong-column-type",
    ],
)
def test_tampered_lossy_blocks_are_malformed(
    changes: dict[str, Any], columns: dict[str, pa.Array]
) -> None:
    with pytest.raises(MalformedBlock):
        decode_block(_forge_lossy(changes, columns))


@pytest.mark.parametrize(("k", "size"), [(0, 4), (1, (1 << 20) + 1), (2, 3 << 20)])
def test_a_topk_block_cannot_claim_far_more_values_than_it_holds(k: int, size: int) -> None:
    """k kept entries stand for at most k * 2**20 values (the encoder refuses fractions
    below 2**-20): a small hostile block cannot make the decoder allocate a huge tensor."""
    from tensorswap.codec.lossy import ENCODINGS

    with pytest.raises(MalformedBlock, match="topk"):
        ENCODINGS[Encoding.TOPK].rows({"k": k}, size)


def test_the_smallest_topk_fraction_still_decodes() -> None:
    values = np.zeros(1 << 20, np.float32)
    values[7] = 3.0
    block = encode_block(TensorBlock("x", values), encoding=Encoding.TOPK, topk_fraction=2.0**-20)
    np.testing.assert_array_equal(decode_block(block).values, values)
