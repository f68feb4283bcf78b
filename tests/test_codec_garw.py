"""GARW blocks and grad- ids: seed 000's bytes, errors and ids, reproduced exactly."""

from __future__ import annotations

import contextlib
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.memory import traced
from tensorswap.codec import garw
from tensorswap.codec.garw import (
    FNV64_OFFSET_BASIS,
    FieldOverflow,
    GarwBlock,
    compute_garw_cid,
    fnv1a64,
    is_garw,
)
from tensorswap.errors import CodecError, InvalidMagic, TruncatedData, UnsupportedDtype

SPECIAL_BITS = [0x7FC00000, 0x7F800000, 0xFF800000, 0x80000000, 0x7FC00001, 0xFFBFFFFF, 0x00800000]


def f32(bits: list[int]) -> np.ndarray:
    return np.array(bits, dtype=np.uint32).view(np.float32)


def garw_by_hand(shape: list[int], values: list[float], num_samples: int) -> bytes:
    """The layout of seed 000's to_arrow_bytes, written out with struct (independent of garw)."""
    raw_values = b"".join(struct.pack("<f", v) for v in values)
    return garw_raw_by_hand(shape, len(values), raw_values, num_samples)


def garw_raw_by_hand(shape: list[int], count: int, raw_values: bytes, num_samples: int) -> bytes:
    out = b"GARW" + struct.pack("<I", len(shape))
    out += b"".join(struct.pack("<I", d) for d in shape)
    out += struct.pack("<I", count) + raw_values
    return out + struct.pack("<I", num_samples)


def fnv1a64_reference(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for byte in data:
        h = ((h ^ byte) * 0x100000001B3) % 2**64
    return h


# ── bytes ────────────────────────────────────────────────────────────────────
def test_to_bytes_matches_hand_layout() -> None:
    block = GarwBlock("c", "l", (2, 3), np.array([1, -2, 3.5, 0, 1e-3, 7], np.float32), 9)
    assert block.to_bytes() == garw_by_hand([2, 3], [1, -2, 3.5, 0, 1e-3, 7], 9)
    assert block.nbytes == len(block.to_bytes())


def test_to_bytes_matches_bytes_from_the_compiled_seed() -> None:
    # Printed by seed 000's own to_arrow_bytes, compiled with rustc.
    seed_hex = (
        "47415257020000000200000003000000060000000000803f000000c000006040"
        "000000006f12833a0000e04009000000"
    )
    block = GarwBlock("", "", (2, 3), np.array([1, -2, 3.5, 0, 1e-3, 7], np.float32), 9)
    assert block.to_bytes().hex() == seed_hex


def test_special_floats_keep_their_bits() -> None:
    values = f32(SPECIAL_BITS)
    block = GarwBlock("", "", (7,), values, 7)
    raw = block.to_bytes()
    assert raw[16:-4] == values.astype("<f4").tobytes()
    back = GarwBlock.from_bytes(raw)
    assert back.values.view(np.uint32).tolist() == SPECIAL_BITS


def test_empty_block() -> None:
    block = GarwBlock("", "", (), np.empty(0, np.float32), 0)
    assert block.to_bytes() == b"GARW" + bytes(12)
    assert GarwBlock.from_bytes(block.to_bytes()) == block


def test_values_from_list_and_multi_dim_array() -> None:
    assert GarwBlock.from_values("", [1, 2], 0).values.dtype == np.float32
    block = GarwBlock("", "", (2, 2), np.arange(4, dtype=np.float32).reshape(2, 2), 0)
    assert block.values.tolist() == [0, 1, 2, 3]


def test_non_contiguous_values() -> None:
    base = np.arange(10, dtype=np.float32)
    block = GarwBlock("", "", (5,), base[::2], 1)
    assert block.to_bytes() == garw_by_hand([5], [0, 2, 4, 6, 8], 1)


def test_big_endian_values_are_written_little_endian() -> None:
    values = np.array([1.5, -2.0], dtype=">f4")
    assert GarwBlock("", "", (2,), values, 0).to_bytes() == garw_by_hand([2], [1.5, -2.0], 0)


def test_float64_array_is_refused() -> None:
    with pytest.raises(UnsupportedDtype):
        GarwBlock("", "", (1,), np.zeros(1, np.float64), 0)


@pytest.mark.parametrize(
    ("shape", "num_samples", "field"),
    [((2**32,), 0, "shape[0]"), ((-1,), 0, "shape[0]"), ((1,), 2**32, "num_samples")],
)
def test_u32_overflow_is_refused(shape: tuple[int, ...], num_samples: int, field: str) -> None:
    block = GarwBlock("", "", shape, np.zeros(1, np.float32), num_samples)
    with pytest.raises(FieldOverflow) as info:
        block.to_bytes()
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, CodecError)
    assert info.value.field == field


