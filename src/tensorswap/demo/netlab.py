"""`tensorswap demo --netlab`: the demo with the coordinator and each peer on a host of its own.

The hosts are network namespaces of a `tensorswap.netlab.Lab` (root only): ``coord`` runs
`tensorswap serve`, ``peer0`` ... run the peers, each host's link shaped to ``--link-mbit``
both ways; with ``--rtt-ms`` the peers dial the coordinator through a delay relay (host
``relay``) that adds that round-trip time. The driver itself runs in host ``ctl`` (an
unshaped link), on an event loop of its own in a thread inside that namespace, so its
RoundClient reaches the coordinator as any host on the bridge does; the processes it starts
are placed into their hosts with `ip netns exec`. Everything (processes, namespaces, links)
is torn down when the demo ends, fails or is interrupted.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tensorswap.demo.config import DemoConfig, DemoError

if TYPE_CHECKING:
    from rich.console import Console

    from tensorswap.demo.report import DemoReport

__all__ = ["COORDINATOR_PORT", "Placement", "run_in_lab"]

COORDINATOR_PORT = 7000
"""The coordinator's port in its host (a namespace of its own: nothing else listens there)."""


@dataclass(frozen=True)
class Placement:
    """Where the demo's processes run and whom the peers dial."""

    coordinator_listen: str
    coordinator_wrap: tuple[str, ...]
    peer_wraps: tuple[tuple[str, ...], ...]
    peer_target: str
    """HOST:PORT the peers dial: the coordinator, or the delay relay in front of it."""
    links: str
    """The links, in words, for the console."""
    hosts: dict[str, str] = field(default_factory=dict)


def _wrap(namespace: str) -> tuple[str, ...]:
    return ("ip", "netns", "exec", namespace)


def _build(lab: Any, cfg: DemoConfig) -> tuple[Placement, Any]:
    coord = lab.add_host("coord", mbit=cfg.link_mbit)
    peers = [lab.add_host(f"peer{i}", mbit=cfg.link_mbit) for i in range(cfg.peers)]
    ctl = lab.add_host("ctl")
    target = f"{coord.address}:{COORDINATOR_PORT}"
    links = f"{cfg.link_mbit:g} Mbit/s links"
    if cfg.rtt_ms:
        relay = lab.relay(
            (coord.address, COORDINATOR_PORT), rtt=cfg.rtt_ms / 1000, mbit=cfg.link_mbit
        )
        target = f"{relay.address}:{relay.port}"
        links += f", {cfg.rtt_ms:g} ms RTT (a delay relay at {target})"
    placement = Placement(
        coordinator_listen=f"{coord.address}:{COORDINATOR_PORT}",
        coordinator_wrap=_wrap(coord.namespace),
        peer_wraps=tuple(_wrap(p.namespace) for p in peers),
        peer_target=target,
        links=links,
        hosts={h.name: h.address for h in (coord, *peers, ctl)},
    )
    return placement, ctl


def run_in_lab(cfg: DemoConfig, console: Console) -> DemoReport:
    """Build the lab, run the demo inside it (the driver in host ``ctl``), tear it down."""
    from tensorswap.demo.driver import run_demo
    from tensorswap.netlab import Lab, NetlabError

    try:
        lab = Lab()
    except NetlabError as exc:
        raise DemoError(f"--netlab needs network namespaces: {exc}") from exc
    with lab:
        try:
            placement, ctl = _build(lab, cfg)
        except NetlabError as exc:
            raise DemoError(f"--netlab could not build its hosts: {exc}") from exc
        console.print(
            f"network lab: coordinator on {placement.coordinator_listen}, {cfg.peers} peers "
            f"on hosts of their own, {placement.links}"
        )
        state: dict[str, Any] = {}

        def body() -> DemoReport:
            loop = asyncio.new_event_loop()
            task = loop.create_task(run_demo(cfg, console, placement))
            state.update(loop=loop, task=task)
            try:
                return loop.run_until_complete(task)
            finally:
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()

        future = ctl.start(body)
        try:
            return future.result()
        except KeyboardInterrupt:
            # cancel the driver: its cleanup stops and reaps every process, then the lab goes
            loop, task = state.get("loop"), state.get("task")
            if loop is not None and task is not None and not loop.is_closed():
                loop.call_soon_threadsafe(task.cancel)
            with contextlib.suppress(BaseException):
                future.result(timeout=60)
            raise
