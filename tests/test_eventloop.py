"""The event loop a long-lived process runs on: uvloop when installed (or asked), else asyncio's."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from helpers.net import running
from tensorswap import _eventloop
from tensorswap._eventloop import EventLoop, UvloopMissing, loop_factory, resolve
from tensorswap._eventloop import run as run_loop
from tensorswap.cli import serve_cmd
from tensorswap.rounds.client import RoundClient
from tensorswap.rounds.core import Complete, RoundId, RoundSpec
from tensorswap.rounds.engine import Coordinator
from tensorswap.rounds.protocol import INLINE_SEND_BYTES
from tensorswap.rounds.server import RoundServer

KEY = b"event-loop-test-key"


@pytest.fixture
def no_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    """As if uvloop were not installed."""
    real = importlib.util.find_spec

    def find_spec(name: str, *args: object) -> object:
        return None if name == "uvloop" else real(name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(_eventloop.importlib.util, "find_spec", find_spec)


def test_auto_is_asyncio_without_uvloop(no_uvloop: None) -> None:
    assert resolve("auto") is EventLoop.ASYNCIO
    assert loop_factory(EventLoop.AUTO) is asyncio.new_event_loop


def test_asking_for_uvloop_without_it_is_a_typed_error(no_uvloop: None) -> None:
    with pytest.raises(UvloopMissing, match="tensorswap\\[fast\\]"):
        resolve(EventLoop.UVLOOP)


def test_an_unknown_loop_is_refused() -> None:
    with pytest.raises(ValueError):
        resolve("trio")


async def _kind() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_asyncio_is_the_default_even_with_uvloop_installed() -> None:
    assert run_loop(_kind()).startswith("asyncio")
    assert run_loop(_kind(), "asyncio").startswith("asyncio")


def test_serve_refuses_uvloop_where_it_is_missing(no_uvloop: None, tmp_path: Path) -> None:
    args = ["--listen", "127.0.0.1:0", "--data", str(tmp_path), "--event-loop", "uvloop"]
    result = CliRunner().invoke(serve_cmd.serve, args)
    assert result.exit_code == 2
    assert "uvloop is not installed" in result.output


def test_serve_help_names_the_switch() -> None:
    result = CliRunner().invoke(serve_cmd.serve, ["--help"])
    assert result.exit_code == 0
    assert "--event-loop" in result.output and "uvloop" in result.output


async def _two_rounds(tmp_path: Path) -> tuple[str, list[dict[str, np.ndarray]]]:
    """A round of tiny updates (inline submits), then one of large ones (BLOCK frames, and
    sends large enough to go straight from the buffer to the socket)."""
    big = np.arange(64 * 1024, dtype=np.float32)
    assert big.nbytes > INLINE_SEND_BYTES
    updates = [
        ({"w": np.full(16, 1.0, np.float32)}, {"w": np.full(16, 3.0, np.float32)}),
        ({"w": big}, {"w": -3 * big}),
    ]
    results = []
    with Coordinator.open(tmp_path, run_timer=False) as coord:
        async with running(RoundServer(coord, key=KEY)) as srv:
            port = srv.port
            async with (
                await RoundClient.connect("127.0.0.1", port, peer="a", key=KEY) as a,
                await RoundClient.connect("127.0.0.1", port, peer="b", key=KEY) as b,
            ):
                for number, (first, second) in enumerate(updates, 1):
                    rid = RoundId(number, "uvloop")
                    await a.start_round(rid, RoundSpec(2))
                    await a.submit(rid, first, 1)
                    await b.submit(rid, second, 1)
                    assert isinstance(await a.wait(rid, timeout=30), Complete)
                    results.append(await b.fetch_result(rid, timeout=30))
            assert srv.stats.requests >= 4
    return type(asyncio.get_running_loop()).__module__, results


def test_rounds_run_on_uvloop(tmp_path: Path) -> None:
    pytest.importorskip("uvloop")
    module, (tiny, large) = run_loop(_two_rounds(tmp_path), "uvloop")
    assert module.startswith("uvloop")
    np.testing.assert_allclose(tiny["w"], 2.0)
    np.testing.assert_allclose(large["w"], -np.arange(64 * 1024, dtype=np.float32))
