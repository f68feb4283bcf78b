"""A network lab: hosts as Linux network namespaces on a bridge, with shaped links and faults.

For tests, benchmarks and demos that need real links between separate hosts on one machine
(root only; see docs/networks.md)::

    with Lab() as lab:
        coordinator = lab.add_host("coord", mbit=200)
        peer = lab.add_host("peer1", mbit=50)
        server = coordinator.python("-m", "tensorswap.cli.serve_cmd", ...)
        result = peer.start_async(lambda: some_round(coordinator.address, port)).result()
        peer.link_down(); peer.link_up(); lab.partition(peer); lab.heal(peer)
        relay = lab.relay((coordinator.address, port), rtt=0.04, mbit=50)  # latency
        peer.shape(20, limit=16 * 1024)                      # a lossy link (tbf drops)
        shuffle = peer.shuffle_to(coordinator, stats_path, every=8, drop=50)  # reordering

Shaping is tbf on both ends of a host's veth; latency is a delay relay (a userspace TCP
forwarder in its own host) because this kernel has no netem (``Lab.netem_available``);
reordering is a packet shuffler on a TUN device (``netlab.reorder``), for the same reason.
"""

from __future__ import annotations

from tensorswap.netlab.errors import (
    LabCommandFailed,
    LabProcessFailed,
    NamespacesUnavailable,
    NetlabError,
)
from tensorswap.netlab.lab import (
    DEVICE,
    NETWORK,
    Host,
    Lab,
    Relay,
    namespace_exists,
    sweep_stale,
    wait_listening,
)
from tensorswap.netlab.reorder import Shuffle
from tensorswap.netlab.shape import TokenBucket

__all__ = [
    "DEVICE",
    "NETWORK",
    "Host",
    "Lab",
    "LabCommandFailed",
    "LabProcessFailed",
    "NamespacesUnavailable",
    "NetlabError",
    "Relay",
    "Shuffle",
    "TokenBucket",
    "namespace_exists",
    "sweep_stale",
    "wait_listening",
]
