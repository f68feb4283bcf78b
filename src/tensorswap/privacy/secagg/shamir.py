"""t-of-n Shamir secret sharing of short byte strings over the prime field GF(2^127 - 1).

A secret of up to 255 bytes is cut into 15-byte chunks (each below the prime, big-endian);
every chunk is the constant term of its own random polynomial of degree ``t - 1``, and the
share for index ``x`` holds the evaluation of each polynomial at ``x``. Any ``t`` shares
recover the secret by Lagrange interpolation at 0; any ``t - 1`` are consistent with every
possible secret (perfect secrecy), so they reveal nothing but its length.

Share bytes: ``index`` (u16, big-endian, 1..65535), ``secret length`` (u8), then one 16-byte
big-endian field element per chunk. The coefficients come from ``secrets.randbelow``.
"""

from __future__ import annotations

import secrets
import struct
from collections.abc import Callable, Iterable, Sequence

from tensorswap.privacy.secagg.errors import (
    DuplicateShareIndex,
    MalformedShare,
    NotEnoughShares,
    SecAggConfigError,
)

PRIME = (1 << 127) - 1
"""The Mersenne prime 2^127 - 1: the field every share lives in."""

CHUNK_BYTES = 15  # 120 bits < 127: every chunk is a field element
ELEMENT_BYTES = 16
_HEADER = struct.Struct(">HB")
MAX_INDEX = 0xFFFF
MAX_SECRET_BYTES = 0xFF


def evaluate_polynomial(coefficients: Sequence[int], x: int) -> int:
    """``sum(c_i * x^i) mod PRIME`` (Horner), ``coefficients[0]`` the constant term."""
    acc = 0
    for c in reversed(coefficients):
        acc = (acc * x + c) % PRIME
    return acc


def lagrange_at_zero(xs: Sequence[int]) -> list[int]:
    """The Lagrange weights ``l_i(0) = prod_{j != i} x_j / (x_j - x_i) mod PRIME`` of the
    distinct nonzero points ``xs``: the value at 0 of the polynomial through ``(x_i, y_i)``
    is ``sum(l_i * y_i)``. One modular inversion per point (``pow(d, -1, PRIME)``), shared by
    every chunk of a secret. Refuses a repeated or zero x (``DuplicateShareIndex``)."""
    xs = [x % PRIME for x in xs]
    seen: set[int] = set()
    for x in xs:
        if x in seen or x == 0:
            raise DuplicateShareIndex(x)
        seen.add(x)
    weights = []
    for i, xi in enumerate(xs):
        num = 1
        den = 1
        for j, xj in enumerate(xs):
            if j != i:
                num = num * xj % PRIME
                den = den * (xj - xi) % PRIME
        weights.append(num * pow(den, -1, PRIME) % PRIME)
    return weights


def interpolate_at_zero(points: Sequence[tuple[int, int]]) -> int:
    """The value at 0 of the unique polynomial of degree < len(points) through ``points``.

    Refuses two points with the same x (``DuplicateShareIndex``). It does not know the
    threshold: given fewer points than the polynomial's degree + 1 it returns a value that
    is unrelated to the secret, which is why ``combine_shares`` checks the count first.
    """
    weights = lagrange_at_zero([x for x, _ in points])
    return sum(w * y for w, (_, y) in zip(weights, points, strict=True)) % PRIME


def _chunks(secret: bytes) -> list[int]:
    return [
        int.from_bytes(secret[i : i + CHUNK_BYTES], "big")
        for i in range(0, len(secret), CHUNK_BYTES)
    ]


def split_secret(
    secret: bytes,
    threshold: int,
    indices: Iterable[int],
    *,
    randbelow: Callable[[int], int] = secrets.randbelow,
) -> dict[int, bytes]:
    """Shares of ``secret`` for each of ``indices`` such that any ``threshold`` recover it.

    ``randbelow`` draws the random coefficients (``secrets.randbelow``: a CSPRNG); tests pass
    a fixed source to compare against hand-computed vectors.
    """
    points = list(indices)
    if not 1 <= len(secret) <= MAX_SECRET_BYTES:
        raise SecAggConfigError("secret", len(secret), "must be 1..255 bytes long")
    if len(set(points)) != len(points):
        dup = next(p for p in points if points.count(p) > 1)
        raise DuplicateShareIndex(dup)
    if any(not 1 <= p <= MAX_INDEX for p in points):
        raise SecAggConfigError("indices", points, "every index must be in 1..65535")
    if not 1 <= threshold <= len(points):
        raise SecAggConfigError(
            "threshold", threshold, f"must be in 1..{len(points)} (the number of shares)"
        )
    polynomials = [
        [chunk] + [randbelow(PRIME) for _ in range(threshold - 1)] for chunk in _chunks(secret)
    ]
    return {
        x: _HEADER.pack(x, len(secret))
        + b"".join(
            evaluate_polynomial(poly, x).to_bytes(ELEMENT_BYTES, "big") for poly in polynomials
        )
        for x in points
    }


def parse_share(share: bytes) -> tuple[int, int, list[int]]:
    """``(index, secret length, field elements)`` of one share, validated."""
    if len(share) < _HEADER.size:
        raise MalformedShare(f"{len(share)} bytes is shorter than the header")
    index, length = _HEADER.unpack_from(share)
    n_chunks = -(-length // CHUNK_BYTES)
    if length == 0 or len(share) != _HEADER.size + n_chunks * ELEMENT_BYTES:
        raise MalformedShare(f"{len(share)} bytes do not fit a {length}-byte secret")
    if index == 0:
        raise MalformedShare("index 0 would be the secret itself")
    elements = [
        int.from_bytes(share[off : off + ELEMENT_BYTES], "big")
        for off in range(_HEADER.size, len(share), ELEMENT_BYTES)
    ]
    if any(e >= PRIME for e in elements):
        raise MalformedShare("a field element is not below the prime")
    return index, length, elements


def combine_shares(shares: Iterable[bytes], threshold: int) -> bytes:
    """The secret from at least ``threshold`` shares (all given are interpolated).

    Refuses fewer than ``threshold`` (``NotEnoughShares``), two at one index
    (``DuplicateShareIndex``), and shares of different secret lengths (``MalformedShare``).
    Consistent shares give the secret; a corrupted share gives a wrong secret, which the
    caller detects against a commitment.
    """
    parsed = [parse_share(s) for s in shares]
    if len(parsed) < threshold:
        raise NotEnoughShares(len(parsed), threshold)
    lengths = {length for _, length, _ in parsed}
    if len(lengths) != 1:
        raise MalformedShare(f"shares of different secret lengths {sorted(lengths)}")
    (length,) = lengths
    out = bytearray()
    n_chunks = len(parsed[0][2])
    weights = lagrange_at_zero([x for x, _, _ in parsed])  # the same for every chunk
    for c in range(n_chunks):
        ys = [elements[c] for _, _, elements in parsed]
        value = sum(w * y for w, y in zip(weights, ys, strict=True)) % PRIME
        width = min(CHUNK_BYTES, length - c * CHUNK_BYTES)
        if value >= 1 << (8 * width):
            # Inconsistent shares interpolate to a field element wider than the chunk.
            raise MalformedShare("the shares do not interpolate to a secret of this length")
        out += value.to_bytes(width, "big")
    return bytes(out)
