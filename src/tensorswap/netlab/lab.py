"""The lab: hosts as network namespaces on one bridge, shaped links, faults, processes, relays.

Every name the lab makes starts with its prefix (``tsnl<pid>x<n>``), and it makes nothing
in the root namespace: the bridge lives in a switch namespace of its own, and each veth pair
is created straight into the two namespaces it joins. ``close`` (also on ``with`` exit, at
interpreter exit, and for labs of dead processes at the next lab's start) kills the lab's
processes and deletes its namespaces, which takes their links and qdiscs with them.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import ipaddress
import itertools
import os
import re
import select
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Self, TypeVar

from tensorswap.netlab import shape as shaping
from tensorswap.netlab._sys import (
    check_available,
    in_namespace,
    quiet,
    run,
    run_coroutine,
    start_in_namespace,
)
from tensorswap.netlab.errors import LabCommandFailed, LabProcessFailed

if TYPE_CHECKING:
    from tensorswap.netlab.reorder import Shuffle

__all__ = ["DEVICE", "NETWORK", "Host", "Lab", "Relay", "sweep_stale"]

T = TypeVar("T")

NETWORK = ipaddress.ip_network("198.18.0.0/15")
"""Where host addresses come from: the range set aside for benchmarking (RFC 2544)."""
DEVICE = "eth0"
"""Each host's one interface, as the host sees it."""
BRIDGE = "br0"
RELAY_NICE = -10
#: A relay's pipe holds this many bandwidth-delay products: the link's own (rate x RTT/2)
#: and one more as the bottleneck's queue (the classic router buffer). The rate itself is
#: tbf's on the host's link; with no queue a relay the scheduler runs a little late would turn
#: the machine's CPU load into lost link capacity, which a kernel link (netem) does not.
RELAY_QUEUE = 2
"""Relays run at this nice level (root may raise priority)."""
PREFIX = "tsnl"
_STALE = re.compile(rf"^{PREFIX}(\d+)x\d+-")
_NAME = re.compile(r"^[a-z][a-z0-9]{0,15}$")
_SEQUENCE = itertools.count(1)
_LIVE: weakref.WeakSet[Lab] = weakref.WeakSet()


def sweep_stale() -> list[str]:
    """Delete the namespaces of labs whose process is gone (after a crash); their names."""
    listed = run("ip", "netns", "list", check=False).stdout.split("\n")
    removed = []
    for line in listed:
        name = line.split(" ", 1)[0]
        match = _STALE.match(name)
        if match is None or _alive(int(match.group(1))):
            continue
        pids = run("ip", "netns", "pids", name, check=False).stdout.split()
        for pid in pids:
            if pid.isdigit():
                _kill(int(pid))
        quiet(["ip", "netns", "del", name])
        removed.append(name)
    return removed


