"""Stochastic quantization of a weighted float32 update into integers mod 2^32, and back.

A peer with update ``x`` (float32, 1-D, length d) and weight ``w`` (its num_samples, an
integer in 1..max_weight) sends ``d + 1`` words:

- ``q_j = SR((clip(x_j, -r, r) * w / max_weight + r) / step)`` for each coordinate, with
  ``step = 2r / (2^bits - 1)`` and SR stochastic rounding (down or up to a neighbouring
  integer with the probability that makes it unbiased), so ``0 <= q_j <= 2^bits - 1``;
- the weight ``w`` itself, exactly, as the last word.

The sum of n such vectors mod 2^32 is the exact integer sum as long as
``n * (2^bits - 1) < 2^32`` and ``n * max_weight < 2^32`` (``check_capacity``): then no
coordinate wraps, and ``sum_j * step - n * r`` is the sum of the weighted, clipped inputs.
Dividing by ``sum(w) / max_weight`` gives FedAvg's weighted mean.

Error bound: per peer and coordinate ``|q_j * step - r - v_j| < step`` and ``E[...] = v_j``
(unbiased), with ``v_j = clip(x_j) * w / max_weight``; the sum of n peers errs by less than
``n * step`` (standard deviation at most ``sqrt(n) * step / 2``), the weighted mean by less
than ``n * step * max_weight / sum(w)``: set ``max_weight`` near the real largest weight and
use the most ``bits`` the peer count allows (``max_bits``). Values beyond ``[-r, r]`` are
clipped first (biased, as any clipping).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import ModuleType

import numpy as np

from tensorswap.privacy.secagg.crypto import MASK_CHUNK, mask_stream
from tensorswap.privacy.secagg.errors import QuantizationError, SecAggConfigError

try:  # the one-pass C form (setup.py builds it where a compiler is; optional)
    from tensorswap.privacy.secagg import _quantize  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - exercised where the extension is not built
    _quantize = None

MODULUS = 1 << 32

FUSED = _quantize is not None and os.environ.get("TENSORSWAP_FUSED", "1") != "0"
"""Whether ``Quantizer.quantize`` runs its one-pass C loop (built, and not turned off with
TENSORSWAP_FUSED=0); its words are bit for bit the numpy loop's."""


def native() -> ModuleType | None:
    """The one-pass C extension module (its ``quantize`` entry point), or None where it was
    not built; whether it runs is ``FUSED``. For tests and benchmarks of the C form."""
    return _quantize


def max_bits(peers: int) -> int:
    """The most bits per coordinate whose sum over ``peers`` cannot wrap mod 2^32."""
    bits = 31
    while bits > 1 and peers * ((1 << bits) - 1) >= MODULUS:
        bits -= 1
    return bits


