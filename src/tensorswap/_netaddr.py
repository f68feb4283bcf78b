"""``HOST:PORT`` parsing shared by every layer that reads an address (cli, delta, demo)."""

from __future__ import annotations

from tensorswap.errors import TensorSwapError


class HostPortError(TensorSwapError, ValueError):
    """Text that is not ``HOST:PORT`` (a misuse error); callers translate it into their own."""

    def __init__(self, text: str, reason: str) -> None:
        self.text = text
        self.reason = reason
        super().__init__(f"invalid address {text!r}: {reason}")


def split_host_port(text: str, *, default_host: str | None = None) -> tuple[str, int]:
    """``(host, port)`` of ``HOST:PORT`` or ``[IPV6]:PORT``, the port in 0-65535.

    Surrounding whitespace is ignored. An IPv6 host must be written in brackets (``::1:9000``
    is ambiguous and refused). An empty host (``:9000``) is ``default_host``, or refused when
    that is None. Raises :class:`HostPortError` with the reason.
    """
    raw = text.strip()
    if raw.startswith("["):
        host, sep, port_text = raw[1:].partition("]:")
        if sep and not host:
            raise HostPortError(text, "empty host in brackets")
    else:
        host, sep, port_text = raw.rpartition(":")
        if ":" in host:
            raise HostPortError(text, "write IPv6 hosts in brackets, e.g. [::1]:9000")
    if not sep:
        raise HostPortError(text, "expected HOST:PORT")
    if not host:
        if default_host is None:
            raise HostPortError(text, "expected HOST:PORT (the host is missing)")
        host = default_host
    if not host.isprintable() or any(c.isspace() for c in host):
        raise HostPortError(text, "the host holds a control or space character")
    # At most 5 significant digits before int(): more are out of range anyway, and int()
    # refuses more than 4,300 digits with a bare ValueError.
    digits = port_text.lstrip("0") or "0"
    if (
        not (port_text.isascii() and port_text.isdigit())
        or len(digits) > 5
        or not 0 <= int(digits) <= 65535
    ):
        shown = port_text if len(port_text) <= 20 else port_text[:17] + "..."
        raise HostPortError(text, f"port {shown!r} is not a number in 0-65535")
    return host, int(digits)
