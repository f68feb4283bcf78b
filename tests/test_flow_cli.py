"""``tensorswap flow pub`` and ``tensorswap flow sub``."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest
from click.testing import CliRunner

from helpers.net import IpcEndpoints
from tensorswap.cli import cli, main
from tensorswap.flow import (
    IpcMessage,
    Loss,
    NeuromodulatorSnapshot,
    Ping,
    encode,
    encode_message,
    f32,
)

LINES = "\n".join(
    [
        '{"Loss":0.25}',
        '"Ping"',
        "not json",
        '{"Loss":1e39}',
        "",
        '{"payload":{"Neuromodulators":{"acetylcholine":0.75,"cortisol":0.5,"dopamine":0.1,'
        '"tempo":1.0,"tick":1}},"wire_version":1}',
        '{"Neuromodulators":{"tick":1,"dopamine":2,"cortisol":0,"acetylcholine":0,"tempo":1}}',
    ]
)
GOOD = [
    Loss(0.25),
    Ping(),
    NeuromodulatorSnapshot(tick=1, dopamine=f32(0.1), cortisol=0.5, acetylcholine=0.75, tempo=1.0),
]


@pytest.fixture
def endpoint(ipc_endpoint: IpcEndpoints) -> str:
    return ipc_endpoint("cli")


def run(*args: str, stdin: str = "") -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, list(args), input=stdin)
    return result.exit_code, result.stdout, result.stderr


def test_pub_reports_each_bad_line_with_its_number(endpoint: str) -> None:
    code, _, err = run("flow", "pub", endpoint, "--wait", "0", "--linger", "0", stdin=LINES)
    assert code == 1
    assert "line 3: failed to decode envelope JSON" in err
    assert "line 4: non_finite at `Loss`, actual=inf" in err
    assert "line 7: out_of_range at `dopamine`, actual=2, limit=[0, 1]" in err
    assert "published 3 message(s), rejected 3 line(s)" in err
    assert "line 5" not in err  # blank lines are skipped


def test_pub_succeeds_when_every_line_is_valid(endpoint: str) -> None:
    code, _, err = run("flow", "pub", endpoint, "--wait", "0", "--linger", "0", stdin='"Ping"\n')
    assert code == 0
    assert "published 1 message(s), rejected 0 line(s)" in err


def test_sub_stops_after_its_timeout(endpoint: str) -> None:
    code, out, err = run("flow", "sub", endpoint, "--timeout", "0.1")
    assert (code, out) == (0, "")
    assert "no message for 0.1 s" in err
    code, _, _ = run("flow", "sub", endpoint, "--timeout", "0.1", "--count", "2")
    assert code == 1


def test_option_values_are_checked(endpoint: str) -> None:
    assert run("flow", "sub", endpoint, "--count", "0")[0] == 2
    assert run("flow", "sub", endpoint, "--timeout", "0")[0] == 2
    assert run("flow", "pub", endpoint, "--wait", "-1")[0] == 2


def test_a_bad_endpoint_is_one_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["flow", "sub", "not-an-endpoint", "--timeout", "0.1"]) == 2
    assert "error: connect 'not-an-endpoint' failed" in capsys.readouterr().err


def test_help_lists_both_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["flow", "--help"]) == 0
    out = capsys.readouterr().out
    assert "pub" in out and "sub" in out


def _start_sub(endpoint: str, *options: str) -> subprocess.Popen[str]:
    command = "import sys; from tensorswap.cli import main; sys.exit(main(sys.argv[1:]))"
    process = subprocess.Popen(
        [sys.executable, "-c", command, "flow", "sub", endpoint, *options],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stderr is not None
    ready = process.stderr.readline()  # "subscribed to …" once the socket is connecting
    assert ready.startswith("subscribed to"), ready
    return process


@pytest.mark.parametrize(
    ("options", "render"),
    [((), encode), (("--bare",), encode_message)],
    ids=["envelope", "bare"],
)
def test_sub_prints_what_pub_publishes(
    endpoint: str, options: tuple[str, ...], render: Callable[[IpcMessage], bytes]
) -> None:
    process = _start_sub(endpoint, "--count", "3", "--timeout", "30", *options)
    try:
        code, _, _ = run("flow", "pub", endpoint, "--wait", "1.5", stdin=LINES)
        assert code == 1
        out, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0
    assert out.splitlines() == [render(message).decode() for message in GOOD]