@dataclass(frozen=True)
class Quantizer:
    """The clipping range ``[-clip, clip]``, the ``bits`` per coordinate, the weight bound."""

    clip: float
    bits: int
    max_weight: int

    def __post_init__(self) -> None:
        if not (np.isfinite(self.clip) and self.clip > 0):
            raise SecAggConfigError("clip", self.clip, "must be a finite positive number")
        if not 1 <= self.bits <= 31:
            raise SecAggConfigError("bits", self.bits, "must be in 1..31")
        if not 1 <= self.max_weight < MODULUS:
            raise SecAggConfigError("max_weight", self.max_weight, "must be in 1..2^32-1")

    @property
    def levels(self) -> int:
        """The largest quantized value, ``2^bits - 1``."""
        return (1 << self.bits) - 1

    @property
    def step(self) -> float:
        """The quantization step ``2 * clip / (2^bits - 1)``: the per-coordinate error bound."""
        return 2.0 * self.clip / self.levels

    def check_capacity(self, peers: int) -> None:
        """Refuse a peer count whose sum could wrap mod 2^32 (coordinates or weights)."""
        if peers * self.levels >= MODULUS:
            raise SecAggConfigError(
                "bits", self.bits, f"{peers} peers x (2^{self.bits} - 1) would wrap mod 2^32"
            )
        if peers * self.max_weight >= MODULUS:
            raise SecAggConfigError(
                "max_weight", self.max_weight, f"{peers} peers x max_weight would wrap mod 2^32"
            )

    def quantize(self, update: np.ndarray, weight: int, rng: np.random.Generator) -> np.ndarray:
        """The ``d + 1`` uint32 words of one peer's weighted update (weight last).

        ``rng`` draws the stochastic rounding; pass a generator seeded from ``os.urandom``
        in production (the rounding noise is not a secret the protocol relies on).
        """
        if not isinstance(update, np.ndarray) or update.dtype != np.float32 or update.ndim != 1:
            raise QuantizationError("the update must be a 1-D float32 numpy array")
        if not np.all(np.isfinite(update)):
            raise QuantizationError("the update has non-finite values")
        if isinstance(weight, bool) or not isinstance(weight, int | np.integer):
            raise QuantizationError(f"the weight must be an integer, got {weight!r}")
        if not 1 <= int(weight) <= self.max_weight:
            raise QuantizationError(f"weight {weight} is outside 1..{self.max_weight}")
        # z = (clip(x) * w / M + r) / step in float64 (2^31 levels need > 24 bits); stochastic
        # rounding as floor(z + u), u uniform in [0, 1): up with probability frac(z). u: 32-bit
        # words of a keystream keyed from ``rng`` (4x numpy's draw). Chunk by chunk, so the
        # words (and the numpy path's float64 temporaries) stay in cache.
        fill = mask_stream(rng.bytes(32))
        scale, offset = (int(weight) / self.max_weight) / self.step, self.clip / self.step
        n = min(MASK_CHUNK, update.size)
        words = np.empty(n, dtype=np.uint32)
        out = np.empty(update.size + 1, dtype=np.uint32)
        if FUSED:
            levels = float(self.levels)
            for at in range(0, update.size, MASK_CHUNK):
                part = update[at : at + MASK_CHUNK]
                ww = words[: part.size]
                fill(ww)
                _quantize.quantize(
                    part, ww, out[at : at + part.size], -self.clip, self.clip, scale, offset,
                    levels,
                )  # fmt: skip
            out[-1] = int(weight)
            return out
        z, u = np.empty(n), np.empty(n)
        for at in range(0, update.size, MASK_CHUNK):
            part = update[at : at + MASK_CHUNK]
            zz, uu, ww = z[: part.size], u[: part.size], words[: part.size]
            np.clip(part, -self.clip, self.clip, out=zz)
            zz *= scale
            fill(ww)
            np.multiply(ww, 2.0**-32, out=uu)
            uu += offset
            zz += uu
            np.floor(zz, out=zz)  # >= 0 here, so the cast below is exact
            np.clip(zz, 0, self.levels, out=zz)
            out[at : at + part.size] = zz
        out[-1] = int(weight)
        return out

    def dequantize_sum(self, total: np.ndarray, peers: int) -> tuple[np.ndarray, int]:
        """``(sum of the weighted clipped inputs, sum of the weights)`` from the unmasked sum.

        ``total`` is the sum mod 2^32 of ``peers`` quantized vectors; the first element of
        the result is ``sum_i clip(x_i) * w_i / max_weight`` (float64), within the error bound.
        """
        if total.dtype != np.uint32 or total.ndim != 1 or total.size < 1:
            raise QuantizationError("the sum must be a non-empty 1-D uint32 array")
        values = total[:-1].astype(np.float64)  # the one model-sized float64 array
        values *= self.step
        values -= peers * self.clip
        return values, int(total[-1])

    def weighted_mean(self, total: np.ndarray, peers: int) -> np.ndarray:
        """FedAvg's ``sum(w_i x_i) / sum(w_i)`` (float32) from the unmasked sum of ``peers``.

        The same float64 arithmetic as ``dequantize_sum`` then the scaling, value for value,
        done a cache-sized piece at a time straight into the float32 result: no model-sized
        float64 array."""
        if total.dtype != np.uint32 or total.ndim != 1 or total.size < 1:
            raise QuantizationError("the sum must be a non-empty 1-D uint32 array")
        weight_sum = int(total[-1])
        if weight_sum == 0:
            raise QuantizationError("the weights sum to zero")
        values = total[:-1]
        out = np.empty(values.size, np.float32)
        step, shift, scale = self.step, peers * self.clip, self.max_weight / weight_sum
        work = np.empty(min(MASK_CHUNK, values.size))
        for at in range(0, values.size, MASK_CHUNK):
            part = values[at : at + MASK_CHUNK]
            buf = work[: part.size]
            buf[:] = part
            buf *= step
            buf -= shift
            buf *= scale
            out[at : at + part.size] = buf
        return out
