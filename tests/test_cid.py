"""CIDv1 parsing, formatting, hashing and strict validation."""

from __future__ import annotations

import hashlib

import blake3
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tensorswap.cid import (
    MULTITHREAD_HASH_BYTES,
    Cid,
    HashFunction,
    Multicodec,
    decode_varint,
    encode_varint,
)
from tensorswap.errors import CidError, HashMismatch, InvalidCid

EMPTY_SHA256_RAW = "bafkreihdwdcefgh4dqkjv67uzcmw7ojee6xedzdetojuzjevtenxquvyku"

cids = st.builds(
    Cid,
    st.sampled_from(list(Multicodec)),
    st.sampled_from(list(HashFunction)),
    st.binary(min_size=32, max_size=32),
)


def test_known_vector_empty_sha256_raw() -> None:
    cid = Cid.of(b"", codec=Multicodec.RAW, hash=HashFunction.SHA2_256)
    assert str(cid) == EMPTY_SHA256_RAW
    assert Cid.parse(EMPTY_SHA256_RAW) == cid
    assert cid.digest == hashlib.sha256(b"").digest()


def test_default_is_raw_blake3() -> None:
    cid = Cid.of(b"hello")
    assert cid.codec is Multicodec.RAW
    assert cid.hash is HashFunction.BLAKE3
    assert cid.digest == blake3.blake3(b"hello").digest()
    assert str(cid).startswith("bafkr4i")


def test_binary_layout() -> None:
    cid = Cid.of(b"abc", codec=Multicodec.TENSORSWAP_MANIFEST)
    raw = cid.to_bytes()
    assert raw[:1] == b"\x01"
    assert raw[1:5] == encode_varint(0x300001)
    assert raw[5:7] == b"\x1e\x20"
    assert raw[7:] == cid.digest
    assert bytes(cid) == raw


@given(cids)
def test_string_round_trip(cid: Cid) -> None:
    text = str(cid)
    assert text.startswith("b") and text == text.lower() and "=" not in text
    assert Cid.parse(text) == cid


@given(cids)
def test_bytes_round_trip(cid: Cid) -> None:
    assert Cid.parse(cid.to_bytes()) == cid
    assert Cid.parse(bytearray(cid.to_bytes())) == cid
    assert Cid.parse(memoryview(cid.to_bytes())) == cid


@given(cids, cids)
def test_equality_hash_and_order_agree(a: Cid, b: Cid) -> None:
    assert (a == b) == (str(a) == str(b))
    if a == b:
        assert hash(a) == hash(b)
    assert sorted([a, b]) == sorted([b, a])


@given(st.integers(min_value=0, max_value=(1 << 63) - 1))
def test_varint_round_trip(value: int) -> None:
    raw = encode_varint(value)
    assert decode_varint(raw + b"\xff", 0) == (value, len(raw))


