"""One HOST:PORT parser for the CLI, the delta config and the demo peer; each keeps its error."""

from __future__ import annotations

import click
import pytest

from tensorswap._netaddr import HostPortError, split_host_port
from tensorswap.cli._util import parse_host_port
from tensorswap.delta import Endpoint, InvalidEndpoint, parse_endpoint
from tensorswap.demo.peer import parse_args

GOOD = {
    "127.0.0.1:9000": ("127.0.0.1", 9000),
    " node-3.local:0 ": ("node-3.local", 0),
    "[::1]:65535": ("::1", 65535),
    "[fe80::1%eth0]:7": ("fe80::1%eth0", 7),
}
BAD = [
    "host",
    "host:",
    "host:70000",
    "::1:9000",
    "h:x",
    "h:-1",
    "h:²",
    "[]:80",
    "[::1]80",
    "h:" + "9" * 5000,
    "[::1]:" + "1" * 4301,
    "h:165535",
    "h\x00st:80",
    "ho st:80",
    "[::1\n]:80",
]


@pytest.mark.parametrize(("text", "expected"), GOOD.items())
def test_every_caller_reads_the_same_address(text: str, expected: tuple[str, int]) -> None:
    assert split_host_port(text) == expected
    assert parse_host_port(text) == expected
    assert parse_endpoint(text) == Endpoint(*expected)
    assert parse_args(["--index", "0", "--peers", "1", "--coordinator", text]).coordinator == text


@pytest.mark.parametrize("text", BAD)
def test_every_caller_refuses_the_same_text_with_its_own_error(
    text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(HostPortError) as info:
        split_host_port(text)
    assert info.value.text == text and info.value.reason
    with pytest.raises(click.BadParameter, match="invalid address"):
        parse_host_port(text)
    with pytest.raises(InvalidEndpoint, match="invalid DWE endpoint"):
        parse_endpoint(text)
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--index", "0", "--peers", "1", "--coordinator", text])
    assert exit_info.value.code == 2
    assert "--coordinator HOST:PORT" in capsys.readouterr().err


def test_an_empty_host_is_the_default_only_where_one_is_given() -> None:
    assert parse_host_port(":8080") == ("127.0.0.1", 8080)
    assert parse_host_port(":8080", default_host="0.0.0.0") == ("0.0.0.0", 8080)
    assert split_host_port(":8080", default_host="::") == ("::", 8080)
    with pytest.raises(HostPortError, match="host is missing"):
        split_host_port(":8080")
    with pytest.raises(InvalidEndpoint):
        parse_endpoint(":8080")


def test_ipv6_without_brackets_says_how_to_write_it() -> None:
    with pytest.raises(click.BadParameter, match=r"brackets, e.g. \[::1\]:9000"):
        parse_host_port("::1:9000")


def test_a_port_is_read_by_its_significant_digits_and_echoed_cut_short() -> None:
    assert split_host_port("h:000080") == ("h", 80)
    assert split_host_port("h:" + "0" * 5000 + "7") == ("h", 7)
    with pytest.raises(HostPortError) as info:
        split_host_port("h:" + "9" * 5000)
    assert info.value.reason == "port '99999999999999999...' is not a number in 0-65535"
