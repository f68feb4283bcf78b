"""A run's step streamed chunk by chunk stores the very updates the whole-model step stores."""

from __future__ import annotations

import numpy as np
import pytest

from tensorswap.aggregate import server_optimizer
from tensorswap.cid import Cid
from tensorswap.runs.stream import stream_step
from tensorswap.store import MemoryStore, ModelUpdate, get_update, put_update

KINDS = ["fedavg", "fedavgm", "fedadam", "fedyogi", "fedadagrad", "nesterov"]


def _model(rng: np.random.Generator, dtype: type) -> dict[str, np.ndarray]:
    return {
        "big": rng.standard_normal(1_500_000).astype(dtype),  # two 4 MiB chunks (f32)
        "small": rng.standard_normal((7, 3)).astype(dtype),
        "empty": np.zeros((0, 4), dtype),
    }


def _whole(store, kind, version, current, aggregate, state, delta, meta, name):  # type: ignore[no-untyped-def]
    opt = server_optimizer(kind)
    cur = dict(get_update(store, current).tensors)
    agg = dict(get_update(store, aggregate).tensors)
    if delta:
        agg = {k: cur[k] + agg[k] for k in cur}
    if state is not None:
        opt.load_state(dict(get_update(store, state).tensors))
    new = {k: v.astype(cur[k].dtype, copy=False) for k, v in opt.step(cur, agg, version).items()}
    g = put_update(store, ModelUpdate(new, 0, meta, name=name))
    s = (
        put_update(store, ModelUpdate(opt.state, 0, meta, name=f"{name}/state"))
        if opt.state
        else None
    )
    return g, s


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("dtype", "delta"), [(np.float32, False), (np.float64, True)])
def test_streamed_steps_equal_whole_steps(kind: str, dtype: type, delta: bool) -> None:
    rng = np.random.default_rng(5)
    store = MemoryStore()
    current = put_update(store, ModelUpdate(_model(rng, dtype)))
    state: Cid | None = None
    for version in (1, 2):
        aggregate = put_update(store, ModelUpdate(_model(rng, dtype)))
        meta, name = {"version": str(version)}, f"r@{version}"
        args = (version, current, aggregate, state)
        got = stream_step(
            store, server_optimizer(kind), *args, delta=delta, metadata=meta, name=name
        )
        assert got is not None
        assert got == _whole(store, kind, *args, delta, meta, name)
        current, state = got


def test_other_layouts_fall_back() -> None:
    store = MemoryStore()
    f16 = {"w": np.ones(8, np.float16)}
    current = put_update(store, ModelUpdate(f16))
    opt = server_optimizer("fedavg")
    assert (
        stream_step(store, opt, 1, current, current, None, delta=False, metadata={}, name="x")
        is None
    )
    small = put_update(store, ModelUpdate({"w": np.ones(4096, np.float32)}), chunk_bytes=1024)
    big = put_update(store, ModelUpdate({"w": np.ones(4096, np.float32)}))
    assert stream_step(store, opt, 1, small, big, None, delta=False, metadata={}, name="x") is None


def test_noise_streamed_chunk_by_chunk_has_the_asked_scale_and_spread() -> None:
    from tensorswap.runs.stream import stream_noised

    store = MemoryStore()
    values = {"big": np.full(1_500_000, 2.0, np.float32), "small": np.ones((3, 3), np.float64)}
    aggregate = put_update(store, ModelUpdate(values))
    rng = np.random.default_rng(3)
    cid = stream_noised(store, aggregate, 0.5, 0.1, rng, metadata={"dp": "x"}, name="r@1/dp")
    noised = get_update(store, cid)
    assert noised.metadata == {"dp": "x"} and noised.name == "r@1/dp"
    big = noised.tensors["big"]
    assert big.dtype == np.float32 and noised.tensors["small"].dtype == np.float64
    assert abs(float(big.mean()) - 1.0) < 1e-3  # 2.0 x 0.5, plus zero-mean noise
    assert abs(float(big.std()) - 0.1) < 1e-3
    assert len(np.unique(big[:1000])) > 900  # independent draws, not one per chunk
