"""--max-inflight-bytes on `tensorswap serve` and `tensorswap recv`, down to the server."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from tensorswap.cli import recv_cmd, serve_cmd
from tensorswap.cli._util import BYTES
from tensorswap.rounds.engine import Coordinator
from tensorswap.rounds.server import RoundServer
from tensorswap.store import MemoryStore


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [("1073741824", 1 << 30), ("512MiB", 512 << 20), ("1G", 1 << 30), ("64k", 64 << 10)],
)
def test_a_byte_size_takes_plain_numbers_and_binary_units(text: str, nbytes: int) -> None:
    assert BYTES.convert(text, None, None) == nbytes


@pytest.mark.parametrize("text", ["0", "1.5G", "lots", "-1", "5X"])
def test_a_byte_size_refuses_what_is_not_one(text: str) -> None:
    with pytest.raises(click.BadParameter):
        BYTES.convert(text, None, None)


@pytest.mark.parametrize("command", [serve_cmd.serve, recv_cmd.recv])
def test_help_explains_the_budget(command: click.Command) -> None:
    result = CliRunner().invoke(command, ["--help"])
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    assert "--max-inflight-bytes" in text
    assert "over_budget" in text
    assert "[default: 1GiB]" in text


def test_serve_passes_the_budget_to_the_round_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, Any] = {}

    signature = inspect.signature(serve_cmd.run_server)

    async def fake_run(*args: Any, **kwargs: Any) -> None:
        seen.update(signature.bind(*args, **kwargs).arguments)

    monkeypatch.setattr(serve_cmd, "run_server", fake_run)
    monkeypatch.setattr(serve_cmd, "release_large_frees", lambda: True)
    args = ["--listen", "127.0.0.1:0", "--data", str(tmp_path / "d")]
    result = CliRunner().invoke(serve_cmd.serve, [*args, "--max-inflight-bytes", "256MiB"])
    assert result.exit_code == 0, result.output
    assert seen["max_inflight_bytes"] == 256 << 20
    result = CliRunner().invoke(serve_cmd.serve, [*args, "--max-inflight-bytes", "0"])
    assert result.exit_code == 2
    assert "below 1 byte" in result.output


def test_recv_passes_the_budget_to_the_block_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, Any] = {}

    async def fake_serve(*args: Any) -> None:
        seen["max_inflight_bytes"], seen["block_crc"] = args[6], args[7]

    monkeypatch.setattr(recv_cmd, "_serve_blocks", fake_serve)
    args = ["--listen", "127.0.0.1:0", "--out", str(tmp_path / "out")]
    result = CliRunner().invoke(recv_cmd.recv, [*args, "--max-inflight-bytes", "3G"])
    assert result.exit_code == 0, result.output
    assert seen["max_inflight_bytes"] == 3 << 30
    assert seen["block_crc"] is False  # lean blocks by default
    result = CliRunner().invoke(recv_cmd.recv, [*args, "--block-crc"])
    assert result.exit_code == 0, result.output
    assert seen["block_crc"] is True


def test_the_round_server_passes_its_budget_to_the_block_service() -> None:
    with Coordinator(MemoryStore(), run_timer=False) as coordinator:
        server = RoundServer(coordinator, max_inflight_bytes=5 << 20)
        assert server.stats.inflight_limit_bytes == 5 << 20
        with pytest.raises(ValueError, match="max_inflight_bytes"):
            RoundServer(coordinator, max_inflight_bytes=0)
