"""Which asyncio event loop a long-lived process runs on: uvloop when installed, else asyncio's.

uvloop (the ``tensorswap[fast]`` extra) implements asyncio's event loop on libuv in C: the
per-request machinery of thousands of connections (transports, handles, the selector, the
thread-safe wake-ups) costs less Python there (``docs/scale.md`` has the figures). Nothing in
tensorswap needs it: every loop is asyncio's API, and the standard loop is the fallback and
what the tests run on unless they ask for uvloop.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Callable, Coroutine
from enum import StrEnum
from typing import Any, TypeVar

__all__ = ["EventLoop", "loop_factory", "resolve", "run", "uvloop_available"]

T = TypeVar("T")


class EventLoop(StrEnum):
    """``auto``: uvloop when it is installed, else asyncio's; or the one named."""

    AUTO = "auto"
    ASYNCIO = "asyncio"
    UVLOOP = "uvloop"


class UvloopMissing(RuntimeError):
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


def run(main: Coroutine[Any, Any, T], choice: EventLoop | str = EventLoop.AUTO) -> T:
    """``asyncio.run(main)`` on the event loop ``choice`` resolves to."""
    with asyncio.Runner(loop_factory=loop_factory(choice)) as runner:
        return runner.run(main)
