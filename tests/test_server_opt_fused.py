"""The fused C kernels of FedAdam, FedYogi and FedAdagrad give the numpy kernels' bits.

Both forms run on the same inputs, special values included (zeros of both signs, NaN, inf,
subnormals), over several steps so the state carries over; the state and the new model must
agree bit for bit, for float32 and float64, whole and split over threads. Skipped where the
extension was not built (no compiler at install): then the numpy kernels are what runs.
"""

from __future__ import annotations

import numpy as np
import pytest

from tensorswap.aggregate import server_optimizer
from tensorswap.aggregate.server_opt import kernels

pytestmark = pytest.mark.skipif(
    kernels.native() is None, reason="the fused kernels were not built (no C compiler at install)"
)

KINDS = {
    "fedadam": {},
    "fedadam-tuned": {"eta": 0.05, "beta_1": 0.5, "beta_2": 0.9, "tau": 0.01},
    "fedyogi": {},
    "fedyogi-tuned": {"eta": 0.1, "beta_1": 0.8, "beta_2": 0.95, "tau": 0.05},
    "fedadagrad": {},
}
SPECIAL = [0.0, -0.0, np.nan, np.inf, -np.inf, 1e-42, -1e-42, 3.4e38, -3.4e38, 1.0, -1.0]


def _inputs(dtype: type, n: int, seed: int) -> tuple[dict, dict]:
    rng = np.random.default_rng(seed)
    cur = rng.standard_normal(n).astype(dtype)
    agg = (cur + rng.standard_normal(n) / 10).astype(dtype)
    cur[: len(SPECIAL)] = SPECIAL
    agg[len(SPECIAL) : 2 * len(SPECIAL)] = SPECIAL
    agg[2 * len(SPECIAL) : 3 * len(SPECIAL)] = cur[2 * len(SPECIAL) : 3 * len(SPECIAL)]  # d = 0
    return {"w": cur.reshape(-1, 1), "b": cur[:40].copy()}, {"w": agg.reshape(-1, 1), "b": agg[:40]}


def _bits(arrays: dict[str, np.ndarray]) -> dict[str, bytes]:
    return {k: v.tobytes() for k, v in arrays.items()}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", list(KINDS))
@pytest.mark.parametrize("workers", [1, 3])
def test_fused_and_numpy_kernels_agree_bit_for_bit(
    case: str, dtype: type, workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    kind = case.split("-")[0]
    n = 2 * kernels.PIECE + 77 if workers > 1 else 3001  # several pieces when threaded
    cur, agg = _inputs(dtype, n, seed=len(case))
    fused = server_optimizer(kind, workers=workers, **KINDS[case])
    plain = server_optimizer(kind, workers=workers, **KINDS[case])
    for server_round in (1, 2, 3):
        monkeypatch.setattr(kernels, "FUSED", True)
        got = fused.step(cur, agg, server_round)
        monkeypatch.setattr(kernels, "FUSED", False)
        want = plain.step(cur, agg, server_round)
        assert _bits(got) == _bits(want), f"round {server_round}"
        assert _bits(fused.state) == _bits(plain.state), f"state after round {server_round}"
        cur = {k: v.astype(dtype) for k, v in got.items()}
    assert all(v.dtype == dtype for v in got.values())


def test_fused_entry_point_refuses_mismatched_buffers() -> None:
    fused = kernels.native()
    assert fused is not None
    a32, a64 = np.zeros(8, np.float32), np.zeros(8, np.float64)
    args = (0.9, 0.1, 0.99, 0.01, 0.1, 1e-9)
    with pytest.raises(ValueError, match="one dtype and one length"):
        fused.adaptive(fused.ADAM, a32, a32, a32, a32, np.zeros(7, np.float32), *args)
    with pytest.raises(ValueError, match="one dtype and one length"):
        fused.adaptive(fused.ADAM, a32, a32, a32, a32, a64, *args)
    with pytest.raises(TypeError, match="float32 or float64"):
        fused.adaptive(fused.ADAM, *[np.zeros(8, np.int32)] * 5, *args)
    with pytest.raises(ValueError, match="unknown rule"):
        fused.adaptive(7, a32, a32, a32, a32, a32, *args)
    with pytest.raises(ValueError, match="must not overlap"):
        fused.adaptive(fused.ADAM, a32, a32, a32.copy(), a32.copy(), a32, *args)
    m = np.zeros(8, np.float32)
    with pytest.raises(ValueError, match="must not overlap"):
        fused.adaptive(fused.ADAM, a32, a32.copy(), m, m, np.zeros(8, np.float32), *args)
    read_only = np.zeros(8, np.float32)
    read_only.flags.writeable = False
    with pytest.raises((BufferError, ValueError, TypeError)):
        fused.adaptive(fused.ADAM, a32, a32, read_only, a32, a32, *args)
    with pytest.raises((BufferError, ValueError, TypeError)):  # not contiguous
        fused.adaptive(fused.ADAM, *[np.zeros(16, np.float32)[::2]] * 5, *args)


def test_step_piece_refuses_an_out_that_overlaps_an_input() -> None:
    from tensorswap.aggregate import InvalidServerStepInput

    opt = server_optimizer("fedadam")
    cur, agg = np.ones(16, np.float32), np.zeros(16, np.float32)
    state = {"m": np.zeros(16, np.float32), "v": np.zeros(16, np.float32)}
    with pytest.raises(InvalidServerStepInput, match="must not overlap"):
        opt.step_piece(1, cur, agg, state, cur)
    with pytest.raises(InvalidServerStepInput, match="must not overlap"):
        opt.step_piece(1, cur, agg, {"m": state["m"], "v": state["m"]}, np.empty(16, np.float32))
    out = np.empty(16, np.float32)
    opt.step_piece(1, cur, agg, state, out)  # disjoint: fine, and the same as a whole step
    assert (
        out.tobytes() == server_optimizer("fedadam").step({"w": cur}, {"w": agg}, 1)["w"].tobytes()
    )