# ── decoding: the seed's checks, in the seed's order ─────────────────────────
def test_seed_roundtrip() -> None:
    values = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    cid = compute_garw_cid("layer1", values, 50)
    block = GarwBlock(cid, "layer1", (4,), values, 50)
    decoded = GarwBlock.from_bytes(block.to_bytes(), cid, "layer1")
    assert decoded.shape == (4,)
    assert decoded.values.tolist() == [1.0, 2.0, 3.0, 4.0]
    assert decoded.num_samples == 50
    assert decoded.cid == cid
    assert decoded == block


def test_seed_bad_magic() -> None:
    bad = bytearray(20)
    bad[0] = ord("X")
    with pytest.raises(InvalidMagic) as info:
        GarwBlock.from_bytes(bytes(bad), "x", "l")
    assert info.value.expected == b"GARW"
    assert info.value.found == b"X\x00\x00\x00"


def test_short_buffer_is_truncated_before_magic_is_checked() -> None:
    with pytest.raises(TruncatedData):
        GarwBlock.from_bytes(b"XYZ")


def test_every_truncation_is_truncated_data() -> None:
    raw = garw_by_hand([2, 2], [1, 2, 3, 4], 7)
    for cut in range(len(raw)):
        with pytest.raises(TruncatedData):
            GarwBlock.from_bytes(raw[:cut])


def test_huge_values_len_fails_before_allocating() -> None:
    raw = b"GARW" + struct.pack("<II", 0, 2**32 - 1) + bytes(16)
    with traced() as memory, pytest.raises(TruncatedData) as info:
        GarwBlock.from_bytes(raw)
    assert memory.peak < 1 << 20
    assert info.value.needed == 4 * (2**32 - 1)
    assert info.value.available == 16


def test_huge_shape_len_fails_before_allocating() -> None:
    raw = b"GARW" + struct.pack("<I", 2**32 - 1) + bytes(8)
    with pytest.raises(TruncatedData) as info:
        GarwBlock.from_bytes(raw)
    assert info.value.what == "GARW shape"


def test_trailing_bytes_are_ignored_like_the_seed() -> None:
    raw = garw_by_hand([1], [2.5], 3)
    assert GarwBlock.from_bytes(raw + b"junk").values.tolist() == [2.5]


def test_shape_and_values_len_are_not_cross_checked_like_the_seed() -> None:
    block = GarwBlock.from_bytes(garw_by_hand([5, 5], [1.0], 0))
    assert block.shape == (5, 5)
    assert block.values.size == 1


def test_decode_is_zero_copy() -> None:
    raw = bytearray(garw_by_hand([3], [1, 2, 3], 0))
    block = GarwBlock.from_bytes(raw)
    assert np.shares_memory(block.values, np.frombuffer(raw, np.uint8))
    assert GarwBlock.from_bytes(bytes(raw)).values.flags.writeable is False


def test_decode_from_memoryview_and_numpy() -> None:
    raw = garw_by_hand([2], [1, 2], 4)
    assert GarwBlock.from_bytes(memoryview(raw)).num_samples == 4
    assert GarwBlock.from_bytes(np.frombuffer(raw, np.uint8)).num_samples == 4


def test_is_garw() -> None:
    assert is_garw(garw_by_hand([1], [1.0], 1))
    assert not is_garw(b"GARW")
    assert not is_garw(b"ARROW1\x00\x00")
    assert not is_garw(b"")


# ── ids ──────────────────────────────────────────────────────────────────────
def test_fnv1a64_reference_vectors() -> None:
    assert fnv1a64(b"") == 0xCBF29CE484222325
    assert fnv1a64(b"a") == 0xAF63DC4C8601EC8C
    assert fnv1a64(b"foobar") == 0x85944171F73967E8


def test_fnv1a64_continues_from_a_seed() -> None:
    assert fnv1a64(b"bar", fnv1a64(b"foo")) == fnv1a64(b"foobar")


