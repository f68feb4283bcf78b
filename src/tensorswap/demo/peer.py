"""One federated peer of `tensorswap demo`: `python -m tensorswap.demo.peer --index I ...`.

The peer holds its own non-IID shard of digits (see `tensorswap.demo.task`) and a copy of the
model. The driver (`tensorswap.demo.driver`) sends it commands on stdin, one JSON object a line:

    {"cmd": "peers", "endpoints": {"peer-0": "127.0.0.1:40001", ...}}   # p2p only
    {"cmd": "round", "round": 3, "initiator": "demo-1a2b", "deadline_s": 20.0,
     "expect": ["peer-0", "peer-1", ...]}                     # one round
    {"cmd": "run", "run": "demo-1a2b"}                        # a whole federated run
    {"cmd": "diloco", "group": "demo-1a2b", "outer_steps": 10}  # DiLoCo (--topology diloco)
    {"cmd": "stop"}                                           # (or end of input)

and reads its reports on stdout, one JSON object a line (never pickle): ``ready``,
``trained``, ``submitted``, ``round``, ``contributed``, ``refused``, ``run_done``, ``outer``,
``diloco_done`` and ``error`` events (see `docs/demo.md`). Logs and
tracebacks go to stderr.

Star topology: the peer trains locally, submits its update to the coordinator's round
(`RoundClient`), waits for the aggregate, fetches it (only blocks it lacks) and evaluates it.
With ``--compression`` other than ``none`` it submits its weight *delta* against the round's
global model, stored with that lossy encoding, and keeps what the encoding lost as a residual
added to the next round's delta (error feedback); the aggregate is then a delta too, which the
peer adds to the global model it started from.

P2P topology: no coordinator. The peer broadcasts its delta as a DWE fragment on the delta bus
to every other peer (split into several parts when it exceeds ``--max-fragment-bytes``),
collects every part of the others' deltas for the round (until the deadline), and aggregates
the whole deltas itself, weighting by each peer's sample count (known to every peer, as the
shards are a deterministic split).

DiLoCo topology: the peer joins a collective group at the rendezvous (``--coordinator``, a
`tensorswap serve`), takes ``--inner-steps`` minibatch steps on its shard, then all-reduces
its pseudo-gradient with the others (``--compression`` none, f16 or int8) and takes the
outer Nesterov step, once per outer step, evaluating the (shared) model after each.
"""

# This module is the process (its options, its command loop, and its --help: the docstring
# above). What the peer holds and how it trains are in `demo.local`, one round of either
# topology in `demo.peer_rounds`, DiLoCo's loop in `demo.peer_diloco`, the p2p reassembly of
# the others' deltas in `demo.inbox`.

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from typing import Any

from tensorswap._netaddr import HostPortError, split_host_port
from tensorswap.delta.bincode import MAX_DWE_FRAGMENT_BYTES
from tensorswap.demo.inbox import SEQ_STRIDE as SEQ_STRIDE
from tensorswap.demo.inbox import DeltaInbox
from tensorswap.demo.local import PeerState as PeerState
from tensorswap.demo.local import build_state, commands, emit_ready, fail, next_command
from tensorswap.demo.local import emit as emit
from tensorswap.demo.peer_diloco import run_diloco
from tensorswap.demo.peer_rounds import p2p_round, star_round
from tensorswap.demo.peer_run import run_tasks

__all__ = ["COMPRESSIONS", "DeltaInbox", "main"]

COMPRESSIONS = ("none", "f16", "int8", "topk")
#: Room for a part's header and a few values of a slice.
MIN_FRAGMENT_BYTES = 1024


async def run_star(args: argparse.Namespace) -> int:
    from tensorswap.errors import WireError
    from tensorswap.rounds.client import RoundClient
    from tensorswap.wire.connection import Timeouts

    name = f"peer-{args.index}"
    host, port = split_host_port(args.coordinator)  # checked by parse_args
    try:
        client = await RoundClient.connect(host, port, peer=name, timeouts=Timeouts(connect=10.0))
    except (OSError, TimeoutError, WireError) as exc:
        reason = str(exc) or type(exc).__name__
        return fail(
            f"{name} cannot reach the coordinator at {args.coordinator}: {reason} "
            "(is `tensorswap serve` listening there?)"
        )
    async with client, contextlib.AsyncExitStack() as stack:
        state = await asyncio.to_thread(build_state, args)
        if args.swarm:  # serve fetched aggregates to the other peers, fetch from them
            from tensorswap.swarm import SwarmPeer

            node = SwarmPeer(client.store, peer=name, listen=(args.swarm_listen, 0))
            client.cut.enabled = client.push_results = False  # the swarm fetches results
            state.swarm = await stack.enter_async_context(node)
        seeding = {} if state.swarm is None else {"swarm": _seeding(state.swarm)}
        emit_ready(state, **seeding)
        reader = await commands()
        while (cmd := await next_command(reader)) is not None and cmd.get("cmd") != "stop":
            if cmd.get("cmd") == "round":
                await star_round(state, client, cmd)
            elif cmd.get("cmd") == "run":
                await run_tasks(state, client, cmd)
    return 0


