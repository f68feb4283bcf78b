"""The cryptographic primitives of SecAgg+, all from the ``cryptography`` package.

- Key agreement: X25519. Each peer holds two key pairs per round, one whose agreed secrets
  key the encryption of shares and one whose agreed secrets seed the pairwise masks.
- Key derivation: HKDF-SHA256 over the X25519 output, salted with the round id, with a
  distinct ``info`` label per use, so one agreement never keys two purposes.
- Encryption of shares: ChaCha20-Poly1305 (AEAD), a random 96-bit nonce per message,
  the (round, source, destination) bound as associated data.
- Mask expansion (the PRG, named by the round's config, ``SecAggConfig.prg``): the keystream
  of a standard stream cipher under a 32-byte HKDF output as key, from an all-zero
  nonce/counter, read as little-endian uint32 words. ``aes256-ctr`` (the default: AES-256
  in counter mode, 2.2x ChaCha20's speed where the CPU has AES instructions, as every
  x86-64 and ARMv8 server CPU of the last decade does) or ``chacha20``. Either keystream
  is a PRF output; every 32-bit word is uniform mod 2^32 with no modular bias, and each
  key is fresh per round and purpose, so the fixed nonce is never reused with one key for
  two different streams.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, CipherContext, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)

from tensorswap.privacy.secagg.errors import KeyAdvertRejected, ShareDecryptionFailed

PRGS = ("aes256-ctr", "chacha20")
"""The mask PRGs a config may name (``SecAggConfig.prg``; ``keystream``)."""
DEFAULT_PRG = "aes256-ctr"
KEY_BYTES = 32
NONCE_BYTES = 12
INFO_SHARE_KEY = b"tensorswap secagg+ v1 share encryption"
INFO_PAIR_MASK = b"tensorswap secagg+ v1 pairwise mask"
INFO_SELF_MASK = b"tensorswap secagg+ v1 self mask"
_ZERO_NONCE = bytes(16)


def keystream(seed: bytes, prg: str = DEFAULT_PRG) -> CipherContext:
    """The PRG ``prg``'s keystream under the 32-byte ``seed`` (an encryptor; encrypting zeros
    yields the stream). ValueError for a PRG not in ``PRGS``."""
    if prg == "aes256-ctr":
        return Cipher(algorithms.AES256(seed), modes.CTR(_ZERO_NONCE)).encryptor()
    if prg == "chacha20":
        return Cipher(algorithms.ChaCha20(seed, _ZERO_NONCE), mode=None).encryptor()
    raise ValueError(f"unknown mask PRG {prg!r}; known: {', '.join(PRGS)}")


def generate_keypair() -> tuple[bytes, bytes]:
    """A fresh X25519 ``(private, public)`` pair as 32 raw bytes each."""
    sk = X25519PrivateKey.generate()
    return (
        sk.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption()),
        sk.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw),
    )


def public_key_of(private_key: bytes) -> bytes:
    """The X25519 public key of a raw private key (to check a reconstructed key)."""
    sk = X25519PrivateKey.from_private_bytes(private_key)
    return sk.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def agree(private_key: bytes, peer_public: bytes, *, round_id: bytes, info: bytes) -> bytes:
    """A 32-byte key both ends derive: HKDF-SHA256(X25519(sk, pk), salt=round, info)."""
    try:
        pk = X25519PublicKey.from_public_bytes(peer_public)
        shared = X25519PrivateKey.from_private_bytes(private_key).exchange(pk)
    except ValueError as exc:  # wrong length, or a low-order point (all-zero output)
        raise KeyAdvertRejected(f"unusable X25519 public key: {exc}") from exc
    return derive(shared, round_id=round_id, info=info)


def derive(material: bytes, *, round_id: bytes, info: bytes) -> bytes:
    """HKDF-SHA256 of ``material`` to 32 bytes, salted with the round id."""
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=round_id, info=info).derive(
        material
    )


def _aad(round_id: bytes, source: int, destination: int) -> bytes:
    return round_id + source.to_bytes(8, "big") + destination.to_bytes(8, "big")


def encrypt(
    key: bytes, plaintext: bytes, *, round_id: bytes, source: int, destination: int
) -> bytes:
    """``nonce || ChaCha20-Poly1305(plaintext)`` with (round, source, destination) as AAD."""
    nonce = os.urandom(NONCE_BYTES)
    return nonce + ChaCha20Poly1305(key).encrypt(
        nonce, plaintext, _aad(round_id, source, destination)
    )


def decrypt(key: bytes, blob: bytes, *, round_id: bytes, source: int, destination: int) -> bytes:
    """The plaintext of ``encrypt``; any tampering, or another key or route, is refused."""
    if len(blob) < NONCE_BYTES + 16:
        raise ShareDecryptionFailed(source, destination)
    try:
        return ChaCha20Poly1305(key).decrypt(
            blob[:NONCE_BYTES], blob[NONCE_BYTES:], _aad(round_id, source, destination)
        )
    except InvalidTag as exc:
        raise ShareDecryptionFailed(source, destination) from exc


_ZEROS = bytes(1 << 20)
"""The plaintext the keystream is read through, a chunk at a time (read-only, shared)."""


def expand_mask(seed: bytes, length: int, prg: str = DEFAULT_PRG) -> np.ndarray:
    """``length`` uniform uint32 words: the keystream of ``prg`` under the 32-byte ``seed``,
    written straight into the result (no intermediate bytes object)."""
    encryptor = keystream(seed, prg)
    out = np.empty(length, dtype=np.uint32)
    raw = out.view(np.uint8)
    chunk = len(_ZEROS)
    for at in range(0, raw.size, chunk):
        piece = raw[at : at + chunk]
        encryptor.update_into(memoryview(_ZEROS)[: piece.size], piece.data)
    if sys.byteorder == "big":  # the words are little-endian by definition
        out.byteswap(inplace=True)
    return out


MASK_CHUNK = 1 << 16
"""Words per step of ``apply_masks``: the target's chunk and one keystream chunk stay in cache."""


