"""A simulation's processes keep freed memory for the next round (glibc's malloc tunables)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from tensorswap.simulate._env import MALLOC_SETTINGS, sim_env
from tensorswap.simulate.coordinator import Coordinator


def test_the_settings_are_added_and_the_users_own_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in MALLOC_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    env = sim_env()
    assert {k: env[k] for k in MALLOC_SETTINGS} == MALLOC_SETTINGS
    assert env["OMP_NUM_THREADS"] == "1" and "PYTHONPATH" in env  # child_env's, as before
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "4096")
    assert sim_env()["MALLOC_TRIM_THRESHOLD_"] == "4096"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_coordinator_process_runs_with_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in MALLOC_SETTINGS:
        monkeypatch.delenv(name, raising=False)

    async def environ() -> bytes:
        coordinator = Coordinator(tmp_path)
        try:
            await coordinator.start()
            return Path(f"/proc/{coordinator.pid}/environ").read_bytes()
        finally:
            await coordinator.aclose()

    seen = asyncio.run(environ()).split(b"\0")
    for name, value in MALLOC_SETTINGS.items():
        assert f"{name}={value}".encode() in seen
