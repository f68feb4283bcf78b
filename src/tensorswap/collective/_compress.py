"""Chunk codecs for the collective's wire: raw float32, float16, int8 with a scale per block."""

from __future__ import annotations

from typing import Literal, Protocol

import numpy as np

from tensorswap.collective.errors import BadCollectiveMessage

__all__ = ["INT8_BLOCK", "ChunkCodec", "Compression", "codec_for"]

Compression = Literal["none", "fp16", "int8"]
INT8_BLOCK = 256
"""Elements sharing one float32 scale in the int8 codec."""


class ChunkCodec(Protocol):
    def encode(self, values: np.ndarray) -> np.ndarray:
        """The chunk's bytes (a fresh or viewed contiguous array) for float32 ``values``."""

    def decode(self, data: memoryview, size: int) -> np.ndarray:
        """``size`` float32 values from ``data``; BadCollectiveMessage if it cannot be."""


class _Raw:
    def encode(self, values: np.ndarray) -> np.ndarray:
        return values

    def decode(self, data: memoryview, size: int) -> np.ndarray:
        _check(data, 4 * size, "float32")
        return np.frombuffer(data, np.float32)


class _Half:
    def encode(self, values: np.ndarray) -> np.ndarray:
        return np.clip(values, -65504.0, 65504.0).astype(np.float16)

    def decode(self, data: memoryview, size: int) -> np.ndarray:
        _check(data, 2 * size, "float16")
        return np.frombuffer(data, np.float16).astype(np.float32)


class _Int8:
    """Symmetric int8 per block of INT8_BLOCK values: the float32 scales, then the codes."""

    def encode(self, values: np.ndarray) -> np.ndarray:
        size = values.size
        blocks = -(-size // INT8_BLOCK)
        padded = np.zeros(blocks * INT8_BLOCK, np.float32)
        padded[:size] = values
        shaped = padded.reshape(blocks, INT8_BLOCK)
        scales = np.abs(shaped).max(axis=1) / np.float32(127.0)
        safe = np.where(scales > 0, scales, np.float32(1.0)).astype(np.float32)
        codes = np.rint(shaped / safe[:, None]).clip(-127, 127).astype(np.int8)
        out = np.empty(4 * blocks + size, np.uint8)
        out[: 4 * blocks] = scales.astype(np.float32).view(np.uint8)
        out[4 * blocks :] = codes.reshape(-1)[:size].view(np.uint8)
        return out

    def decode(self, data: memoryview, size: int) -> np.ndarray:
        blocks = -(-size // INT8_BLOCK)
        _check(data, 4 * blocks + size, "int8")
        raw = np.frombuffer(data, np.uint8)
        scales = raw[: 4 * blocks].view(np.float32)
        if not np.isfinite(scales).all():
            raise BadCollectiveMessage("an int8 chunk with a non-finite scale")
        codes = np.zeros(blocks * INT8_BLOCK, np.float32)
        codes[:size] = raw[4 * blocks :].view(np.int8)
        out = (codes.reshape(blocks, INT8_BLOCK) * scales[:, None]).reshape(-1)
        return np.ascontiguousarray(out[:size])


def _check(data: memoryview, expected: int, what: str) -> None:
    if data.nbytes != expected:
        raise BadCollectiveMessage(f"a {what} chunk of {data.nbytes} bytes, not {expected}")


_CODECS: dict[str, ChunkCodec] = {"none": _Raw(), "fp16": _Half(), "int8": _Int8()}


def codec_for(compression: str) -> ChunkCodec:
    codec = _CODECS.get(compression)
    if codec is None:
        raise ValueError(f"compression {compression!r}: one of {', '.join(_CODECS)}")
    return codec
