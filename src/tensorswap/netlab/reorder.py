"""A packet shuffler: reorders (and may drop) one host's IP packets toward another, in userspace.

This kernel has no netem, iptables or nft, so nothing in it reorders packets. This does,
with what it has (a TUN device and a packet socket): in the sending host, a route sends
every packet for the target address into ``tun``; this process (``python -m
tensorswap.netlab.reorder``, started by ``Host.shuffle_to``) reads them there and writes
them out of ``eth0`` to the target's MAC address, holding back every ``every``-th packet
until ``depth`` later ones have gone (or ``hold`` seconds pass with none), and dropping
every ``drop``-th one (0: none). Packets are whole IP datagrams at most the MTU (a TUN
device without offloads), their checksums complete, so they are sent unchanged. The other
direction is not touched. It prints ``ready`` once the device exists, and its counters
(``packets``, ``reordered``, ``dropped``) to ``--stats`` every 100 packets and at exit.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import fcntl
import itertools
import json
import os
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from tensorswap.netlab._sys import run
from tensorswap.netlab.errors import LabCommandFailed, LabProcessFailed

if TYPE_CHECKING:
    from tensorswap.netlab.lab import Host

DEVICE = "eth0"  # as lab.DEVICE (not imported: lab imports this module's user)
_DEVICES = itertools.count()

__all__ = ["Shuffle", "Shuffler", "main", "start_shuffle"]

_TUNSETIFF = 0x400454CA
_IFF_TUN, _IFF_NO_PI = 0x0001, 0x1000
_ETH_P_IP = 0x0800
_MAX_PACKET = 65_535


def open_tun(name: str) -> int:
    """Create TUN device ``name`` (gone when this process exits); its file descriptor."""
    fd = os.open("/dev/net/tun", os.O_RDWR)
    request = struct.pack("16sH22x", name.encode(), _IFF_TUN | _IFF_NO_PI)
    fcntl.ioctl(fd, _TUNSETIFF, request)
    return fd


class Shuffler:
    """The reorder and drop rule, apart from the devices (so it can be tested alone)."""

    def __init__(self, every: int, depth: int, hold: float, drop: int = 0) -> None:
        if every < 2 or depth < 1 or hold <= 0 or drop < 0:
            raise ValueError(f"bad shuffle: every={every} depth={depth} hold={hold} drop={drop}")
        self.every, self.depth, self.hold, self.drop = every, depth, hold, drop
        self.packets = self.reordered = self.dropped = self.sent = 0
        self._held: collections.deque[tuple[bytes, int, float]] = collections.deque()

    def take(self, packet: bytes, now: float) -> list[bytes]:
        """The packets to send, in order, now that ``packet`` arrived."""
        self.packets += 1
        if self.drop and self.packets % self.drop == 0:
            self.dropped += 1
            return self.due(now)
        if self.packets % self.every == 0:
            self.reordered += 1
            self._held.append((packet, self.sent + self.depth, now + self.hold))
            return self.due(now)
        self.sent += 1
        return [packet, *self.due(now)]

    def due(self, now: float) -> list[bytes]:
        """Held packets whose ``depth`` later ones have gone, or whose ``hold`` ran out."""
        out = []
        while self._held and (self._held[0][1] <= self.sent or self._held[0][2] <= now):
            out.append(self._held.popleft()[0])
            self.sent += 1
        return out

    def wait(self, now: float) -> float | None:
        """Seconds until the first held packet must go (None: nothing held)."""
        return max(0.0, self._held[0][2] - now) if self._held else None

    def counters(self) -> dict[str, int]:
        return {"packets": self.packets, "reordered": self.reordered, "dropped": self.dropped}


@dataclass(frozen=True, slots=True)
class Shuffle:
    """A running shuffler (``Host.shuffle_to``): ``host``'s packets to ``target`` pass it."""

    host: str
    target: str
    stats: Path
    proc: subprocess.Popen[Any] = field(repr=False, compare=False)

    def counters(self) -> dict[str, int]:
        """``packets``, ``reordered``, ``dropped`` so far (written every 100 packets)."""
        return {k: int(v) for k, v in json.loads(self.stats.read_text()).items()}

    def stop(self) -> dict[str, int]:
        """Stop it (its device and route go with it); the final counters."""
        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.wait(timeout=30)
        return self.counters()


