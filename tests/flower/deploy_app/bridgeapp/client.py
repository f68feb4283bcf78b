"""The test ClientApp, with the bridge's mod when the run config names a block service; the
node keeps its blocks in the directory its node config names (``blocks-store``), if any."""

from __future__ import annotations

from collections.abc import Callable

from apps import client_app
from flwr.app import Context, Message

from tensorswap.flower import blocks_mod


def run_config_mod(
    message: Message, context: Context, call_next: Callable[[Message, Context], Message]
) -> Message:
    address = str(context.run_config["blocks"])
    if not address:
        return call_next(message, context)
    store = str(context.node_config.get("blocks-store", "")) or None
    return blocks_mod(address, store=store)(message, context, call_next)


app = client_app([run_config_mod])
