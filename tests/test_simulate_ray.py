"""tensorswap simulate --backend ray: workers as actors of a local Ray instance (slow: Ray
takes seconds to start). Skipped where Ray is not installed; CI installs it (the dev extra)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from tensorswap.simulate import SimConfig
from tensorswap.simulate.driver import run_simulation
from tensorswap.simulate.memory import descendants
from tensorswap.simulate.ray_backend import ray_available

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not ray_available(), reason="Ray is not installed (tensorswap[ray])"),
    pytest.mark.timeout(300),
    # Ray's own imports warn (deprecations in its dependencies); not tensorswap's warnings
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]


def _wait_no_children(before: set[int], timeout: float = 30.0) -> list[int]:
    """Ray's processes exit a moment after ray.shutdown(): wait for them (bounded); the
    processes started since ``before`` still alive."""
    deadline = time.monotonic() + timeout
    while True:
        left = sorted(set(descendants(os.getpid())) - before)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def test_ray_backend_matches_the_process_backend(tmp_path: Path) -> None:
    import ray

    before = set(descendants(os.getpid()))
    common = {"clients": 40, "per_round": 8, "rounds": 2, "model_mib": 0.01, "workers": 2}
    local = asyncio.run(run_simulation(SimConfig(**common, out=tmp_path / "process")))
    events: list[str] = []
    on_ray = asyncio.run(
        run_simulation(
            SimConfig(**common, backend="ray", out=tmp_path / "ray"),
            lambda kind, data: events.append(kind),
        )
    )
    assert events == ["ready", "round", "round"]
    assert not ray.is_initialized()  # the local instance it started is shut down
    # the same clients sampled, trained alike: the same global models
    for a, b in zip(local.rounds, on_ray.rounds, strict=True):
        assert sorted(a.participants) == sorted(b.participants)
        assert b.metric == pytest.approx(a.metric, rel=1e-5)
        assert b.sent_bytes > 8 * 10 * 1024
    assert on_ray.peak_memory_bytes > 0 and on_ray.config["backend"] == "ray"
    assert _wait_no_children(before) == []