@pytest.mark.parametrize(
    ("layer", "values", "num_samples", "cid"),
    [
        ("layer1", [1.0, 2.0, 3.0, 4.0], 50, "grad-596605b772920b54"),
        ("layer2", [0.5, 1.0, 1.5], 64, "grad-c5fcd2ac716b1dc6"),
        ("empty", [], 0, "grad-1f1ded447d474547"),
        ("special", f32(SPECIAL_BITS), 7, "grad-820039d17f485105"),
    ],
)
def test_cid_matches_the_compiled_seed(
    layer: str, values: object, num_samples: int, cid: str
) -> None:
    # Printed by seed 000's compute_cid, compiled with rustc.
    assert compute_garw_cid(layer, values, num_samples) == cid


def test_cid_of_a_large_block_matches_the_compiled_seed() -> None:
    values = (np.arange(100_000) % 1000).astype(np.float32) * np.float32(0.25) - np.float32(100)
    assert compute_garw_cid("big", values, 123456) == "grad-502888bb750832d0"


def test_cid_is_deterministic_prefixed_and_ignores_layer_and_shape() -> None:
    values = [0.5, 1.0, 1.5]
    cid = compute_garw_cid("layer2", values, 64)
    assert cid == compute_garw_cid("layer2", values, 64)
    assert cid.startswith("grad-") and len(cid) == 5 + 16
    assert cid == compute_garw_cid("another", values, 64)
    assert cid != compute_garw_cid("layer2", values, 65)
    block = GarwBlock.from_values("l", np.array(values, np.float32), 64, shape=(3, 1))
    assert block.cid == cid and block.shape == (3, 1)


def test_cid_is_the_fnv_of_the_one_dimensional_block() -> None:
    raw = garw_by_hand([3], [0.5, 1.0, 1.5], 64)
    assert compute_garw_cid("x", [0.5, 1.0, 1.5], 64) == f"grad-{fnv1a64_reference(raw):016x}"


def test_cid_refuses_what_the_seed_would_truncate() -> None:
    with pytest.raises(FieldOverflow):
        compute_garw_cid("l", [1.0], 2**32)


# ── hypothesis ───────────────────────────────────────────────────────────────
float32_bits = st.lists(st.integers(0, 2**32 - 1), max_size=64).map(f32)
u32 = st.integers(0, 2**32 - 1)


@settings(max_examples=100, derandomize=True, deadline=None)
@given(
    values=float32_bits,
    shape=st.lists(u32, max_size=6),
    num_samples=u32,
    tail=st.binary(max_size=8),
)
def test_roundtrip_is_bit_exact(
    values: np.ndarray, shape: list[int], num_samples: int, tail: bytes
) -> None:
    block = GarwBlock("cid", "layer", tuple(shape), values, num_samples)
    raw = block.to_bytes()
    assert raw == garw_raw_by_hand(shape, values.size, values.tobytes(), num_samples)
    back = GarwBlock.from_bytes(raw + tail, "cid", "layer")
    assert back == block
    assert back.values.view(np.uint32).tolist() == values.view(np.uint32).tolist()


@settings(max_examples=200, derandomize=True, deadline=None)
@given(st.binary(max_size=64))
def test_random_bytes_raise_only_codec_errors(data: bytes) -> None:
    with contextlib.suppress(CodecError):
        GarwBlock.from_bytes(data)


@settings(max_examples=200, derandomize=True, deadline=None)
@given(st.binary(min_size=4, max_size=64))
def test_random_bytes_after_magic_raise_only_codec_errors(data: bytes) -> None:
    try:
        block = GarwBlock.from_bytes(b"GARW" + data)
    except CodecError:
        return
    assert block.nbytes <= 4 + len(data)


@settings(max_examples=100, derandomize=True, deadline=None)
@given(data=st.binary(max_size=600), seed=st.integers(0, 2**64 - 1))
def test_vectorised_fnv_equals_the_byte_loop(data: bytes, seed: int) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(garw, "_VECTOR_MIN", 0)
        patch.setattr(garw, "_CHUNK", 97)  # many chunks, odd sizes, word-boundary crossings
        assert fnv1a64(data, seed) == fnv1a64_reference_seeded(data, seed)


def fnv1a64_reference_seeded(data: bytes, h: int) -> int:
    for byte in data:
        h = ((h ^ byte) * 0x100000001B3) % 2**64
    return h


def test_vectorised_fnv_on_a_megabyte() -> None:
    data = np.random.default_rng(7).bytes(3 << 18)
    assert fnv1a64(data) == fnv1a64_reference(data)
    assert fnv1a64(data, 12345) == fnv1a64_reference_seeded(data, 12345)
    assert FNV64_OFFSET_BASIS == 0xCBF29CE484222325
