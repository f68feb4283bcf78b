"""Extraction of per-layer deltas from numpy arrays and torch tensors, and the state hash."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest

from tensorswap.delta import (
    DeltaInputMismatch,
    DweLayerDelta,
    SequenceCounter,
    apply_fragment,
    compute_state_hash,
    decode_fragment,
    describe_fragment,
    encode_fragment,
    extract_delta_fragment,
)


def _torch():
    return pytest.importorskip("torch")


def test_seed_round_trip_and_apply() -> None:
    """The crate's own test: zeros -> ones, serialize, deserialize, apply."""
    base = [np.zeros((2, 2), np.float32)]
    optimized = [np.ones((2, 2), np.float32)]
    fragment = extract_delta_fragment("dwe", 1, optimized, base)
    decoded = decode_fragment(bytes(encode_fragment(fragment)))
    local = [base[0].copy()]
    apply_fragment(local, decoded)
    assert local[0].tolist() == [[1.0, 1.0], [1.0, 1.0]]


def test_hash_covers_index_dims_and_values_only() -> None:
    layer = DweLayerDelta(7, (3, 1), np.array([1, 2, 3], np.float32))
    expected = hashlib.sha256(
        struct.pack("<QQQ", 7, 3, 1) + struct.pack("<3f", 1, 2, 3)
    ).hexdigest()
    assert compute_state_hash([layer]) == expected
    assert compute_state_hash([]) == hashlib.sha256(b"").hexdigest()


def test_dict_inputs_use_optimized_key_order() -> None:
    opt = {"b": np.full(2, 3.0, np.float32), "a": np.full(1, 5.0, np.float32)}
    base = {"a": np.ones(1, np.float32), "b": np.ones(2, np.float32)}
    fragment = extract_delta_fragment("s", 0, opt, base)
    assert [(lay.layer_index, lay.shape) for lay in fragment.layers] == [(0, (2,)), (1, (1,))]
    assert fragment.layers[0].values.tolist() == [2.0, 2.0]
    assert fragment.layers[1].values.tolist() == [4.0]


def test_torch_and_numpy_give_the_same_bytes() -> None:
    torch = _torch()
    rng = np.random.default_rng(0)
    opt = [
        rng.standard_normal((3, 4)).astype(np.float32),
        rng.standard_normal(5).astype(np.float32),
    ]
    base = [
        rng.standard_normal((3, 4)).astype(np.float32),
        rng.standard_normal(5).astype(np.float32),
    ]
    from_numpy = extract_delta_fragment("s", 3, opt, base)
    from_torch = extract_delta_fragment(
        "s", 3, [torch.from_numpy(a) for a in opt], [torch.from_numpy(b) for b in base]
    )
    mixed = extract_delta_fragment("s", 3, [torch.from_numpy(a) for a in opt], base)
    assert encode_fragment(from_numpy) == encode_fragment(from_torch) == encode_fragment(mixed)


def test_bfloat16_and_float64_are_subtracted_then_cast() -> None:
    torch = _torch()
    opt = torch.tensor([1.5, 2.0], dtype=torch.bfloat16)
    base = torch.tensor([0.5, 1.0], dtype=torch.bfloat16)
    fragment = extract_delta_fragment("s", 0, [opt], [base])
    assert fragment.layers[0].values.tolist() == [1.0, 1.0]
    f64 = extract_delta_fragment("s", 0, [np.array([1 + 2**-40])], [np.array([1.0])])
    assert f64.layers[0].values.tolist() == [np.float32(2**-40)]


def test_requires_grad_tensors_are_detached() -> None:
    torch = _torch()
    opt = torch.ones(3, requires_grad=True)
    fragment = extract_delta_fragment("s", 0, [opt], [torch.zeros(3)])
    assert fragment.layers[0].values.tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize(
    ("optimized", "baseline", "match"),
    [
        ([np.ones(2)], [np.ones(3)], "shapes differ"),
        ([np.ones(2), np.ones(2)], [np.ones(2)], "layer counts differ"),
        ({"a": np.ones(1)}, {"b": np.ones(1)}, "layer names differ"),
        ({"a": np.ones(1)}, [np.ones(1)], "mapping"),
        ([np.ones(2, complex)], [np.ones(2, complex)], "unsupported dtype"),
    ],
)
def test_mismatched_inputs_are_refused(optimized, baseline, match) -> None:
    with pytest.raises(DeltaInputMismatch, match=match):
        extract_delta_fragment("s", 0, optimized, baseline)


def test_torch_shapes_are_not_broadcast() -> None:
    torch = _torch()
    with pytest.raises(DeltaInputMismatch, match="shapes differ"):
        extract_delta_fragment("s", 0, [torch.ones(2)], [torch.ones(1, 2)])


def test_values_are_normalised_to_contiguous_le_f32() -> None:
    layer = DweLayerDelta(0, (2, 2), np.arange(4, dtype=">f8").reshape(2, 2).T)
    assert layer.values.dtype == np.dtype("<f4")
    assert layer.values.flags.c_contiguous and layer.values.ndim == 1
    assert layer.values.tolist() == [0.0, 2.0, 1.0, 3.0]


def test_sequence_counter_reserves_consecutive_ranges() -> None:
    counter = SequenceCounter(10)
    assert counter.next() == 10
    assert counter.next(3) == 11
    assert counter.next() == 14


def test_describe_fragment() -> None:
    fragment = extract_delta_fragment("s", 4, [np.ones((2, 3))], [np.zeros((2, 3))])
    summary = describe_fragment(fragment)
    assert summary["sequence"] == 4 and summary["value_count"] == 6
    assert summary["layers"] == [{"layer_index": 0, "shape": [2, 3], "values": 6}]


def test_public_names_import() -> None:
    import tensorswap.delta as delta

    assert sorted(set(delta.__all__)) == sorted(delta.__all__)
    for name in delta.__all__:
        assert getattr(delta, name) is not None


def test_integer_and_bool_layers_carry_no_delta() -> None:
    fragment = extract_delta_fragment(
        "s",
        0,
        [np.ones(2, np.float32), np.array([3], np.int64), np.ones(2, bool)],
        [np.zeros(2, np.float32), np.array([1], np.int64), np.zeros(2, bool)],
    )
    assert [layer.layer_index for layer in fragment.layers] == [0]
