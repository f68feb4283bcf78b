"""Which asyncio event loop a long-lived process runs on: asyncio's own, or uvloop when asked.

uvloop (the ``tensorswap[fast]`` extra) implements asyncio's event loop on libuv in C. On
this project's hot path (3,000 one-request peers, ``bench_scale --part peers``) it measured
0.85-1.08x asyncio's coordinator CPU per contribution, within the noise (``docs/scale.md``):
the event loop's own machinery is not where that CPU goes. So asyncio's loop is the default
and uvloop an opt-in (``tensorswap serve --event-loop uvloop``, or ``auto``: uvloop when
installed). Nothing in tensorswap needs it: every loop is driven through asyncio's API.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Callable, Coroutine
from enum import StrEnum
from typing import Any, TypeVar

from tensorswap.errors import TensorSwapError

__all__ = ["EventLoop", "loop_factory", "resolve", "run", "uvloop_available"]

T = TypeVar("T")


class EventLoop(StrEnum):
    """``auto``: uvloop when it is installed, else asyncio's; or the one named (the
    default, where a caller does not say, is ``asyncio``)."""

    AUTO = "auto"
    ASYNCIO = "asyncio"
    UVLOOP = "uvloop"


class UvloopMissing(TensorSwapError, RuntimeError):
    """``EventLoop.UVLOOP`` was asked for and uvloop is not installed."""


def uvloop_available() -> bool:
    """Whether uvloop can be imported (without importing it)."""
    return importlib.util.find_spec("uvloop") is not None


def resolve(choice: EventLoop | str) -> EventLoop:
    """``choice`` with ``auto`` decided: ``uvloop`` if installed, else ``asyncio``.
    UvloopMissing for ``uvloop`` where it is not installed."""
    choice = EventLoop(choice)
    if choice is EventLoop.AUTO:
        return EventLoop.UVLOOP if uvloop_available() else EventLoop.ASYNCIO
    if choice is EventLoop.UVLOOP and not uvloop_available():
        raise UvloopMissing("uvloop is not installed (pip install 'tensorswap[fast]')")
    return choice


def loop_factory(choice: EventLoop | str) -> Callable[[], asyncio.AbstractEventLoop]:
    """A function that makes a new event loop of the kind ``choice`` resolves to."""
    if resolve(choice) is EventLoop.UVLOOP:
        import uvloop

        return uvloop.new_event_loop
    return asyncio.new_event_loop


def run(main: Coroutine[Any, Any, T], choice: EventLoop | str = EventLoop.ASYNCIO) -> T:
    """``asyncio.run(main)`` on the event loop ``choice`` resolves to."""
    with asyncio.Runner(loop_factory=loop_factory(choice)) as runner:
        return runner.run(main)
