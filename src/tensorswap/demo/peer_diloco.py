"""A demo peer's DiLoCo loop: join the collective, inner steps, sync, evaluate, report.

After ``ready`` the peer waits for ``{"cmd": "diloco", "group": NAME, "outer_steps": R}``,
joins the collective group NAME at the rendezvous (``--coordinator``, a `tensorswap serve`)
with the other ``--peers`` peers, and then R times: takes ``--inner-steps`` minibatch steps on
its shard (`demo.task.StepTrainer`, its momentum and batch order carried over), syncs through
`tensorswap.collective.DiLoCo` (the all-reduced pseudo-gradient, the outer Nesterov step) and
evaluates the model, the same on every peer after a sync, on the test split. It reports each
outer step as an ``outer`` event, then ``diloco_done``, and stays in the group until the
driver says stop (end of input): a peer that left at once could still be serving the slices
of the last call to a slower member.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from tensorswap.demo.local import (
    PeerState,
    build_state,
    commands,
    emit,
    emit_ready,
    fail,
    next_command,
)

__all__ = ["COLLECTIVE_COMPRESSION", "run_diloco"]

COLLECTIVE_COMPRESSION = {"none": "none", "f16": "fp16", "int8": "int8"}
"""The demo's ``--compression`` names for what `tensorswap.collective` calls them (no topk)."""
JOIN_TIMEOUT_S = 120.0
"""How long a peer waits for the whole group at the rendezvous (torch imports are slow)."""


async def run_diloco(args: argparse.Namespace) -> int:
    """The peer process with ``--topology diloco``; its exit code."""
    from tensorswap.collective import CollectiveError
    from tensorswap.errors import WireError

    state = await asyncio.to_thread(build_state, args)
    emit_ready(state)
    reader = await commands()
    cmd = await next_command(reader)
    if cmd is None or cmd.get("cmd") == "stop":
        return 0
    if cmd.get("cmd") != "diloco":
        return fail(f"expected the diloco command first, got {cmd!r}")
    group = await _join(state, str(cmd["group"]))
    if group is None:
        return 2
    async with group:
        try:
            await _outer_steps(state, group, int(cmd["outer_steps"]))
        except (OSError, CollectiveError, WireError) as exc:
            return fail(f"{state.name}: the collective failed: {str(exc) or type(exc).__name__}")
        # Stay (serving this peer's slices) until the driver has every peer's last report.
        while (cmd := await next_command(reader)) is not None and cmd.get("cmd") != "stop":
            pass
    return 0


async def _join(state: PeerState, name: str) -> Any:
    """This peer in the collective group ``name``; None (an ``error`` reported) if it failed."""
    from tensorswap.collective import Collective, CollectiveError
    from tensorswap.errors import WireError

    args = state.args
    try:
        return await Collective.join(
            args.coordinator,
            group=name,
            peer=state.name,
            size=args.peers,
            compression=COLLECTIVE_COMPRESSION[args.compression],  # type: ignore[arg-type]
            timeout=JOIN_TIMEOUT_S,
        )
    except (OSError, CollectiveError, WireError) as exc:
        fail(
            f"{state.name} cannot join the collective at {args.coordinator}: "
            f"{str(exc) or type(exc).__name__}"
        )
        return None


async def _outer_steps(state: PeerState, group: Any, outer_steps: int) -> None:
    from tensorswap.collective import DiLoCo
    from tensorswap.demo.task import StepTrainer

    args = state.args
    trainer = StepTrainer(state.model, state.shard, seed=args.seed * 1_000_003 + args.index)
    diloco = DiLoCo(state.model, group, inner_steps=args.inner_steps)
    for number in range(1, outer_steps + 1):
        start = time.perf_counter()
        loss = await asyncio.to_thread(trainer.run, args.inner_steps)
        trained = time.perf_counter()
        await diloco.sync()  # the plain mean of the pseudo-gradients, as in DiLoCo
        synced = time.perf_counter()
        stats = group.stats
        emit(
            "outer",
            peer=state.name,
            outer_step=number,
            loss=loss,
            accuracy=state.accuracy(),
            bytes_sent=stats.bytes_sent,
            bytes_received=stats.bytes_received,
            compression_error=stats.compression_error,
            members=list(group.members),
            inner_s=trained - start,
            sync_s=synced - trained,
            seconds=time.perf_counter() - start,
        )
    emit("diloco_done", peer=state.name, outer_steps=outer_steps)
