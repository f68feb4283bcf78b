"""A demo peer in a federated run: register, then task after task (fetch, train, submit).

The driver sends ``{"cmd": "run", "run": NAME}`` once; the peer then works through the run
by itself, as a deployed peer would (`tensorswap.runs.client.RunClient`): it long-polls for
its next task, fetches the task's global model (only the blocks it lacks), trains from it,
and submits its new model (sync runs) or its delta from the task's model (async runs, tagged
with the version it trained on). It reports each task on stdout (``contributed`` or
``refused``) and returns when the run is finished.

``--slow-factor F`` makes the peer F times slower than it is: after each local training it
waits (F - 1) times as long as the training took, as a peer on slower hardware would.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

from tensorswap.demo.local import PeerState, emit, log

__all__ = ["run_tasks"]


def _traffic(client: Any) -> tuple[int, int]:
    transport = client.blocks.conn.transport
    return int(transport.bytes_sent), int(transport.bytes_received)


async def run_tasks(state: PeerState, client: Any, cmd: Mapping[str, Any]) -> int:
    """Work through run ``cmd["run"]`` until it is finished; how many tasks were done."""
    from tensorswap.rounds import RoundAlreadyTerminal, RoundClosed
    from tensorswap.runs import NotSelected, RunMode, StaleContribution
    from tensorswap.runs.client import RunClient

    runs = RunClient(client)
    name = str(cmd["run"])
    samples = state.shard.num_samples
    factor = max(1.0, float(state.args.slow_factor))
    await runs.register({"num_samples": samples})
    done = 0
    while (task := await runs.next_task(name)) is not None:
        start = time.perf_counter()
        emit("task", peer=state.name, round=task.round_id.round, version=task.version)
        sent0, got0 = _traffic(client)
        state.load(await runs.fetch_model(task))
        fetched = _traffic(client)[1] - got0
        t0 = time.perf_counter()
        base, loss = await asyncio.to_thread(state.train, done + 1)
        train_s = time.perf_counter() - t0
        if factor > 1.0:
            await asyncio.sleep((factor - 1.0) * train_s)
        trained = state.weights()
        if task.mode is RunMode.ASYNC and not task.dp:
            update = {k: trained[k] - base[k] for k in base}
        else:
            update = trained  # a DP task's delta is taken (and clipped) by RunClient.submit
        try:
            await runs.submit(task, update, num_samples=samples)
        except (StaleContribution, NotSelected, RoundClosed, RoundAlreadyTerminal) as exc:
            log(f"{name} round {task.round_id.round}: {type(exc).__name__}: {exc}")
            emit(
                "refused",
                peer=state.name,
                round=task.round_id.round,
                version=task.version,
                reason=f"{type(exc).__name__}: {exc}",
            )
            continue
        done += 1
        emit(
            "contributed",
            peer=state.name,
            round=task.round_id.round,
            version=task.version,
            loss=loss,
            train_s=train_s,
            seconds=time.perf_counter() - start,
            sent_bytes=_traffic(client)[0] - sent0,
            pulled_bytes=fetched,
        )
    emit("run_done", peer=state.name, run=name, tasks=done)
    return done