def _seeding(node: Any) -> str:
    """``HOST:PORT`` where a SwarmPeer's seeder listens."""
    return f"{node.listen[0]}:{node.seeder.port}"


async def run_p2p(args: argparse.Namespace) -> int:
    from tensorswap.delta import DweBus, DweConfig, DweListener

    state = await asyncio.to_thread(build_state, args)
    state.inbox = DeltaInbox(state.weights())
    config = DweConfig(max_fragment_bytes=args.max_fragment_bytes)
    inbox: asyncio.Queue[Any] = asyncio.Queue()
    async with DweListener(inbox, config=config) as listener:
        emit_ready(state, listen=str(listener.endpoint))
        reader = await commands()
        cmd = await next_command(reader)
        if cmd is None or cmd.get("cmd") == "stop":
            return 0
        if cmd.get("cmd") != "peers":
            return fail(f"expected the peers command first, got {cmd!r}")
        endpoints: dict[str, str] = dict(cmd["endpoints"])
        bus: DweBus | None = None
        members: tuple[str, ...] | None = None
        try:
            while (cmd := await next_command(reader)) is not None and cmd.get("cmd") != "stop":
                if cmd.get("cmd") != "round":
                    continue
                # One bus to the peers this round expects: a peer that left is dropped
                # rather than retried (with backoff) round after round.
                want = tuple(p for p in cmd.get("expect", []) if p != state.name)
                if want != members:
                    if bus is not None:
                        await bus.aclose()
                    to = [endpoints[p] for p in want if p in endpoints]
                    bus = DweBus(to, config=config, drain_timeout=1.0)
                    await bus.start()
                    members = want
                assert bus is not None
                await p2p_round(state, bus, inbox, cmd)
        finally:
            if bus is not None:
                await bus.aclose()
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tensorswap.demo.peer", description=__doc__)
    parser.add_argument("--index", type=int, required=True, help="this peer's shard, 0-based")
    parser.add_argument("--peers", type=int, required=True, help="how many shards in all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--local-epochs", type=int, default=2)
    parser.add_argument("--topology", choices=("star", "p2p", "diloco"), default="star")
    parser.add_argument("--coordinator", default="", help="HOST:PORT (star; diloco: rendezvous)")
    parser.add_argument("--compression", choices=COMPRESSIONS, default="none")
    parser.add_argument("--aggregator", default="fedavg", help="p2p: how deltas are combined")
    parser.add_argument(
        "--inner-steps", type=int, default=20, help="diloco: minibatch steps per outer step"
    )
    parser.add_argument("--freeze-first-layer", action="store_true", help="train the head only")
    parser.add_argument(
        "--swarm",
        action="store_true",
        help="star: fetch aggregates from the coordinator and the other peers at once, and "
        "serve them on (a read-only seeder on --swarm-listen, any port)",
    )
    parser.add_argument(
        "--swarm-listen", default="127.0.0.1", help="--swarm: the address other peers dial"
    )
    parser.add_argument(
        "--max-fragment-bytes",
        type=int,
        default=MAX_DWE_FRAGMENT_BYTES,
        help="p2p: the DWE size cap (8 MiB); a larger delta is sent in several parts",
    )
    parser.add_argument(
        "--slow-factor",
        type=float,
        default=1.0,
        help="runs: train this many times slower (wait after each local training)",
    )
    args = parser.parse_args(argv)
    if not (1.0 <= args.slow_factor <= 1000.0):
        parser.error("--slow-factor must be in [1, 1000]")
    if not MIN_FRAGMENT_BYTES <= args.max_fragment_bytes <= 2**32 - 1:
        parser.error(f"--max-fragment-bytes must be in [{MIN_FRAGMENT_BYTES}, 2**32 - 1]")
    if not 0 <= args.index < args.peers:
        parser.error(f"--index must be in [0, {args.peers})")
    if args.inner_steps < 1:
        parser.error("--inner-steps must be at least 1")
    if args.topology in ("star", "diloco"):
        try:
            split_host_port(args.coordinator)
        except HostPortError as exc:
            parser.error(
                f"--coordinator HOST:PORT is required with --topology {args.topology} ({exc})"
            )
    if args.topology == "diloco" and args.compression == "topk":
        parser.error("--compression topk does not apply to diloco (none, f16 or int8)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runner = {"star": run_star, "p2p": run_p2p, "diloco": run_diloco}[args.topology]
    try:
        return asyncio.run(runner(args))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 1  # the driver went away


if __name__ == "__main__":
    sys.exit(main())
