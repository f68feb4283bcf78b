"""DWE configuration: endpoints, env variables (tensorswap and axiom names), validation."""

from __future__ import annotations

import pytest

from tensorswap.delta import (
    DeltaConfigError,
    DweConfig,
    Endpoint,
    FleetKeys,
    InvalidEndpoint,
    SendMode,
    parse_endpoint,
    parse_peers,
)


@pytest.mark.parametrize(
    ("text", "endpoint"),
    [
        ("127.0.0.1:9000", Endpoint("127.0.0.1", 9000)),
        (" node-3.local:0 ", Endpoint("node-3.local", 0)),
        ("[::1]:65535", Endpoint("::1", 65535)),
    ],
)
def test_parse_endpoint(text: str, endpoint: Endpoint) -> None:
    assert parse_endpoint(text) == endpoint
    assert parse_endpoint(str(endpoint)) == endpoint


@pytest.mark.parametrize("text", ["host", ":9000", "host:", "host:70000", "::1:9000", "h:x"])
def test_invalid_endpoints(text: str) -> None:
    with pytest.raises(InvalidEndpoint):
        parse_endpoint(text)


def test_peer_list_skips_blanks_like_the_crate() -> None:
    assert parse_peers(" a:1, ,b:2,") == (Endpoint("a", 1), Endpoint("b", 2))
    assert parse_peers("") == ()


def test_axiom_variables_are_honoured() -> None:
    env = {"AXIOM_DWE_PEERS": "a:1,b:2", "AXIOM_DWE_LISTEN": "0.0.0.0:7000"}
    config = DweConfig.from_env(env)
    assert config.peers == (Endpoint("a", 1), Endpoint("b", 2))
    assert config.listen == Endpoint("0.0.0.0", 7000)


def test_tensorswap_variables_win_even_when_empty() -> None:
    env = {
        "AXIOM_DWE_PEERS": "a:1",
        "TENSORSWAP_DWE_PEERS": "",
        "AXIOM_DWE_LISTEN": "0.0.0.0:1",
        "TENSORSWAP_DWE_LISTEN": "127.0.0.1:2",
    }
    config = DweConfig.from_env(env)
    assert config.peers == ()
    assert config.listen == Endpoint("127.0.0.1", 2)


def test_keys_mode_and_overrides_from_env() -> None:
    env = {
        "TENSORSWAP_DWE_KEY": "new",
        "TENSORSWAP_DWE_PREVIOUS_KEY": "old",
        "TENSORSWAP_DWE_MODE": "per-fragment",
    }
    config = DweConfig.from_env(env, queue_size=4, peers=("c:3",))
    assert config.keys == FleetKeys(b"new", b"old")
    assert config.mode is SendMode.PER_FRAGMENT
    assert config.queue_size == 4 and config.peers == (Endpoint("c", 3),)
    assert DweConfig.from_env({}) == DweConfig()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"queue_size": 0},
        {"max_fragment_bytes": 0},
        {"max_fragment_bytes": 2**32},
        {"connect_timeout": 0},
        {"backoff_initial": 1.0, "backoff_max": 0.5},
        {"max_attempts": 0},
    ],
)
def test_invalid_values_refused(kwargs) -> None:
    with pytest.raises(DeltaConfigError):
        DweConfig(**kwargs)


def test_invalid_env_values_refused() -> None:
    with pytest.raises(DeltaConfigError):
        DweConfig.from_env({"TENSORSWAP_DWE_MODE": "carrier-pigeon"})
    with pytest.raises(InvalidEndpoint):
        DweConfig.from_env({"AXIOM_DWE_PEERS": "nonsense"})
    with pytest.raises(DeltaConfigError):
        DweConfig.from_env({}, no_such_field=1)


def test_defaults_match_the_crate() -> None:
    config = DweConfig()
    assert config.max_fragment_bytes == 8 * 1024 * 1024
    assert config.queue_size == 128
    assert config.mode is SendMode.PERSISTENT


def test_a_key_with_a_byte_that_is_not_utf8_keeps_its_bytes() -> None:
    # os.environ hands such a byte over as a surrogate escape; the key is the original bytes.
    key = b"\xffkey".decode("utf-8", "surrogateescape")
    previous = b"old\xfe".decode("utf-8", "surrogateescape")
    config = DweConfig.from_env(
        {"TENSORSWAP_DWE_KEY": key, "TENSORSWAP_DWE_PREVIOUS_KEY": previous}
    )
    assert config.keys == FleetKeys(b"\xffkey", b"old\xfe")
    assert DweConfig.from_env({"TENSORSWAP_DWE_KEY": "n\u00e9w"}).keys == FleetKeys(
        "n\u00e9w".encode()
    )


@pytest.mark.parametrize("name", ["TENSORSWAP_DWE_KEY", "TENSORSWAP_DWE_PREVIOUS_KEY"])
def test_a_key_that_is_not_text_is_a_config_error(name: str) -> None:
    env = {"TENSORSWAP_DWE_KEY": "k", name: "bad\ud800"}
    with pytest.raises(DeltaConfigError, match=f"{name} is not valid text"):
        DweConfig.from_env(env)


def test_a_peer_port_of_thousands_of_digits_is_an_invalid_endpoint() -> None:
    with pytest.raises(InvalidEndpoint, match="is not a number in 0-65535"):
        DweConfig.from_env({"TENSORSWAP_DWE_PEERS": "a:1,h:" + "9" * 5000})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("backoff_max", float("nan")),
        ("write_timeout", float("nan")),
        ("queue_size", 2.5),
        ("max_fragment_bytes", True),
        ("max_attempts", "3"),
    ],
)
def test_config_values_of_the_wrong_kind_are_refused(field: str, value: object) -> None:
    with pytest.raises(DeltaConfigError, match=field):
        DweConfig(**{field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize("peer", ["h\x00st:1", "ho st:1", "host\n:1"])
def test_a_peer_host_with_control_or_space_characters_is_refused(peer: str) -> None:
    with pytest.raises(InvalidEndpoint, match="control or space"):
        DweConfig(peers=(peer,))
