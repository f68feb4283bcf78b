"""Watch rounds on a slow network: a coordinator and peers, each in its own lab host.

    sudo python benchmarks/netlab_demo.py --peers 4 --mib 4 --mbit 20 --rtt 0.04 --rounds 5 \\
        --fault link-down

`tensorswap serve` runs in host ``coord``; each peer is a RoundClient in a host of its own
(links shaped with tbf to ``--mbit``; ``--rtt`` adds a delay relay on the path). Every round
each peer submits an update (the last aggregate with two of its eight layers changed, so
only those travel) and fetches the aggregate; one line per round shows its time and bytes.
``--fault`` injects one failure in round 2: ``link-down`` (peer 0's link down for 1 s),
``partition`` (peer 0 cut off for good: later rounds complete by quorum at their deadline),
``kill`` (the coordinator SIGKILLed and restarted; peers reconnect with backoff).
Needs root. This is not `tensorswap demo --netlab` (the digits task); see docs/networks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from tensorswap.netlab import Host, Lab, NamespacesUnavailable, wait_listening
from tensorswap.rounds import Backoff, RoundClient, retrying
from tensorswap.rounds.core import RoundId, RoundSpec
from tensorswap.store import MemoryStore
from tensorswap.wire import Timeouts

PORT, KEY = 7000, b"netlab-demo"
LAYERS = 8


def serve(coord: Host, data: Path) -> subprocess.Popen[Any]:
    proc = coord.python(
        "-m", "tensorswap.cli.serve_cmd", "--listen", f"{coord.address}:{PORT}",
        "--data", str(data), "--key", KEY.decode(), "--timeout", "10", "--log-level", "warning",
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    wait_listening(proc, 60, "tensorswap serve")
    return proc


def peer_main(
    host: Host, index: int, target: tuple[str, int], args: argparse.Namespace,
    turns: list[threading.Barrier], report: list[dict[str, float]],
) -> None:  # fmt: skip
    """One peer's rounds, in a thread inside its host."""
    store = MemoryStore()  # kept across reconnects: a resubmit sends only what is missing
    shared = np.random.default_rng(0)  # every peer starts from the same model
    layer = args.mib * 2**18 // LAYERS
    model = {f"l{k}": shared.standard_normal(layer, np.float32) for k in range(LAYERS)}
    rng = np.random.default_rng(1 + index)

    async def connect() -> RoundClient:
        return await RoundClient.connect(
            *target, peer=f"peer{index}", key=KEY, store=store, timeouts=Timeouts(read=5)
        )

    async def rounds() -> None:
        nonlocal model
        for n in range(1, args.rounds + 1):
            turns[n - 1].wait()
            rid, began = RoundId(n, "demo"), time.perf_counter()
            update = dict(model)  # local training touches two layers of eight this round
            for k in (n % LAYERS, (n + 1) % LAYERS):
                update[f"l{k}"] = model[f"l{k}"] + rng.standard_normal(layer, np.float32)
            sent: list[int] = []

            async def one(
                client: RoundClient, update: dict[str, np.ndarray] = update,
                rid: RoundId = rid, sent: list[int] = sent,
            ) -> dict[str, np.ndarray]:  # fmt: skip
                done = await client.submit(rid, update, 1)
                sent.append(done.push.sent_bytes)
                return await client.fetch_result(rid, timeout=120)

            try:
                model = await retrying(connect, one, Backoff(first=0.1, give_up_after=30))
            except Exception as exc:  # a partitioned peer gives up; the round goes on
                report.append({"peer": index, "round": n, "failed": 1.0})
                print(f"  peer{index} round {n}: gave up ({type(exc).__name__})", flush=True)
                continue
            seconds = time.perf_counter() - began
            report.append({"peer": index, "round": n, "seconds": seconds, "sent": sum(sent)})

    asyncio.run(rounds())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--mib", type=int, default=4, help="update size per peer")
    parser.add_argument("--mbit", type=float, default=20.0, help="each peer link's rate")
    parser.add_argument("--rtt", type=float, default=0.0, help="seconds, through a relay")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--fault", choices=["none", "link-down", "partition", "kill"],
                        default="none")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        lab = Lab()
    except NamespacesUnavailable as exc:
        print(f"cannot build the lab: {exc.reason}")
        return 2
    with lab, tempfile.TemporaryDirectory(prefix="netlab-demo-") as tmp:
        coord = lab.add_host("coord")
        peers = [lab.add_host(f"peer{i}", mbit=args.mbit) for i in range(args.peers)]
        proc = serve(coord, Path(tmp) / "data")
        target = (coord.address, PORT)
        if args.rtt:
            relay = lab.relay(target, rtt=args.rtt, mbit=args.mbit)
            target = (relay.address, relay.port)
        turns = [threading.Barrier(args.peers + 1) for _ in range(args.rounds)]
        report: list[dict[str, float]] = []
        threads = [h.start(lambda h=h, i=i: peer_main(h, i, target, args, turns, report))
                   for i, h in enumerate(peers)]  # fmt: skip
        print(f"{args.peers} peers x {args.mib} MiB, links {args.mbit} Mbit/s, RTT {args.rtt}s")
        for n in range(1, args.rounds + 1):
            quorum = args.peers - 1 if args.fault == "partition" else args.peers
            _start(coord, n, args.peers, quorum)
            began = time.perf_counter()
            turns[n - 1].wait()
            if n == 2 and args.fault != "none":
                proc = _inject(args.fault, lab, coord, peers[0], proc, Path(tmp) / "data")
            while sum(1 for r in report if r["round"] == n) < args.peers:
                time.sleep(0.05)  # a progress display, not a test: polling is fine here
            rows = [r for r in report if r["round"] == n and "seconds" in r]
            sent = sum(r["sent"] for r in rows) / 2**20
            print(f"round {n}: {time.perf_counter() - began:.2f} s, {len(rows)} peers, "
                  f"{sent:.1f} MiB sent up (only changed chunks)", flush=True)  # fmt: skip
        for thread in threads:
            thread.result(timeout=120)
    return 0


def _start(coord: Host, n: int, expected: int, quorum: int) -> None:
    def start() -> None:
        async def go() -> None:
            async with await RoundClient.connect(coord.address, PORT, peer="lead", key=KEY) as c:
                await c.start_round(RoundId(n, "demo"), RoundSpec(expected, quorum, 30.0))

        asyncio.run(go())

    coord.call(start)


def _inject(
    fault: str, lab: Lab, coord: Host, peer: Host, proc: subprocess.Popen[Any], data: Path
) -> subprocess.Popen[Any]:
    if fault == "link-down":
        print("  fault: peer0's link down for 1 s", flush=True)
        peer.link_down()
        time.sleep(1.0)
        peer.link_up()
    elif fault == "partition":
        print("  fault: peer0 partitioned for good", flush=True)
        lab.partition(peer)
    elif fault == "kill":
        print("  fault: coordinator SIGKILLed, restarted on the same data", flush=True)
        coord.kill(proc)
        proc = serve(coord, data)
    return proc


if __name__ == "__main__":
    sys.exit(main())
