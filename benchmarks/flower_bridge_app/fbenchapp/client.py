"""The benchmark's ClientApp: "training" adds a constant of the node's own to every tensor (each
node's update differs from every other's, so no two replies share a block); with ``frozen``
every other tensor (0, 2, ...) comes back unchanged, as in fine-tuning with half the model
frozen. The bridge's mod when the run config names a block service. Each message's phases
(its process's start, imports done, arrays in, training, reply out) are appended to
``out/trace.jsonl``."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from tensorswap.flower import blocks_mod

IMPORTED = time.time()
TRAINED: dict[str, float] = {}
"""When this process's training began and ended (one message per process, or the last)."""


def process_started() -> float:
    """When this process started (epoch seconds; Linux /proc counts from boot, in ticks)."""
    ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    since = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - since


def trace_mod(
    message: Message, context: Context, call_next: Callable[[Message, Context], Message]
) -> Message:
    """The outermost mod: the message's phases, one line of ``out/trace.jsonl``."""
    began = time.time()
    reply = call_next(message, context)
    phases = {
        "node": int(context.node_config["partition-id"]),
        "round": int(message.content["config"]["server-round"]),  # type: ignore[arg-type]
        "process": process_started(),
        "imported": IMPORTED,
        "mod": began,
        **TRAINED,
        "replied": time.time(),
    }
    with (Path(str(context.run_config["out"])) / "trace.jsonl").open("a") as out:
        out.write(json.dumps(phases) + "\n")
    return reply


def bridge_mod(
    message: Message, context: Context, call_next: Callable[[Message, Context], Message]
) -> Message:
    address = str(context.run_config["blocks"])
    if not address:
        return call_next(message, context)
    return blocks_mod(address)(message, context, call_next)


app = ClientApp(mods=[trace_mod, bridge_mod])


@app.train()
def train(msg: Message, context: Context) -> Message:
    began = time.time()
    node = int(context.node_config["partition-id"])
    frozen = bool(context.run_config["frozen"])
    step = np.float32(0.001 * (node + 1))
    trained = ArrayRecord()
    for i, (name, array) in enumerate(msg.content["arrays"].items()):
        if frozen and i % 2 == 0:
            trained[name] = array  # frozen: returned as received
        else:
            trained[name] = Array(array.numpy() + step)
    TRAINED.update(train=began, trained=time.time())
    metrics = MetricRecord({"num-examples": 1})
    return Message(RecordDict({"arrays": trained, "metrics": metrics}), reply_to=msg)