@pytest.mark.parametrize(
    "raw, reason",
    [(b"", "truncated"), (b"\x80", "truncated"), (b"\x80\x00", "non-minimal"), (b"\xff" * 10, "9")],
)
def test_varint_rejects(raw: bytes, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        decode_varint(raw)


def test_hash_on_buffers_without_copy() -> None:
    arr = np.arange(1000, dtype=np.float32)
    assert Cid.of(arr) == Cid.of(arr.tobytes()) == Cid.of(memoryview(arr))
    big = np.random.default_rng(0).bytes(MULTITHREAD_HASH_BYTES + 7)
    assert Cid.of(big).digest == blake3.blake3(big).digest()
    assert Cid.of(big, hash=HashFunction.SHA2_256).digest == hashlib.sha256(big).digest()
    assert Cid.of(big, threads=1) == Cid.of(big, threads=2) == Cid.of(big)


def test_verify() -> None:
    cid = Cid.of(b"payload")
    cid.verify(b"payload")
    assert cid.matches(b"payload")
    assert not cid.matches(b"payloaD")
    with pytest.raises(HashMismatch) as info:
        cid.verify(b"payloaD", "chunk 3")
    assert info.value.cid == cid
    assert info.value.actual == Cid.of(b"payloaD")
    assert "chunk 3" in str(info.value) and str(cid) in str(info.value)


def _cid_bytes(
    version: int = 1, codec: int = 0x55, hash_code: int = 0x1E, length: int = 32
) -> bytes:
    head = encode_varint(version) + encode_varint(codec) + encode_varint(hash_code)
    return head + encode_varint(length) + b"\x07" * min(length, 32)


@pytest.mark.parametrize(
    "value, reason",
    [
        ("", "empty"),
        ("zb2rhe5P4gXftAwvA4eXQ5HJwsER2owDyS9sKaQRRVQPn93bA", "multibase"),
        ("QmbWqxBEKC3P8tqsKc98xmWNzrzDtRLMiMPL8wBuTGsMnR", "CIDv0"),
        ("BAFKREIHDWDCEFGH4DQKJV67UZCMW7OJEE6XEDZDETOJUZJEVTENXQUVYKU", "multibase"),
        ("bafkreihdwdcefgh4dqkjv67uzcmw7ojee6xedzdetojuzjevtenxquvyku=", "base32"),
        ("bafkreihdwdcefgh4dqkjv67uzcmw7ojee6xedzdetojuzjevtenxquvyk1", "base32"),
        ("bafkreihdwdcefgh4dqkjv67uzcmw7ojee6xedzdetojuzjevtenxquvyk", "length"),
        ("bafkreihdwdcefgh4dqkjv67uzcmw7ojee6xedzdetojuzjevtenxquvykv", "non-canonical"),
        ("b", "base32"),
        (_cid_bytes(version=0), "version"),
        (_cid_bytes(version=2), "version"),
        (_cid_bytes(codec=0x70), "multicodec"),
        (_cid_bytes(hash_code=0x13), "multihash"),
        (_cid_bytes(length=20), "length"),
        (_cid_bytes()[:-1], "truncated"),
        (_cid_bytes() + b"\x00", "trailing"),
        (b"\x01\x80", "varint"),
        (b"\x01\xd5\x00\x1e\x20" + b"\x00" * 32, "non-minimal"),
        (b"\x12\x20" + b"\x00" * 32, "CIDv0"),
    ],
)
def test_parse_rejects(value: str | bytes, reason: str) -> None:
    with pytest.raises(InvalidCid, match=reason) as info:
        Cid.parse(value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, CidError)


def test_parse_rejects_non_buffer() -> None:
    with pytest.raises(InvalidCid):
        Cid.parse(42)  # type: ignore[arg-type]


def test_constructor_validates() -> None:
    with pytest.raises(InvalidCid, match="32 bytes"):
        Cid(Multicodec.RAW, HashFunction.BLAKE3, b"short")
    with pytest.raises(InvalidCid, match="multicodec"):
        Cid(0x70, HashFunction.BLAKE3, b"\x00" * 32)  # type: ignore[arg-type]
    cid = Cid(0x55, 0x12, bytearray(32))  # type: ignore[arg-type]
    assert cid.codec is Multicodec.RAW and cid.hash is HashFunction.SHA2_256
    assert isinstance(cid.digest, bytes)


@given(st.binary(max_size=64))
def test_random_bytes_give_cid_or_invalid_cid(raw: bytes) -> None:
    try:
        cid = Cid.parse(raw)
    except InvalidCid:
        return
    assert cid.to_bytes() == raw


@given(st.text(max_size=80))
def test_random_text_gives_cid_or_invalid_cid(text: str) -> None:
    try:
        cid = Cid.parse(text)
    except InvalidCid:
        return
    assert str(cid) == text


def test_hash_function_parse() -> None:
    assert HashFunction.parse("blake3") is HashFunction.BLAKE3
    assert HashFunction.parse("sha2-256") is HashFunction.SHA2_256
    assert HashFunction.parse("SHA256") is HashFunction.SHA2_256
    assert HashFunction.parse(0x1E) is HashFunction.BLAKE3
    assert HashFunction.SHA2_256.label == "sha2-256"
    with pytest.raises(ValueError):
        HashFunction.parse("md5")
    with pytest.raises(ValueError):
        HashFunction.parse(0x99)