def start_shuffle(
    host: Host,
    target: Host,
    stats: Path,
    *,
    every: int = 8,
    depth: int = 3,
    hold: float = 0.005,
    drop: int = 0,
    startup: float = 60.0,
) -> Shuffle:
    """Route ``host``'s packets for ``target`` through a shuffler (see the module); its
    counters go to the file ``stats``. The lab kills it at close; ``stop`` ends it sooner."""
    Shuffler(every, depth, hold, drop)  # the arguments' checks, before anything starts
    device = f"tsr{next(_DEVICES)}"
    link = run("ip", "-n", target.namespace, "-o", "link", "show", DEVICE).stdout
    mac = re.search(r"link/ether ([0-9a-f:]{17})", link)
    if mac is None:
        raise LabCommandFailed(["ip", "link", "show", DEVICE], 0, f"no MAC in {link!r}")
    proc = host.python(
        "-m", "tensorswap.netlab.reorder", "--tun", device, "--to-mac", mac.group(1),
        "--every", str(every), "--depth", str(depth), "--hold", repr(hold), "--drop", str(drop),
        "--stats", str(stats), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], startup)
    if not ready or proc.stdout.readline().strip() != "ready":
        proc.kill()
        proc.wait(timeout=30)
        err = proc.stderr.read() if proc.stderr is not None else ""
        raise LabProcessFailed(f"shuffler {host.name}->{target.name}", f"did not start: {err!r}")
    ns = host.namespace
    for knob in ("all", "default", DEVICE):  # replies arrive on eth0, the route is the TUN's
        run("ip", "netns", "exec", ns, "sysctl", "-qw", f"net.ipv4.conf.{knob}.rp_filter=0")
    run("ip", "-n", ns, "link", "set", device, "up")
    run("ip", "-n", ns, "route", "add", f"{target.address}/32", "dev", device, "src", host.address)
    return Shuffle(host.name, target.name, stats, proc)


def _mac(text: str) -> bytes:
    parts = text.split(":")
    if len(parts) != 6:
        raise ValueError(f"not a MAC address: {text!r}")
    return bytes(int(p, 16) for p in parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tun", required=True, help="the TUN device to create")
    parser.add_argument("--device", default="eth0", help="where the packets go out")
    parser.add_argument("--to-mac", required=True, help="the next hop's (the target's) MAC")
    parser.add_argument("--every", type=int, default=8, help="hold back every N-th packet")
    parser.add_argument("--depth", type=int, default=3, help="...until this many have gone")
    parser.add_argument("--hold", type=float, default=0.005, help="...or this many seconds")
    parser.add_argument("--drop", type=int, default=0, help="drop every N-th packet (0: none)")
    parser.add_argument("--stats", required=True, type=Path, help="where counters go (JSON)")
    args = parser.parse_args(argv)
    shuffler = Shuffler(args.every, args.depth, args.hold, args.drop)
    tun = open_tun(args.tun)
    out = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(_ETH_P_IP))
    out.bind((args.device, 0))
    source = _mac(Path(f"/sys/class/net/{args.device}/address").read_text().strip())
    header = _mac(args.to_mac) + source + struct.pack("!H", _ETH_P_IP)

    def write_stats() -> None:
        args.stats.write_text(json.dumps(shuffler.counters()))

    def stop(signum: int, frame: FrameType | None) -> None:
        write_stats()
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    write_stats()
    print("ready", flush=True)
    while True:
        ready, _, _ = select.select([tun], [], [], shuffler.wait(time.monotonic()))
        now = time.monotonic()
        packets = shuffler.take(os.read(tun, _MAX_PACKET), now) if ready else shuffler.due(now)
        for packet in packets:
            with contextlib.suppress(OSError):  # the link is down: lost, as on a wire
                out.send(header + packet)
        if ready and shuffler.packets % 100 == 0:
            write_stats()


if __name__ == "__main__":
    sys.exit(main())
