"""A simulation worker: many virtual clients over a few connections to the coordinator.

``SimWorker`` is the same in both backends: ``start`` connects a ``VirtualClients`` pool and
registers each hosted client for runs under its own name; ``round`` trains the hosted
clients the coordinator sampled (from the round's global model, fetched once) and submits
their updates in batches (``submit_many``), training the next chunk while the previous ones
are on the wire, and dropping each chunk's blocks once the coordinator holds them durably.
The ``process`` backend runs it as ``python -m tensorswap.simulate.worker``: JSON-line
commands on stdin, one JSON-line answer each on stdout.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tensorswap.cid import Cid
from tensorswap.simulate.errors import InvalidSimulation
from tensorswap.simulate.task import SimTask, make_task
from tensorswap.store import ModelUpdate, put_update

if TYPE_CHECKING:
    from tensorswap.rounds.core import RoundId

__all__ = ["MAX_INFLIGHT", "SimWorker", "client_name", "main"]

MAX_INFLIGHT = 2
"""Chunks of a worker's round trained but not yet durable on the coordinator, at most."""


def client_name(index: int) -> str:
    """The peer name of virtual client ``index``."""
    return f"sim-{index:06d}"


class SimWorker:
    """The virtual clients ``spec["clients"]`` (indices) of one worker.

    ``spec``: ``host``, ``port``, ``clients``, ``task`` (a ``SimConfig.task_spec()``),
    ``connections``, ``chunk`` (clients trained per submitted batch).
    """

    def __init__(self, spec: Mapping[str, Any]) -> None:
        try:
            self.host = str(spec["host"])
            self.port = int(spec["port"])
            self.indices = [int(i) for i in spec["clients"]]
            self.task_spec = dict(spec["task"])
            self.connections = int(spec.get("connections", 2))
            self.chunk = max(1, int(spec.get("chunk", 16)))
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidSimulation(f"a bad worker spec: {exc}") from None
        self.hosted = set(self.indices)
        self.pool: Any = None
        self.task: SimTask | None = None

    async def start(self) -> dict[str, Any]:
        """Connect, build the task, register every hosted client; the ready report."""
        from tensorswap.rounds.client import VirtualClients
        from tensorswap.runs.client import RunClient

        self.task = await asyncio.to_thread(make_task, self.task_spec)
        name = f"sim-worker-{os.getpid()}"
        self.pool = await VirtualClients.connect(
            self.host, self.port, connections=self.connections, name=name
        )
        for index in self.indices:
            runs = RunClient(self.pool.client_for(client_name(index)))
            await runs.register({"num_samples": self.task.num_samples(index)})
        return {"event": "ready", "pid": os.getpid(), "clients": len(self.indices)}

    def _traffic(self) -> tuple[int, int]:
        sent = received = 0
        for client in self.pool.clients:
            transport = client.blocks.conn.transport
            sent += int(transport.bytes_sent)
            received += int(transport.bytes_received)
        return sent, received

    def _round_command(self, cmd: Mapping[str, Any]) -> tuple[RoundId, Cid, list[int]]:
        """A round command's round, global model and clients; InvalidSimulation for a
        malformed one, or one naming clients this worker does not host."""
        from tensorswap.rounds.core import RoundId

        try:
            rid = RoundId(int(cmd["round"]), str(cmd["run"]))
            cid = Cid.parse(str(cmd["global_cid"]))
            chosen = [int(i) for i in cmd["clients"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidSimulation(f"a bad round command: {exc}") from None
        strangers = sorted(set(chosen) - self.hosted)
        if strangers:
            raise InvalidSimulation(f"clients {strangers[:5]} are not hosted by this worker")
        return rid, cid, chosen

    async def round(self, cmd: Mapping[str, Any]) -> dict[str, Any]:
        """Train and submit the sampled clients ``cmd["clients"]`` of round ``cmd["round"]``
        of run ``cmd["run"]`` from the model ``cmd["global_cid"]``; the round's report."""
        from tensorswap.rounds.client import PeerSubmit

        assert self.task is not None and self.pool is not None, "start() first"
        rid, cid, chosen = self._round_command(cmd)
        start = time.perf_counter()
        sent0, received0 = self._traffic()
        model = await self.pool.reader.fetch(cid)
        tensors = dict(model.tensors)
        store, task = self.pool.store, self.task
        keep = set(store)  # the global model's blocks (each chunk's updates reuse none else)

        def train(part: Sequence[int]) -> tuple[list[PeerSubmit], list[float], set[Cid]]:
            """Train ``part``, put its updates in the store: the submits, losses, blocks."""
            items, losses = [], []
            for index in part:
                new, loss = task.train(index, rid.round, tensors)
                samples = task.num_samples(index)
                cid = put_update(store, ModelUpdate(new, samples))
                items.append(PeerSubmit(client_name(index), cid, samples))
                losses.append(loss)
            blocks = set(self.pool._closure([item.update for item in items]))
            return items, losses, blocks

        # at most MAX_INFLIGHT chunks trained and not yet durable on the coordinator: the
        # blocks of each chunk leave the store once it is (memory: a few chunks, not a round)
        inflight: list[tuple[asyncio.Task[list[Any]], set[Cid]]] = []
        outcomes: list[Any] = []
        losses: list[float] = []
        train_s = 0.0

        async def settle() -> None:
            send, blocks = inflight.pop(0)
            outcomes.extend(await send)
            others = set().union(*(b for _, b in inflight)) if inflight else set()
            for block in blocks - keep - others:
                store.delete(block)

        try:
            for at in range(0, len(chosen), self.chunk):
                t0 = time.perf_counter()
                part = chosen[at : at + self.chunk]
                items, part_losses, blocks = await asyncio.to_thread(train, part)
                train_s += time.perf_counter() - t0
                losses.extend(part_losses)
                inflight.append((asyncio.ensure_future(self.pool.submit_many(rid, items)), blocks))
                while len(inflight) > MAX_INFLIGHT:
                    await settle()
            while inflight:
                await settle()
        except BaseException:
            for send, _ in inflight:
                send.cancel()
            await asyncio.gather(*(send for send, _ in inflight), return_exceptions=True)
            raise
        refused = [f"{type(o).__name__}: {o}" for o in outcomes if isinstance(o, Exception)]
        sent1, received1 = self._traffic()
        for block in list(store):  # this round's updates and model: not needed again
            store.delete(block)
        return {
            "event": "round_done",
            "round": rid.round,
            "submitted": len(outcomes) - len(refused),
            "refused": len(refused),
            "errors": refused[:5],
            "train_loss": sum(losses) / len(losses) if losses else None,
            "train_s": train_s,
            "seconds": time.perf_counter() - start,
            "sent_bytes": sent1 - sent0,
            "received_bytes": received1 - received0,
        }

    async def aclose(self) -> None:
        if self.pool is not None:
            pool, self.pool = self.pool, None
            await pool.aclose()


def _emit(event: Mapping[str, Any]) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


async def _serve() -> int:
    worker: SimWorker | None = None
    try:
        while line := await asyncio.to_thread(sys.stdin.readline):
            try:
                cmd = json.loads(line)
                if not isinstance(cmd, dict):
                    raise InvalidSimulation("a command is a JSON object")
                kind = cmd.get("cmd")
                if kind == "start" and worker is None:
                    worker = SimWorker(cmd.get("spec") or {})
                    _emit(await worker.start())
                elif kind == "round" and worker is not None:
                    _emit(await worker.round(cmd))
                elif kind == "stop":
                    break
                else:
                    raise InvalidSimulation(f"unexpected command {kind!r}")
            except Exception as exc:  # reported to the driver, which stops the simulation
                print(traceback.format_exc(), file=sys.stderr, flush=True)
                _emit({"event": "error", "message": f"{type(exc).__name__}: {exc}"})
                return 1
    finally:
        if worker is not None:
            await worker.aclose()
    return 0


def main() -> int:
    """The ``process`` backend's worker: commands on stdin until ``stop`` or end of input."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return asyncio.run(_serve())


if __name__ == "__main__":
    sys.exit(main())
