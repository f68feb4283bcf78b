"""The benchmark's ClientApp: "training" adds a constant of the node's own to every tensor (each
node's update differs from every other's, so no two replies share a block); with ``frozen``
every other tensor (0, 2, ...) comes back unchanged, as in fine-tuning with half the model
frozen. The bridge's mod when the run config names a block service."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from tensorswap.flower import blocks_mod


def bridge_mod(
    message: Message, context: Context, call_next: Callable[[Message, Context], Message]
) -> Message:
    address = str(context.run_config["blocks"])
    if not address:
        return call_next(message, context)
    return blocks_mod(address)(message, context, call_next)


app = ClientApp(mods=[bridge_mod])


@app.train()
def train(msg: Message, context: Context) -> Message:
    node = int(context.node_config["partition-id"])
    frozen = bool(context.run_config["frozen"])
    step = np.float32(0.001 * (node + 1))
    trained = ArrayRecord()
    for i, (name, array) in enumerate(msg.content["arrays"].items()):
        if frozen and i % 2 == 0:
            trained[name] = array  # frozen: returned as received
        else:
            trained[name] = Array(array.numpy() + step)
    metrics = MetricRecord({"num-examples": 1})
    return Message(RecordDict({"arrays": trained, "metrics": metrics}), reply_to=msg)
