"""Deltas above the cap: split by layer and by slices of a layer, applied and reassembled."""

from __future__ import annotations

import numpy as np
import pytest

from tensorswap.delta import (
    DWE_SCHEMA,
    SLICE_SCHEMA,
    DweFragment,
    FragmentVerifier,
    LayerLayoutError,
    SplitError,
    apply_fragment,
    decode_fragment,
    encode_fragment,
    encoded_size,
    extract_delta_fragment,
    make_fragment,
    reassemble,
    sign_fragment,
    split_fragment,
)
from tensorswap.delta.fragment import layer_target

CAP = 1024


def _delta(shapes: list[tuple[int, ...]], seed: int = 0) -> tuple[list, list, DweFragment]:
    rng = np.random.default_rng(seed)
    base = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    new = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    return base, new, extract_delta_fragment("sess", 100, new, base)


def test_small_fragment_is_not_split() -> None:
    _, _, fragment = _delta([(4,)])
    assert split_fragment(fragment, max_bytes=CAP) == [fragment]


def test_split_by_layer_keeps_whole_layers_under_the_cap() -> None:
    _, _, fragment = _delta([(40,), (60,), (30,), (100,), (5, 4)])
    parts = split_fragment(fragment, max_bytes=CAP)
    assert len(parts) > 1
    assert all(part.schema == DWE_SCHEMA for part in parts)
    assert [p.sequence for p in parts] == list(range(100, 100 + len(parts)))
    assert [lay.layer_index for p in parts for lay in p.layers] == [0, 1, 2, 3, 4]
    for part in parts:  # signable and still under the cap
        assert len(encode_fragment(sign_fragment(part, b"k"), max_bytes=CAP)) <= CAP
        FragmentVerifier().check_integrity(part)


def test_big_layer_is_sliced_and_parts_reproduce_the_whole_delta_bitwise() -> None:
    base, _, fragment = _delta([(7,), (30, 25), (3,)])
    parts = split_fragment(fragment, max_bytes=CAP)
    schemas = [p.schema for p in parts]
    assert SLICE_SCHEMA in schemas and schemas[0] == DWE_SCHEMA
    for part in parts:
        assert encoded_size(sign_fragment(part, b"k")) <= CAP
    whole = [b.copy() for b in base]
    apply_fragment(whole, fragment)
    piecewise = [b.copy() for b in base]
    for part in parts:  # every part travels and is applied on its own
        received = decode_fragment(bytes(encode_fragment(part)))
        FragmentVerifier().check_integrity(received)
        apply_fragment(piecewise, received)
    for a, b in zip(whole, piecewise, strict=True):
        assert a.tobytes() == b.tobytes()


def test_reassemble_restores_the_original_fragment() -> None:
    _, _, fragment = _delta([(7,), (30, 25), (3,), (600,)])
    parts = split_fragment(fragment, max_bytes=CAP)
    assert reassemble(parts) == fragment


def test_slice_parts_are_refused_by_whole_layer_semantics() -> None:
    """An axiom peer ignores the schema: the [*shape, offset] entry never matches its values."""
    _, _, fragment = _delta([(30, 25)])
    for part in split_fragment(fragment, max_bytes=CAP):
        with pytest.raises(LayerLayoutError):
            layer_target(DWE_SCHEMA, part.layers[0])


@pytest.mark.parametrize("defect", ["missing", "reordered", "other_session"])
def test_reassemble_refuses_broken_part_lists(defect: str) -> None:
    _, _, fragment = _delta([(30, 25)])
    parts = split_fragment(fragment, max_bytes=CAP)
    if defect == "missing":
        parts = parts[:-1]
    elif defect == "reordered":
        parts = [parts[1], parts[0], *parts[2:]]
    else:
        parts = [*parts[:-1], make_fragment("x", parts[-1].sequence, parts[-1].layers)]
    with pytest.raises(SplitError):
        reassemble(parts)


def test_reassemble_never_allocates_a_claimed_giant_layer() -> None:
    from tensorswap.delta import DweLayerDelta

    liar = DweLayerDelta(0, (2**40, 0), np.zeros(4, np.float32))
    with pytest.raises(SplitError, match="claims"):
        reassemble([make_fragment("s", 1, [liar], schema=SLICE_SCHEMA)])


@pytest.mark.timeout(10)
def test_reassemble_checks_a_shape_of_many_huge_dims_quickly() -> None:
    from tensorswap.delta import DweLayerDelta

    liar = DweLayerDelta(0, (2**64 - 1,) * 200_000 + (0,), np.zeros(4, np.float32))
    with pytest.raises(SplitError, match="claims"):
        reassemble([make_fragment("s", 1, [liar], schema=SLICE_SCHEMA)])


def test_cap_too_small_for_one_value() -> None:
    _, _, fragment = _delta([(100,)])
    with pytest.raises(SplitError):
        split_fragment(fragment, max_bytes=180)


def test_an_empty_fragment_that_does_not_fit_is_an_error_not_zero_parts() -> None:
    empty = make_fragment("s", 1, [])
    with pytest.raises(SplitError, match="no layers"):
        split_fragment(empty, max_bytes=8)
    assert split_fragment(empty) == [empty]