@dataclass(eq=False)
class Host:
    """One machine of the lab: a namespace with one interface (``eth0``) on the lab's bridge."""

    lab: Lab
    name: str
    namespace: str
    address: str
    port: str
    """Its link's far end, on the bridge in the switch namespace."""

    # ── its link ─────────────────────────────────────────────────────────────
    def shape(
        self, up_mbit: float | None, down_mbit: float | None = None, *, limit: int = 0
    ) -> None:
        """Rate-limit the link: ``up_mbit`` from this host, ``down_mbit`` to it (default
        the same); None leaves that direction unshaped. A tbf qdisc on each end's egress.

        ``limit``: the bytes tbf queues before it drops (default 50 ms at the rate). A
        shallow one (a few packets) makes a lossy link: what a burst brings beyond the
        bucket and the queue is dropped (``drops`` counts it), as on a real bottleneck."""
        down_mbit = up_mbit if down_mbit is None else down_mbit
        for namespace, device, rate in (
            (self.namespace, DEVICE, up_mbit),
            (self.lab.switch, self.port, down_mbit),
        ):
            if rate is None:
                shaping.clear(namespace, device)
            else:
                bucket = shaping.TokenBucket.mbit(rate, limit=limit)
                shaping.set_token_bucket(namespace, device, bucket)

    def drops(self) -> tuple[int, int]:
        """Packets the link's qdiscs dropped so far: (from this host, to it)."""
        return (
            shaping.dropped(self.namespace, DEVICE),
            shaping.dropped(self.lab.switch, self.port),
        )

    def tcp_counters(self) -> dict[str, int]:
        """This host's TCP counters (``/proc/net/snmp`` Tcp and ``netstat`` TcpExt, as the
        namespace sees them): ``RetransSegs``, ``TCPOFOQueue`` (segments that came out of
        order), ``TCPLostRetransmit``, ..."""
        return shaping.tcp_counters(self.namespace)

    def qdiscs(self) -> tuple[str, str]:
        """`tc qdisc show` of the link's two ends: (this host's egress, its ingress)."""
        return (
            shaping.show(self.namespace, DEVICE),
            shaping.show(self.lab.switch, self.port),
        )

    def shuffle_to(self, target: Host, stats: Path, **rule: Any) -> Shuffle:
        """Reorder (and with ``drop``, lose) this host's packets to ``target``: a userspace
        shuffler on a TUN device (``netlab.reorder``; no netem here). ``rule``: ``every``,
        ``depth``, ``hold``, ``drop``; counters in the file ``stats``."""
        from tensorswap.netlab.reorder import start_shuffle

        return start_shuffle(self, target, stats, **rule)

    def link_down(self) -> None:
        """`ip link set eth0 down`: this host's sends fail at once, nothing reaches it."""
        run("ip", "-n", self.namespace, "link", "set", DEVICE, "down")

    def link_up(self) -> None:
        """Bring the link back (with its address and route)."""
        run("ip", "-n", self.namespace, "link", "set", DEVICE, "up")

    # ── processes and threads inside it ──────────────────────────────────────
    def popen(self, argv: Sequence[str], **options: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside this host (`ip netns exec`); the lab kills it at close."""
        command = ["ip", "netns", "exec", self.namespace, *argv]
        proc = subprocess.Popen(command, **options)
        self.lab._procs.append(proc)
        return proc

    def python(self, *args: str, **options: Any) -> subprocess.Popen[Any]:
        """``popen`` of this interpreter with ``args`` (``-m module ...``)."""
        return self.popen([sys.executable, *args], **options)

    @staticmethod
    def kill(proc: subprocess.Popen[Any], sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` (default SIGKILL) to a process started here and reap it."""
        if proc.poll() is None:
            proc.send_signal(sig)
        return proc.wait(timeout=30)

    def call(self, fn: Callable[[], T]) -> T:
        """``fn()`` in a thread inside this host: sockets it opens are this host's."""
        return in_namespace(self.namespace, fn)

    def start(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """``call`` without waiting: a Future of ``fn()`` (``asyncio.wrap_future`` awaits it)."""
        return start_in_namespace(self.namespace, fn, thread_name=f"{self.name}@netlab")

    def start_async(self, factory: Callable[[], Awaitable[T]]) -> concurrent.futures.Future[T]:
        """Run ``factory()`` on an event loop of its own in a thread inside this host."""
        return self.start(run_coroutine(factory))


@dataclass(frozen=True, slots=True)
class Relay:
    """A running delay relay: dial ``address:port`` to reach its target with the delay."""

    name: str
    address: str
    port: int
    target: tuple[str, int]
    delay: float
    cap: int
    proc: subprocess.Popen[Any] = field(repr=False, compare=False)


class Lab:
    """Hosts joined through one bridge; a context manager that tears everything down.

    NamespacesUnavailable (a NetlabError) where namespaces cannot be made (not root, no
    iproute2); LabCommandFailed when a command building the lab fails (what was built is
    torn down first).
    """

    def __init__(self) -> None:
        check_available()
        sweep_stale()
        self.prefix = f"{PREFIX}{os.getpid()}x{next(_SEQUENCE)}"
        self.switch = f"{self.prefix}-sw"
        self.hosts: dict[str, Host] = {}
        self.relays: list[Relay] = []
        self._procs: list[subprocess.Popen[Any]] = []
        self._namespaces: list[str] = []
        self._closed = False
        _LIVE.add(self)
        try:
            self._add_namespace(self.switch)
            run("ip", "-n", self.switch, "link", "add", BRIDGE, "type", "bridge")
            run("ip", "-n", self.switch, "link", "set", BRIDGE, "up")
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ── building ─────────────────────────────────────────────────────────────
    def add_host(self, name: str, *, mbit: float | None = None) -> Host:
        """A new host on the bridge with the next free address; ``mbit`` shapes its link."""
        if not _NAME.match(name):
            raise ValueError(f"host names are [a-z][a-z0-9]{{0,15}}, got {name!r}")
        if name in self.hosts:
            raise ValueError(f"the lab already has a host {name!r}")
        index = len(self.hosts) + 1
        address = str(NETWORK.network_address + index)
        namespace, port = f"{self.prefix}-{name}", f"v{index}"
        self._add_namespace(namespace)
        run("ip", "link", "add", DEVICE, "netns", namespace, "type", "veth",
            "peer", "name", port, "netns", self.switch)  # fmt: skip
        run("ip", "-n", self.switch, "link", "set", port, "master", BRIDGE, "up")
        run("ip", "-n", namespace, "addr", "add", f"{address}/{NETWORK.prefixlen}", "dev", DEVICE)
        run("ip", "-n", namespace, "link", "set", DEVICE, "up")
        host = Host(self, name, namespace, address, port)
        self.hosts[name] = host
        if mbit is not None:
            host.shape(mbit)
        return host

    def _add_namespace(self, name: str) -> None:
        run("ip", "netns", "add", name)
        self._namespaces.append(name)
        run("ip", "-n", name, "link", "set", "lo", "up")

    def partition(self, *hosts: Host) -> None:
        """Cut ``hosts`` off the bridge: their links stay up, their packets vanish silently
        (no error, no reset: the far side sees nothing until its own timeouts)."""
        for host in hosts:
            run("ip", "-n", self.switch, "link", "set", host.port, "nomaster")

    def heal(self, *hosts: Host) -> None:
        """Join partitioned ``hosts`` to the bridge again."""
        for host in hosts:
            run("ip", "-n", self.switch, "link", "set", host.port, "master", BRIDGE)

    def netem_available(self) -> bool:
        """Whether this kernel has netem (else latency needs ``relay``)."""
        return shaping.netem_available(self.switch)

    def relay(
        self,
        target: tuple[str, int],
        *,
        rtt: float,
        mbit: float,
        host: str = "relay",
        startup: float = 60.0,
    ) -> Relay:
        """A delay relay in host ``host`` (made, unshaped, on first use) forwarding to
        ``target``: each direction delayed by ``rtt``/2, at most rate x delay bytes in flight."""
        where = self.hosts.get(host) or self.add_host(host)
        delay = rtt / 2
        cap = max(64 * 1024, round(mbit * 1e6 / 8 * delay * RELAY_QUEUE))
        # Raised priority: the pipe holds exactly rate x delay, so a relay the scheduler runs
        # late would turn the machine's CPU load into lost link capacity.
        proc = where.popen(
            ["nice", "-n", str(RELAY_NICE), sys.executable, "-m", "tensorswap.netlab.relay",
             "--listen", f"{where.address}:0", "--target", f"{target[0]}:{target[1]}",
             "--delay", repr(delay), "--cap", str(cap)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        name = f"relay {host}->{target[0]}:{target[1]}"
        port = wait_listening(proc, startup, name)
        relay = Relay(name, where.address, port, target, delay, cap, proc)
        self.relays.append(relay)
        return relay

    # ── teardown ─────────────────────────────────────────────────────────────
    def close(self) -> None:
        """Kill every process the lab started, delete its namespaces (and so its links).
        Safe to call twice; failures to remove something already gone are ignored."""
        if self._closed:
            return
        self._closed = True
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
            for stream in (proc.stdout, proc.stderr, proc.stdin):
                if stream is not None:
                    stream.close()
        for namespace in reversed(self._namespaces):
            for pid in run("ip", "netns", "pids", namespace, check=False).stdout.split():
                if pid.isdigit():
                    _kill(int(pid))
            quiet(["ip", "netns", "del", namespace])
        _LIVE.discard(self)

    def namespaces(self) -> list[str]:
        """The namespaces this lab made and has not deleted."""
        return [] if self._closed else list(self._namespaces)


def wait_listening(proc: subprocess.Popen[Any], timeout: float, name: str) -> int:
    """The port of a child's ``listening on HOST:PORT`` stderr line (LabProcessFailed if it
    exits or says nothing of the kind for ``timeout`` seconds; it is killed then)."""
    stream = proc.stderr
    if stream is None:
        raise LabProcessFailed(name, "started without a stderr pipe")
    seen: list[str] = []
    while True:
        line = read_line(stream, time.monotonic() + timeout)
        if not line:
            proc.kill()
            proc.wait(timeout=30)
            raise LabProcessFailed(name, f"did not start listening: {''.join(seen)[-2000:]!r}")
        seen.append(line)
        if line.startswith("listening on "):
            return int(line.rsplit(":", 1)[1])


def read_line(stream: IO[Any], deadline: float) -> str:
    """The next line of a child's pipe ``stream`` ("" at end of file or at ``deadline``, a
    ``time.monotonic()`` instant), read a byte at a time from its file descriptor: a buffered
    ``readline`` would pull the lines after it into Python's buffer, where ``select`` no
    longer sees them (a line logged just before ``listening on`` then hid it). The stream's
    own buffer must be empty (nothing read through it before)."""
    fd = stream.fileno()
    line = bytearray()
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return ""
        byte = os.read(fd, 1)
        if not byte:
            break
        line += byte
    return line.decode(errors="replace")


def namespace_exists(name: str) -> bool:
    """Whether ``ip netns list`` names ``name``."""
    listed = run("ip", "netns", "list").stdout.split("\n")
    return any(line.split(" ", 1)[0] == name for line in listed)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)


@atexit.register
def _close_all() -> None:
    for lab in list(_LIVE):
        with contextlib.suppress(LabCommandFailed):
            lab.close()
