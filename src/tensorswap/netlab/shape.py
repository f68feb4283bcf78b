"""Link shaping with `tc`: a token bucket (tbf) per direction; netem where the kernel has it."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from tensorswap.netlab._sys import quiet, run

__all__ = ["TokenBucket", "clear", "netem_available", "set_token_bucket"]

_MIN_BURST = 16 * 1024
_MIN_LIMIT = 64 * 1024
_MIN_PACKET = 1514  # an Ethernet frame of a 1500-byte MTU


@dataclass(frozen=True, slots=True)
class TokenBucket:
    """A tbf qdisc: ``rate_bit`` bits/s; ``burst`` and ``limit`` bytes (defaults from the rate).

    ``burst`` defaults to 10 ms at the rate (at least 16 KiB: a few full frames), ``limit``
    (the queue in front of the bucket) to 50 ms at the rate (at least 64 KiB).
    """

    rate_bit: int
    burst: int = 0
    limit: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.rate_bit, int) or self.rate_bit < 8_000:
            raise ValueError(f"rate_bit must be an int >= 8000 bit/s, got {self.rate_bit!r}")
        per_second = self.rate_bit / 8
        if self.burst <= 0:
            object.__setattr__(self, "burst", max(_MIN_BURST, math.ceil(per_second * 0.010)))
        if self.limit <= 0:
            object.__setattr__(self, "limit", max(_MIN_LIMIT, math.ceil(per_second * 0.050)))

    @classmethod
    def mbit(cls, rate: float, *, limit: int = 0) -> TokenBucket:
        """A bucket of ``rate`` Mbit/s (10^6 bit/s, as `tc` counts ``mbit``); ``limit``
        bytes of queue (0: the default)."""
        if not math.isfinite(rate) or rate <= 0:
            raise ValueError(f"rate must be a positive number of Mbit/s, got {rate!r}")
        if limit and limit < _MIN_PACKET:
            raise ValueError(f"limit must hold one full packet ({_MIN_PACKET} bytes), got {limit}")
        return cls(round(rate * 1_000_000), limit=limit)

    def argv(self) -> list[str]:
        """The `tc qdisc ... tbf` arguments after ``root``."""
        return [
            "tbf",
            "rate",
            f"{self.rate_bit}bit",
            "burst",
            str(self.burst),
            "limit",
            str(self.limit),
        ]


def set_token_bucket(namespace: str, device: str, bucket: TokenBucket) -> None:
    """Make ``bucket`` the root qdisc of ``device`` (its egress) in ``namespace``."""
    run("ip", "netns", "exec", namespace, "tc", "qdisc", "replace", "dev", device, "root",
        *bucket.argv())  # fmt: skip


def clear(namespace: str, device: str) -> None:
    """Remove ``device``'s root qdisc (back to the default); nothing if it has none."""
    quiet(["ip", "netns", "exec", namespace, "tc", "qdisc", "del", "dev", device, "root"])


def show(namespace: str, device: str) -> str:
    """`tc qdisc show dev DEVICE` in ``namespace``."""
    return run("ip", "netns", "exec", namespace, "tc", "qdisc", "show", "dev", device).stdout


def dropped(namespace: str, device: str) -> int:
    """Packets ``device``'s qdiscs dropped (`tc -s qdisc show`, summed); 0 without any."""
    stats = run("ip", "netns", "exec", namespace, "tc", "-s", "qdisc", "show", "dev", device)
    return sum(int(n) for n in re.findall(r"dropped (\d+)", stats.stdout))


def tcp_counters(namespace: str) -> dict[str, int]:
    """The namespace's Tcp (``/proc/net/snmp``) and TcpExt (``/proc/net/netstat``) counters."""
    counters: dict[str, int] = {}
    for path, group in (("/proc/net/snmp", "Tcp:"), ("/proc/net/netstat", "TcpExt:")):
        text = run("ip", "netns", "exec", namespace, "cat", path).stdout
        rows = [line.split() for line in text.splitlines() if line.startswith(group)]
        for names, values in zip(rows[::2], rows[1::2], strict=True):
            counters.update(
                (n, int(v))
                for n, v in zip(names[1:], values[1:], strict=True)
                if v.lstrip("-").isdigit()
            )
    return counters


def netem_available(namespace: str) -> bool:
    """Whether this kernel has the netem qdisc (tried on a scratch dummy device)."""
    device = "netemprobe0"
    made = run("ip", "-n", namespace, "link", "add", device, "type", "dummy", check=False)
    if made.returncode != 0:
        return False
    try:
        tried = run("ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device,
                    "root", "netem", "delay", "1ms", check=False)  # fmt: skip
        return tried.returncode == 0
    finally:
        quiet(["ip", "-n", namespace, "link", "del", device])
