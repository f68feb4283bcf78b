"""The test ClientApp, with the bridge's mod when the run config names a block service."""

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
    return blocks_mod(address)(message, context, call_next)


app = client_app([run_config_mod])
