"""One load-generator process of ordinary peers for ``bench_scale --part peers``.

``python -m benchmarks._peer_load PORT KEY ROUND MODE FIRST COUNT CONCURRENCY``: peers
``peer-<FIRST>`` .. ``peer-<FIRST+COUNT-1>``, each its own ``RoundClient`` (its own
connection, handshake with the shared key ``KEY`` (hex), its own store), each submitting
one tiny update of its own values (16 float32, distinct per peer) to round ``ROUND`` of
initiator ``bench`` through the plain ``RoundClient.submit`` (which sends it inline),
``CONCURRENCY`` of them at a time. ``MODE`` ``fresh``: each peer connects, submits and closes
once the parent says go; ``connected``: every peer connects first (before go), then submits,
and stays connected until the report (as a peer between rounds).
Prints ``ready`` once set up, waits for a line on stdin, runs, and prints one JSON line:
the seconds, the user and system CPU of this process while it ran, and the errors.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import sys
import time

import numpy as np

from tensorswap._collector import settle_heap
from tensorswap._eventloop import run as run_loop
from tensorswap.rounds.client import RoundClient
from tensorswap.rounds.core import RoundId

LOOP_ENV = "TENSORSWAP_BENCH_LOOP"
"""The load's event loop (``tensorswap._eventloop``): asyncio unless this says otherwise."""


async def _run(port: int, key: bytes, rid: RoundId, mode: str, first: int, count: int, conc: int):
    names = [f"peer-{i:06}" for i in range(first, first + count)]
    updates = {n: {"w": np.full(16, float(i), np.float32)} for i, n in enumerate(names, first)}
    open_clients: dict[str, RoundClient] = {}
    if mode == "connected":
        for name in names:
            open_clients[name] = await RoundClient.connect("127.0.0.1", port, peer=name, key=key)
    settle_heap()  # as `tensorswap serve` does once it is up
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    todo = list(reversed(names))
    errors: list[str] = []

    async def worker() -> None:
        while todo:
            name = todo.pop()
            try:
                client = open_clients.get(name)
                if client is not None:  # stays connected, as a peer between rounds
                    await client.submit(rid, updates[name], 1)
                    continue
                client = await RoundClient.connect("127.0.0.1", port, peer=name, key=key)
                try:
                    await client.submit(rid, updates[name], 1)
                finally:
                    await client.aclose()
            except Exception as exc:  # counted and reported, the others go on
                errors.append(f"{name}: {exc!r}")

    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(conc)))
    seconds, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
    for client in open_clients.values():
        await client.aclose()
    return {
        "seconds": seconds,
        "user": after.ru_utime - before.ru_utime,
        "sys": after.ru_stime - before.ru_stime,
        "errors": errors[:5],
        "failed": len(errors),
    }


def main() -> None:
    port, key, number, mode = int(sys.argv[1]), bytes.fromhex(sys.argv[2]), sys.argv[3], sys.argv[4]
    first, count, conc = (int(a) for a in sys.argv[5:8])
    rid = RoundId(int(number), "bench")
    report = run_loop(
        _run(port, key, rid, mode, first, count, conc), os.environ.get(LOOP_ENV, "asyncio")
    )
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