def apply_masks(
    target: np.ndarray, masks: Sequence[tuple[bytes, int]], prg: str = DEFAULT_PRG
) -> None:
    """Add (sign > 0) or subtract (sign < 0) ``expand_mask(seed, len(target), prg)`` for
    every ``(seed, sign)`` into the uint32 array ``target``, mod 2^32, in place: the same
    words as ``expand_mask``, streamed a cache-sized chunk at a time (one pass over
    ``target``, not one per mask)."""
    if target.dtype != np.uint32 or target.ndim != 1 or not target.flags.c_contiguous:
        raise TypeError("apply_masks adds into a contiguous 1-D uint32 array")
    streams = [(keystream(seed, prg), sign > 0) for seed, sign in masks]
    buffer = np.empty(min(MASK_CHUNK, target.size), dtype=np.uint32)
    zeros = memoryview(_ZEROS)
    for at in range(0, target.size, MASK_CHUNK):
        part = target[at : at + MASK_CHUNK]
        words = buffer[: part.size]
        for stream, add in streams:
            stream.update_into(zeros[: 4 * part.size], words.view(np.uint8).data)
            if sys.byteorder == "big":
                words.byteswap(inplace=True)
            if add:
                np.add(part, words, out=part)
            else:
                np.subtract(part, words, out=part)


def mask_stream(seed: bytes, prg: str = DEFAULT_PRG) -> Callable[[np.ndarray], None]:
    """A function filling a uint32 array with the next words of ``expand_mask(seed, ...,
    prg)``'s stream, call after call (for consumers that go chunk by chunk)."""
    stream = keystream(seed, prg)
    zeros = memoryview(_ZEROS)

    def fill(words: np.ndarray) -> None:
        raw = words.view(np.uint8)
        for at in range(0, raw.size, len(_ZEROS)):
            piece = raw[at : at + len(_ZEROS)]
            stream.update_into(zeros[: piece.size], piece.data)
        if sys.byteorder == "big":
            words.byteswap(inplace=True)

    return fill
