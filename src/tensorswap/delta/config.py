"""DWE configuration from code or from the environment (tensorswap and axiom variable names)."""

from __future__ import annotations

import enum
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from tensorswap._netaddr import HostPortError, split_host_port
from tensorswap.delta.bincode import MAX_DWE_FRAGMENT_BYTES, MAX_DWE_LAYERS, check_limit
from tensorswap.delta.verify import FleetKeys, GapPolicy
from tensorswap.errors import DeltaError

#: The crate's ``DEFAULT_DWE_QUEUE``.
DEFAULT_DWE_QUEUE = 128

ENV_PEERS = ("TENSORSWAP_DWE_PEERS", "AXIOM_DWE_PEERS")
ENV_LISTEN = ("TENSORSWAP_DWE_LISTEN", "AXIOM_DWE_LISTEN")
ENV_KEY = "TENSORSWAP_DWE_KEY"
ENV_PREVIOUS_KEY = "TENSORSWAP_DWE_PREVIOUS_KEY"
ENV_MODE = "TENSORSWAP_DWE_MODE"


class InvalidEndpoint(DeltaError, ValueError):
    """A peer or listen address that is not ``HOST:PORT``."""

    def __init__(self, text: str, reason: str) -> None:
        self.text = text
        self.reason = reason
        super().__init__(f"invalid DWE endpoint {text!r}: {reason}")


class DeltaConfigError(DeltaError, ValueError):
    """A configuration value out of range, from code or from the environment."""


@dataclass(frozen=True, order=True)
class Endpoint:
    """A TCP endpoint; IPv6 hosts are written ``[::1]:9000``."""

    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def parse_endpoint(text: str | Endpoint) -> Endpoint:
    """Parse ``HOST:PORT`` or ``[IPV6]:PORT``; the port must be 0-65535 (0: any, for listening).

    The rules are :func:`tensorswap._netaddr.split_host_port`'s (a host is required); errors
    are :class:`InvalidEndpoint`.
    """
    if isinstance(text, Endpoint):
        return text
    try:
        host, port = split_host_port(text)
    except HostPortError as exc:
        raise InvalidEndpoint(text, exc.reason) from None
    return Endpoint(host, port)


def parse_peers(text: str) -> tuple[Endpoint, ...]:
    """Parse a comma-separated peer list as the crate does (blank entries are skipped)."""
    return tuple(parse_endpoint(part) for part in text.split(",") if part.strip())


class SendMode(enum.Enum):
    """How the bus talks to each peer."""

    #: One long-lived connection per peer carrying every frame; reconnects with backoff.
    PERSISTENT = "persistent"
    #: A new connection per fragment and peer, as axiom_engine 0.1.5 does.
    PER_FRAGMENT = "per-fragment"


@dataclass(frozen=True)
class DweConfig:
    """Everything a bus or listener needs; every field has the crate's default where it has one.

    Timeouts are in seconds: a listener gives a frame ``frame_timeout`` from its first byte to
    its last, and closes a connection with no frame in progress after ``idle_timeout``.
    ``max_attempts`` is how many times one frame is tried per peer
    (each failed try reconnects after an exponential backoff from ``backoff_initial`` doubling
    up to ``backoff_max``). A listener's async handler must finish within ``handler_timeout``
    (it runs under the lock that orders every fragment), else the fragment is rejected.
    """

    peers: tuple[Endpoint, ...] = ()
    listen: Endpoint | None = None
    max_fragment_bytes: int = MAX_DWE_FRAGMENT_BYTES
    queue_size: int = DEFAULT_DWE_QUEUE
    mode: SendMode = SendMode.PERSISTENT
    keys: FleetKeys | None = field(default=None, repr=False)
    gap_policy: GapPolicy = GapPolicy.ACCEPT
    connect_timeout: float = 5.0
    write_timeout: float = 30.0
    frame_timeout: float = 30.0
    idle_timeout: float = 300.0
    handler_timeout: float = 30.0
    backoff_initial: float = 0.05
    backoff_max: float = 5.0
    max_attempts: int = 3
    max_connections: int = 64
    max_layers: int = MAX_DWE_LAYERS

    def __post_init__(self) -> None:
        object.__setattr__(self, "peers", tuple(parse_endpoint(p) for p in self.peers))
        if self.listen is not None:
            object.__setattr__(self, "listen", parse_endpoint(self.listen))
        counts = ("queue_size", "max_attempts", "max_connections", "max_layers")
        for name in ("max_fragment_bytes", *counts):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise DeltaConfigError(f"{name} must be an integer, got {value!r}")
        try:
            check_limit(self.max_fragment_bytes)
        except ValueError as exc:
            raise DeltaConfigError(str(exc)) from exc
        for name in counts:
            if getattr(self, name) < 1:
                raise DeltaConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        positive = (
            "connect_timeout",
            "write_timeout",
            "frame_timeout",
            "idle_timeout",
            "handler_timeout",
        )
        for name in (*positive, "backoff_initial"):
            if not getattr(self, name) > 0:  # NaN fails too
                raise DeltaConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.backoff_max >= self.backoff_initial:  # NaN fails too
            raise DeltaConfigError("backoff_max must be >= backoff_initial")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> DweConfig:
        """Read peers, listen address, keys and mode from the environment, then apply overrides.

        ``TENSORSWAP_DWE_PEERS`` / ``TENSORSWAP_DWE_LISTEN`` win when set (even empty); otherwise
        ``AXIOM_DWE_PEERS`` / ``AXIOM_DWE_LISTEN`` are honoured for drop-in use.
        ``TENSORSWAP_DWE_KEY`` and ``TENSORSWAP_DWE_PREVIOUS_KEY`` are fleet keys (UTF-8 bytes)
        and ``TENSORSWAP_DWE_MODE`` is ``persistent`` or ``per-fragment``.
        """
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        peers = _first_set(env, ENV_PEERS)
        if peers is not None:
            values["peers"] = parse_peers(peers)
        listen = _first_set(env, ENV_LISTEN)
        if listen is not None and listen.strip():
            values["listen"] = parse_endpoint(listen)
        key = env.get(ENV_KEY)
        if key:
            previous = env.get(ENV_PREVIOUS_KEY) or None
            values["keys"] = FleetKeys(
                _key_bytes(ENV_KEY, key),
                _key_bytes(ENV_PREVIOUS_KEY, previous) if previous else None,
            )
        mode = env.get(ENV_MODE)
        if mode:
            try:
                values["mode"] = SendMode(mode.strip().lower())
            except ValueError as exc:
                detail = f"{ENV_MODE}={mode!r} is not persistent or per-fragment"
                raise DeltaConfigError(detail) from exc
        unknown = set(overrides) - {f.name for f in fields(cls)}
        if unknown:
            raise DeltaConfigError(f"unknown DweConfig fields: {sorted(unknown)}")
        return replace(cls(**values), **overrides)


def _key_bytes(name: str, value: str) -> bytes:
    """The bytes of a key variable: the environment's own bytes (UTF-8 for text; a byte that is
    not UTF-8 comes back as it was, through ``os.environ``'s surrogate escapes)."""
    try:
        return os.fsencode(value)
    except UnicodeEncodeError:  # a lone surrogate that no environment byte decodes to
        raise DeltaConfigError(f"{name} is not valid text (it holds a lone surrogate)") from None


def _first_set(env: Mapping[str, str], names: Iterable[str]) -> str | None:
    for name in names:
        if name in env:
            return env[name]
    return None
