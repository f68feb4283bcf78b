"""SecAgg+'s one-pass C quantization gives the numpy loop's words bit for bit.

Both forms quantize the same inputs with the same rounding words (the same seed), edge values
included (zeros of both signs, the clipping bounds and their neighbours, subnormals, values far
outside the range), for several clips, bit widths and weights, over more than one chunk.
The kernel refuses buffers of the wrong type, length or overlap. Skipped where the extension
was not built (no compiler at install): then the numpy loop is what runs.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("cryptography")

from tensorswap.privacy.secagg import quantize as module
from tensorswap.privacy.secagg.crypto import MASK_CHUNK
from tensorswap.privacy.secagg.quantize import Quantizer

pytestmark = pytest.mark.skipif(
    module.native() is None, reason="the quantization kernel was not built (no C compiler)"
)


def _input(clip: float, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * clip).astype(np.float32)
    c = np.float32(clip)
    edges = [0.0, -0.0, c, -c, 2 * c, np.nextafter(c, np.float32(9)), np.nextafter(-c, -9),
             np.nextafter(c, np.float32(0)), 1e-45, -1e-45, 3e38, -3e38]  # fmt: skip
    x[: len(edges)] = edges
    return x


@pytest.mark.parametrize("clip", [0.5, 0.1, 1.7, 3e-3])
@pytest.mark.parametrize("bits", [1, 8, 16, 28, 31])
def test_the_kernel_gives_the_numpy_loops_words(
    clip: float, bits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    quantizer = Quantizer(clip, bits, 1000)
    x = _input(clip, MASK_CHUNK * 2 + 17, bits)
    for weight in (1, 333, 1000):
        monkeypatch.setattr(module, "FUSED", True)
        fused = quantizer.quantize(x, weight, np.random.default_rng(weight))
        monkeypatch.setattr(module, "FUSED", False)
        plain = quantizer.quantize(x, weight, np.random.default_rng(weight))
        np.testing.assert_array_equal(fused, plain)
        assert fused[-1] == weight and fused[:-1].max() <= quantizer.levels


def test_the_kernel_refuses_wrong_buffers() -> None:
    kernel = module.native()
    assert kernel is not None
    x, words, out = np.zeros(8, np.float32), np.zeros(8, np.uint32), np.zeros(8, np.uint32)
    args = (-1.0, 1.0, 1.0, 0.5, 255.0)
    with pytest.raises(TypeError, match="float32"):
        kernel.quantize(x.astype(np.float64), words, out, *args)
    with pytest.raises(TypeError, match="uint32"):
        kernel.quantize(x, words.astype(np.int64), out, *args)
    with pytest.raises(ValueError, match="one length"):
        kernel.quantize(x, words[:7], out, *args)
    with pytest.raises(ValueError, match="overlap"):
        kernel.quantize(x, words, words, *args)
    with pytest.raises(ValueError, match="levels"):
        kernel.quantize(x, words, out, -1.0, 1.0, 1.0, 0.5, 2.0**33)
    frozen = np.zeros(8, np.uint32)
    frozen.flags.writeable = False
    with pytest.raises((BufferError, ValueError), match="read-only"):
        kernel.quantize(x, words, frozen, *args)
